"""Generate functions, tools and a rollout function the generate-hub tests load by dotted path."""

from __future__ import annotations

import asyncio
import json
import os

from miles_platform.data.sample import Sample
from miles_platform.rollout.base_types import GenerateFnInput, GenerateFnOutput, RolloutFnTrainOutput
from miles_platform.rollout.generate_hub import multi_turn, post
from miles_platform.rollout.generate_hub.tool_call import ToolCall

TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


async def add(name: str, params: dict) -> str:
    return str(int(params["a"]) + int(params["b"]))


async def broken_tool(name: str, params: dict) -> str:
    raise ValueError("sandbox down")


async def slow_tool(name: str, params: dict) -> str:
    await asyncio.sleep(30)
    return "late"


def sync_tool(name, params):
    return "not async"


def _log_call(args, evaluation: bool, how: str) -> None:
    with open(os.path.join(args.storage_root, "generate_calls.jsonl"), "a") as f:
        f.write(json.dumps({"evaluation": evaluation, "how": how}) + "\n")


async def old_form_generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """Miles' old form, written as a user would: build the body, post it, fill the sample."""
    _log_call(args, evaluation, "old")
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    body = {"input_ids": sample.prompt_tokens, "sampling_params": sampling_params, "return_logprob": True}
    out = await post(url, body, api_key=args.api_key)
    meta = out["meta_info"]
    sample.response = out["text"]
    sample.response_tokens = [t for _, t, _ in meta["output_token_logprobs"]]
    sample.rollout_log_probs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    sample.loss_mask = [1] * len(sample.response_tokens)
    sample.status = "truncated" if meta["finish_reason"]["type"] == "length" else "completed"
    sample.weight_version_start = sample.weight_version_end = int(meta["weight_version"])
    sample.metadata["generated_by"] = "old_form_generate"
    return sample


def scripted_calls(n: int = 2):
    """A parser that sees a tool call in each of the first `n` model turns, whatever the text (a
    random tiny model never writes <tool_call> on its own)."""
    seen = []

    def parse(text: str) -> list[ToolCall]:
        seen.append(text)
        return [ToolCall("add", {"a": 1, "b": len(seen)})] if len(seen) <= n else []

    return parse


async def scripted_multi_turn(input: GenerateFnInput) -> GenerateFnOutput:
    """New form: multi_turn's episode loop with the `add` tool and a scripted parser (3 turns)."""
    a = input.args
    sample = await multi_turn.run_episode(
        input, scripted_calls(2), add, a.generate_max_turns, a.generate_tool_timeout
    )
    sample.metadata["generated_by"] = "scripted_multi_turn"
    sample.metadata["my_episode_tag"] = a.my_episode_tag  # its own flag (add_arguments)
    return GenerateFnOutput(samples=sample)


def _add_arguments(parser):
    parser.add_argument("--my-episode-tag", type=str, default="plain")
    parser.add_argument("--my-turn-bonus", type=float, default=0.0)
    parser.add_argument("--generate-max-turns", type=int, default=16)  # a RunConfig field: stays ours


scripted_multi_turn.add_arguments = _add_arguments


async def two_args(args, sample):
    return sample


def not_async(input):
    return input


async def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """A whole rollout: the prompts from the data source, one batched /generate, a reward of its own."""
    from miles_platform.models.checkpoint import load_tokenizer

    tok = load_tokenizer(args.hf_checkpoint)
    records = data_source.get_samples(args.rollout_batch_size)
    prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in records]
    n = args.n_samples_per_prompt
    body = {
        "input_ids": [p for p in prompts for _ in range(n)],
        "sampling_params": [
            {"max_new_tokens": 3, "sampling_seed": 7 * rollout_id + k} for k in range(len(prompts) * n)
        ],
        "return_logprob": True,
    }
    outs = iter(await post(f"http://{args.sglang_router_ip}:{args.sglang_router_port}", body, args.api_key))
    groups = []
    for rec, p in zip(records, prompts, strict=True):
        group = []
        for _ in range(n):
            o = next(outs)
            ids = [t for _, t, _ in o["meta_info"]["output_token_logprobs"]]
            group.append(
                Sample(
                    prompt=rec.prompt,
                    prompt_tokens=p,
                    response=o["text"],
                    response_tokens=ids,
                    rollout_log_probs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                    loss_mask=[1] * len(ids),
                    label=rec.label,
                    reward=float(len(ids)),
                    metadata={"prompt_id": rec.id},
                )
            )
        groups.append(group)
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/my_metric": 42})


def wrong_rollout_signature(args, rollout_id):
    return []


async def hangs_on_odd_seeds(input: GenerateFnInput) -> GenerateFnOutput:
    """A user bug: an await that never returns for every other sample; the rest generate normally."""
    if input.sampling_params["sampling_seed"] % 2:
        await asyncio.Event().wait()
    s = await old_form_generate(input.args, input.sample, input.sampling_params, input.evaluation)
    return GenerateFnOutput(samples=s)
