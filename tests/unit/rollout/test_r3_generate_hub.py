"""R3 through the generate hub (the helpers every generate function uses): a single-turn and a
multi-turn generation against a real engine on the tiny Qwen3-MoE record, for every token the
engine was fed (tool output of earlier turns included), the routes HF's own forward takes over the
whole trajectory; a custom function's sample without routes, with too many, or with a trained
token past its routes is refused naming the fix; positions no request fed (tool output after the
final turn) get -1 rows, which the trainer routes itself.
The loop with a multi-turn generate function and R3: tests/e2e/test_model_families_loop.py."""

import asyncio
from argparse import Namespace

import numpy as np
import pytest
import torch

from miles_platform.config import ConfigError
from miles_platform.data.sample import Sample
from miles_platform.models.checkpoint import load_hf_model, load_tokenizer
from miles_platform.models.moe import RoutingReplay
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.rollout.base_types import GenerateFnInput, GenerateState
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.generate_hub import check_routes, multi_turn, single_turn
from miles_platform.rollout.generate_hub.endpoint import append_tool_tokens, truncate
from miles_platform.rollout.generate_hub.tool_call import ToolCall

PARAMS = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", "qwen3_moe")
    server = start_engine_server(ckpt, num_threads=1)
    yield ckpt, server.url, load_tokenizer(ckpt)
    server.stop()


def _state(url, tok, moe_shape=(2, 2)):
    return GenerateState(Namespace(), tok, url, None, moe_shape=moe_shape)


def _hf_routes(ckpt, tokens):
    model = load_hf_model(ckpt).eval()
    rr = RoutingReplay.of(model)
    with torch.no_grad(), rr.record() as rec:
        model(input_ids=torch.tensor([tokens]))
    return np.sort(torch.stack(rec, dim=1).numpy()[: len(tokens) - 1], -1)


def _prompt_sample(tok):
    return Sample(prompt="1+2=", prompt_tokens=tok.encode("12+34=", add_special_tokens=False))


def test_single_turn_records_the_routes_hf_takes(moe):
    ckpt, url, tok = moe
    out = asyncio.run(single_turn.generate(GenerateFnInput(_state(url, tok), _prompt_sample(tok), PARAMS)))
    s = out.samples
    routes = np.array(s.rollout_routed_experts)
    assert routes.shape == (len(s.tokens) - 1, 2, 2)
    assert (np.sort(routes, -1) == _hf_routes(ckpt, s.tokens)).all()
    # eval requests do not ask for routes (as in Miles)
    ev = asyncio.run(
        single_turn.generate(GenerateFnInput(_state(url, tok), _prompt_sample(tok), PARAMS, True))
    )
    assert ev.samples.rollout_routed_experts is None


def test_multi_turn_routes_cover_the_tool_output_of_earlier_turns(moe):
    ckpt, url, tok = moe
    turns = []

    def parse(text):  # the random tiny model emits no tool calls: call one after the first turn
        turns.append(text)
        return [ToolCall("add", {"a": 2, "b": 3})] if len(turns) == 1 else []

    async def execute(name, params):
        return str(params["a"] + params["b"])

    # a turn ends at the first token in the lower half of the vocab (the random model emits no EOS)
    params = {
        **PARAMS,
        "max_new_tokens": 80,
        "ignore_eos": False,
        "stop_token_ids": list(range(len(tok) // 2)),
    }
    inp = GenerateFnInput(_state(url, tok), _prompt_sample(tok), params)
    s = asyncio.run(multi_turn.run_episode(inp, parse, execute, max_turns=2, tool_timeout=5.0))
    assert s.metadata["tool_call_count"] == 1 and s.metadata["turns"] == 2
    assert 0 in s.loss_mask and s.loss_mask[-1] == 1  # tool tokens in the middle, a model turn last
    routes = np.array(s.rollout_routed_experts)
    assert routes.shape == (len(s.tokens) - 1, 2, 2)
    assert (np.sort(routes, -1) == _hf_routes(ckpt, s.tokens)).all()  # tool tokens' rows included
    check_routes(s, "--custom-generate-function-path", "multi_turn", (2, 2))  # complete: unchanged
    assert len(s.rollout_routed_experts) == len(s.tokens) - 1 and min(map(np.min, routes)) >= 0


def test_a_custom_functions_routes_are_checked_and_unfed_tail_positions_padded(moe):
    _, url, tok = moe
    flag, path = "--custom-generate-function-path", "tests.my_fn"
    s = asyncio.run(
        single_turn.generate(GenerateFnInput(_state(url, tok), _prompt_sample(tok), PARAMS))
    ).samples
    n_fed = len(s.tokens) - 1
    append_tool_tokens(s, [5, 6, 7], "xyz")  # after the final turn: never fed to the engine
    check_routes(s, flag, path, (2, 2))
    assert len(s.rollout_routed_experts) == len(s.tokens) - 1
    assert s.rollout_routed_experts[n_fed:] == [[[-1, -1], [-1, -1]]] * 3  # the trainer routes these
    truncate(s, len(s.response_tokens) - 2)  # routes follow a truncation: one row per token but the last
    assert len(s.rollout_routed_experts) == len(s.tokens) - 1

    bare = Sample(
        prompt_tokens=[1, 2, 3], response_tokens=[4, 5], loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0]
    )
    with pytest.raises(ConfigError, match="without rollout_routed_experts; record them: post the body"):
        check_routes(bare, flag, path, (2, 2))
    bare.rollout_routed_experts = [[[0, 1], [2, 3]]] * 5
    with pytest.raises(ConfigError, match="5 rows for 5 tokens"):
        check_routes(bare, flag, path, (2, 2))
    bare.rollout_routed_experts = [[[0, 1, 2], [2, 3, 1]]] * 4
    with pytest.raises(ConfigError, match=r"row 0 not \[2\]\[2\]"):
        check_routes(bare, flag, path, (2, 2))
    bare.rollout_routed_experts = [[[0, 1], [2, 3]]] * 2  # token 4 (trained) was predicted unrouted
    with pytest.raises(ConfigError, match="a token after them has loss mask 1"):
        check_routes(bare, flag, path, (2, 2))


def test_a_multi_turn_generate_function_trains_with_r3_in_a_ci_test_run(moe, tmp_path):
    """The loop with `generate_fns.scripted_multi_turn` (3-turn tool episodes) on the tiny MoE under
    R3 and --ci-test (its checks raise): every routed position replays the engine's choice, which
    in fp32 with the same weights is the trainer's own, so no route flips; a route misaligned by
    even one token would flip. The shard keeps one route row per token but the last."""
    from loop_helpers import small_run_config

    from miles_platform.loop import train
    from miles_platform.store.catalog import Catalog
    from miles_platform.store.paths import StoragePaths

    ckpt, _, tok = moe
    cfg = small_run_config(
        ckpt, tmp_path, custom_generate_function_path="generate_fns.scripted_multi_turn",
        use_rollout_routing_replay=True, ci_test=True, num_rollout=2, rollout_max_response_len=64,
        rollout_stop_token_ids=list(range(3, len(tok) // 2)),
    )  # fmt: skip
    res = train(cfg)
    assert res.final_version == 2
    assert all(m["train/moe_route_flips"] == 0 for m in res.metrics), [
        m["train/moe_route_flips"] for m in res.metrics
    ]
    assert res.ci_checks["train_rollout_logprob_abs_diff"] < cfg.ci_logprob_abs_diff_threshold
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "SELECT bool_and(len(rollout_routed_experts) = len(prompt_tokens) + len(response_tokens) - 1), "
        "max(len(list_filter(turns, lambda t: t.role = 'tool'))), "
        "bool_or(list_contains(loss_mask, 0)) FROM rollouts"
    )
    assert rows == [(True, 2, True)], rows  # tool turns in the trajectories, their routes recorded


def test_agentic_sessions_record_the_routes_of_the_whole_session(moe, tmp_path):
    """The session server under R3: an OpenAI-client agent's 3-turn episode (chat markup and tool
    messages between the model's turns) assembles into a Sample whose routes are HF's own over
    the whole trajectory; then a `--ci-test` loop run on such samples replays them with 0 flips."""
    import json

    from loop_helpers import small_run_config

    from miles_platform.data.dataset import PromptRecord
    from miles_platform.loop import train
    from miles_platform.rollout.manager import RolloutManager

    ckpt, url, tok = moe
    agentic = dict(custom_generate_function_path="miles.rollout.generate_hub.agentic_tool_call.generate",
                   custom_agent_function_path="agent_fns.three_turns", custom_agent_function_mode="inline",
                   use_session_server="v1", use_rollout_routing_replay=True, max_seq_len=200,
                   api_key="r3-secret")  # fmt: skip
    cfg = small_run_config(ckpt, tmp_path, rollout_max_response_len=6, rollout_batch_size=1,
                           n_samples_per_prompt=1, **agentic)  # fmt: skip
    prompt = [{"role": "user", "content": "What is 2+3+7?"}]
    m = RolloutManager(cfg, tok, None, url)
    try:
        [[s]] = m.generate_groups([PromptRecord(id="p0", prompt=json.dumps(prompt), label="12", metadata={})],
                                  [[1]], [[11]])  # fmt: skip
    finally:
        m.close()
    assert s.metadata["turns"] == 3 and 0 in s.loss_mask, s.metadata.get("agent_error")
    routes = np.array(s.rollout_routed_experts)
    assert routes.shape == (len(s.tokens) - 1, 2, 2)
    assert (np.sort(routes, -1) == _hf_routes(ckpt, s.tokens)).all()

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "label": str(2 * i)})
                            + "\n" for i in range(4)))  # fmt: skip
    cfg = small_run_config(ckpt, tmp_path, prompt_data=str(data), ci_test=True, num_rollout=1,
                           rollout_max_response_len=4, **agentic)  # fmt: skip
    res = train(cfg)
    assert res.metrics[0]["multi_turn/turns/max"] == 3
    assert res.metrics[0]["train/moe_route_flips"] == 0
