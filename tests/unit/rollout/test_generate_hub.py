"""Custom generate / rollout functions and multi-turn tool calling (docs/rollout.md).

A scripted stand-in engine answers each turn with fixed tokens, scored by the tiny model's own
forward on the request's input_ids, so the assembled trajectory can be checked against one
teacher-forced forward over all of it: model tokens keep their per-turn log-probs, tool tokens
get loss mask 0 and log-prob 0 (and the singleton support under replay)."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from fastapi import FastAPI, Request
from loop_helpers import small_run_config, small_run_kwargs, write_prompts

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample
from miles_platform.data.source import RolloutDataSource
from miles_platform.loop import train, validate_before_start
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.plugins import load_generate_function, load_rollout_function
from miles_platform.rollout.engine_server import serve_in_thread, start_engine_server
from miles_platform.rollout.generate_hub.tool_call import TOOL_CALL_PARSERS, qwen25_parser, tool_response_text
from miles_platform.rollout.manager import RolloutManager
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths

MULTI_TURN = "miles_platform.rollout.generate_hub.multi_turn.generate"
TOOLS = dict(
    generate_tool_specs_path="generate_fns.TOOL_SPECS",
    generate_tool_call_parser="qwen25",
    generate_execute_tool_function_path="generate_fns.add",
)
SCRIPT = [  # what the "model" says in turn 0, 1, 2 (each then EOS)
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>',
    "17",
]
RECORD = PromptRecord(id="p0", prompt="2+3+5+7=", label="17", metadata={})


@pytest.fixture(scope="module")
def hf(tiny_hf_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32).eval()


def _scores(hf, ids: list[int], start: int, temperature: float) -> torch.Tensor:
    """Tempered logits predicting ids[start:] (one teacher-forced forward)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, start - 1 : -1].float() / temperature


def scripted_engine(hf, tok, temperature: float, top_k: int, seen: list[dict]):
    """/generate that says SCRIPT[turn] (turn = tool messages so far) with the model's log-probs;
    under return_sampling_mask the support is the top-(k-1) tokens plus the one said."""
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        seen.append(body)
        ids, sp = body["input_ids"], body["sampling_params"]
        turn = tok.decode(ids).count("<|im_start|>tool")
        out = (tok.encode(SCRIPT[turn], add_special_tokens=False) + [tok.eos_token_id])[
            : sp["max_new_tokens"]
        ]
        z = _scores(hf, ids + out, len(ids), temperature)
        lps = torch.log_softmax(z, -1).gather(1, torch.tensor(out)[:, None])[:, 0].tolist()
        fin = {"type": "stop"} if out[-1] == tok.eos_token_id else {"type": "length"}
        meta = {
            "finish_reason": fin,
            "weight_version": 3,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
        }
        if body.get("return_sampling_mask"):
            sups = [sorted(set(z[j].topk(top_k - 1).indices.tolist()) | {t}) for j, t in enumerate(out)]
            meta["output_token_sampling_mask"] = sups
            meta["output_token_sampling_logprobs"] = [
                float(torch.log_softmax(z[j, s], -1)[s.index(t)]) for j, (s, t) in enumerate(zip(sups, out))
            ]
        return {"text": tok.decode(out, skip_special_tokens=True), "output_ids": out, "meta_info": meta}

    return serve_in_thread(app, "127.0.0.1", 0, "scripted-engine")


def _episode(
    ckpt, hf, tmp_path, *, temperature=0.8, top_k=-1, max_len=200, **kw
) -> tuple[Sample, list[dict], dict]:
    seen: list[dict] = []
    tok = load_tokenizer(ckpt)
    server = scripted_engine(hf, tok, temperature, top_k, seen)
    cfg = RunConfig(
        **small_run_kwargs(
            ckpt,
            tmp_path,
            custom_generate_function_path=MULTI_TURN,
            **{**TOOLS, **kw},
            rollout_temperature=temperature,
            rollout_top_k=top_k,
            rollout_max_response_len=max_len,
            rollout_batch_size=1,
            n_samples_per_prompt=1,
        )
    )
    validate_before_start(cfg.validate())
    m = RolloutManager(cfg, tok, None, server.url)
    try:
        prompt = tok.encode(RECORD.prompt, add_special_tokens=False)
        [[s]] = m.generate_groups([RECORD], [prompt], [[11]])
        samples = m.finalize(0, [[s]])
        return samples[0], seen, m._metrics(samples, {}, 0.0)
    finally:
        m.close()
        server.stop()


@pytest.mark.parametrize("top_k", [-1, 6], ids=["full-vocab", "replay-top-k"])
def test_a_three_turn_episode_matches_a_teacher_forced_forward(tiny_hf_checkpoint, hf, tmp_path, top_k):
    s, seen, metrics = _episode(tiny_hf_checkpoint, hf, tmp_path, top_k=top_k)
    tok = load_tokenizer(tiny_hf_checkpoint)
    turns = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in SCRIPT]
    tools = [
        tok.encode(
            tool_response_text(tok, [{"role": "tool", "name": "add", "content": c}]), add_special_tokens=False
        )
        for c in ("5", "12")
    ]
    assert s.response_tokens == turns[0] + tools[0] + turns[1] + tools[1] + turns[2]
    assert s.loss_mask == [1] * len(turns[0]) + [0] * len(tools[0]) + [1] * len(turns[1]) + [0] * len(
        tools[1]
    ) + [1] * len(turns[2])
    assert s.status == "completed" and s.metadata["turns"] == 3 and s.metadata["tool_call_count"] == 2
    assert metrics["multi_turn/turns/mean"] == 3 and metrics["rollout/failed"] == 0
    assert metrics["multi_turn/with_tool_call"] == 1 and metrics["multi_turn/tool_calls/failed"] == 0
    # every turn recorded: roles, spans over response_tokens, the calls with their results
    assert [t["role"] for t in s.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    ends = list(itertools.accumulate(len(x) for x in (turns[0], tools[0], turns[1], tools[1], turns[2])))
    assert [(t["start"], t["end"]) for t in s.turns] == list(zip([0, *ends[:-1]], ends))
    for t in s.turns:
        assert set(s.loss_mask[t["start"] : t["end"]]) == {int(t["role"] == "assistant")}
    assert [c["result"] for t in s.turns if t["role"] == "tool" for c in t["tool_calls"]] == ["5", "12"]
    assert s.turns[0]["tool_calls"] == [
        {"name": "add", "arguments": '{"a": 2, "b": 3}', "result": None, "error": None}
    ]
    assert s.turns[-1]["finish_reason"] == "stop" and s.turns[-1]["tool_calls"] == []
    # every turn sent the trajectory so far, with what is left of the budget
    prefix = s.prompt_tokens + turns[0] + tools[0]
    assert seen[1]["input_ids"] == prefix and seen[1]["sampling_params"]["max_new_tokens"] == 200 - len(
        prefix
    ) + len(s.prompt_tokens)
    assert ("return_sampling_mask" in seen[0]) == (top_k > 0)
    # one teacher-forced forward over prompt + whole response: model tokens carry their log-prob
    z = _scores(hf, s.tokens, len(s.prompt_tokens), 0.8)
    if top_k > 0:
        assert all(
            sup == [t]
            for sup, t, k in zip(s.rollout_sampling_support, s.response_tokens, s.loss_mask)
            if not k
        )
        keep = torch.full_like(z, float("-inf"))
        for j, sup in enumerate(s.rollout_sampling_support):
            keep[j, sup] = 0.0
        z = z + keep
    want = torch.log_softmax(z, -1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
    got = torch.tensor(s.rollout_log_probs)
    on = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert torch.allclose(got[on], want[on], atol=1e-5)
    assert (got[~on] == 0).all() and len(got) == len(s.response_tokens)


def test_a_trajectory_past_the_response_budget_is_truncated(tiny_hf_checkpoint, hf, tmp_path):
    tok = load_tokenizer(tiny_hf_checkpoint)
    first = len(tok.encode(SCRIPT[0], add_special_tokens=False)) + 1
    s, seen, _ = _episode(tiny_hf_checkpoint, hf, tmp_path, max_len=first + 3, top_k=6)
    assert s.status == "truncated" and len(seen) == 1  # the tool answer overran the budget
    assert (
        len(s.response_tokens)
        == len(s.loss_mask)
        == len(s.rollout_log_probs)
        == len(s.rollout_sampling_support)
        == first + 3
    )
    assert s.loss_mask == [1] * first + [0] * 3
    assert [(t["role"], t["start"], t["end"]) for t in s.turns] == [
        ("assistant", 0, first),
        ("tool", first, first + 3),
    ]


@pytest.mark.parametrize(
    "tool,why", [("broken_tool", "raised ValueError: sandbox down"), ("slow_tool", "timed out")]
)
def test_a_tool_that_raises_or_times_out_fails_the_episode(tiny_hf_checkpoint, hf, tmp_path, tool, why):
    s, seen, metrics = _episode(
        tiny_hf_checkpoint,
        hf,
        tmp_path,
        generate_execute_tool_function_path=f"generate_fns.{tool}",
        generate_tool_timeout=0.5,
    )
    assert s.status == "failed" and why in s.metadata["tool_error"] and len(seen) == 1
    assert s.remove_sample and s.loss_mask == [0] * len(s.response_tokens)  # kept out of the loss
    assert metrics["rollout/failed"] == 1.0 and metrics["multi_turn/tool_calls/failed"] == 1.0
    [call] = s.turns[-1]["tool_calls"]
    assert s.turns[-1]["role"] == "tool" and call["name"] == "add" and why in call["error"]


def test_the_qwen25_parser_reads_tool_calls_as_sglang_does():
    parse = qwen25_parser(json.loads(json.dumps(__import__("generate_fns").TOOL_SPECS)))
    text = 'x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> <tool_call>{"name": "nope"}</tool_call>'
    assert [(c.name, c.arguments) for c in parse(text)] == [("add", {"a": 1, "b": 2})]  # unknown tool skipped
    assert parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}')[0].arguments == {
        "a": 3
    }  # left open
    assert parse("<tool_call>{not json}</tool_call>") == [] and parse("no call") == []
    choices = RunConfig.__dataclass_fields__["generate_tool_call_parser"].metadata["choices"]
    assert set(choices) == set(TOOL_CALL_PARSERS)  # the flag offers exactly the parsers there are


def test_the_qwen3_coder_parser_types_parameters_by_the_tool_schema():
    """Qwen3.5 / Qwen3-Next's XML-style calls (SGLang's qwen3_coder): values typed by the schema,
    one newline each side dropped, an unknown tool skipped, a call left open still read."""
    specs = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "s": {"type": "string"},
        "opts": {"type": "object"}, "xs": {"type": "array"}}}}}]  # fmt: skip
    parse = TOOL_CALL_PARSERS["qwen3_coder"](specs)
    text = ("think <tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=ok>\nTrue\n</parameter>\n<parameter=s>\n 007\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n"
            "</parameter>\n<parameter=xs>\n[1, 'b']\n</parameter>\n</function>\n</tool_call>"
            "<tool_call><function=g><parameter=n>1</parameter></function></tool_call>"
            "<tool_call>\n<function=f>\n<parameter=n>\nseven\n</parameter>\n<parameter=x>\n3")  # fmt: skip
    calls = parse(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("f", {"n": 42, "x": 2.5, "ok": True, "s": " 007", "opts": {"a": [1]}, "xs": [1, "b"]}),
        ("f", {"n": "seven", "x": 3}),  # not an integer: kept as written; the open call still counts
    ]
    assert parse("no call") == []


# ---------------------------------------------------------------------------- loading and validation
def test_both_generate_forms_load_and_anything_else_is_a_config_error_naming_the_flag():
    assert load_generate_function(MULTI_TURN).__name__ == "generate"  # new form: as is
    assert load_generate_function("miles.rollout.generate_hub.multi_turn.generate").__module__.endswith(
        "multi_turn"
    )
    assert type(load_generate_function("generate_fns.old_form_generate")).__name__ == "OldFormGenerate"
    for path, needle in [
        ("generate_fns.two_args", "takes 2 required positional"),
        ("generate_fns.not_async", "is not async"),
        ("generate_fns.nope", "has no attribute 'nope'"),
        ("no_such_mod_q.generate", "cannot import module"),
    ]:
        with pytest.raises(ConfigError, match=f"--custom-generate-function-path '{path}'.*{needle}"):
            load_generate_function(path)
    with pytest.raises(
        ConfigError, match="--rollout-function-path .*generate_rollout\\(args, rollout_id, data_source"
    ):
        load_rollout_function("generate_fns.wrong_rollout_signature")


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(custom_generate_function_path="generate_fns.two_args"), "--custom-generate-function-path"),
        (dict(rollout_function_path="generate_fns.wrong_rollout_signature"), "--rollout-function-path"),
        (dict(custom_generate_function_path=MULTI_TURN), "needs --generate-tool-specs-path"),
        (
            dict(
                custom_generate_function_path=MULTI_TURN,
                **{**TOOLS, "generate_execute_tool_function_path": "generate_fns.sync_tool"},
            ),
            "--generate-execute-tool-function-path .*must be `async def",
        ),
        (
            dict(
                custom_generate_function_path=MULTI_TURN,
                **{**TOOLS, "generate_tool_specs_path": "generate_fns.add"},
            ),
            "--generate-tool-specs-path .*expected a non-empty list",
        ),
        (TOOLS, "read by a generate function; set --custom-generate-function-path"),
        (dict(rollout_function_path="generate_fns.generate_rollout", fully_async=True), "--fully-async"),
    ],
)
def test_a_bad_generate_setup_is_a_config_error_before_ray_starts(tiny_hf_checkpoint, tmp_path, kw, needle):
    cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, **kw))
    with pytest.raises(ConfigError, match=needle):
        train(cfg)
    assert not os.path.exists(cfg.storage_root)  # nothing started, nothing written


def test_add_arguments_registers_the_functions_own_flags(tmp_path):
    base = [
        "--rollout-batch-size",
        "2",
        "--custom-generate-function-path",
        "generate_fns.scripted_multi_turn",
    ]
    cfg = parse_run_config([*base, "--my-episode-tag", "cli", "--generate-max-turns", "3"])
    assert (
        cfg.custom_function_args == {"my_episode_tag": "cli", "my_turn_bonus": 0.0}
        and cfg.generate_max_turns == 3
    )
    (tmp_path / "c.yaml").write_text("my_turn_bonus: 0.5\nmy-episode-tag: yaml\n")
    cfg = parse_run_config([*base, "--config", str(tmp_path / "c.yaml"), "--my-episode-tag", "cli"])
    assert cfg.custom_function_args == {"my_episode_tag": "cli", "my_turn_bonus": 0.5}  # CLI over YAML
    with pytest.raises(SystemExit):  # still no flag nobody registered
        parse_run_config([*base, "--my-typo", "1"])
    with pytest.raises(SystemExit):  # and not without the function that registers it
        parse_run_config(["--rollout-batch-size", "2", "--my-episode-tag", "x"])


def test_a_rollout_function_replaces_the_rollout(tiny_hf_checkpoint, tmp_path):
    engine = start_engine_server(tiny_hf_checkpoint, num_threads=1)
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, rollout_function_path="generate_fns.generate_rollout", rm_type=None
    )
    records = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=", label=str(2 * i)) for i in range(4)]
    src = RolloutDataSource(records)
    m = RolloutManager(cfg, load_tokenizer(tiny_hf_checkpoint), src, engine.url)
    try:
        samples, metrics = m.generate(0)
    finally:
        m.close()
        engine.stop()
    assert [s.metadata["prompt_id"] for s in samples] == ["p0", "p0", "p1", "p1"]  # from the data source
    assert [s.index for s in samples] == [0, 1, 2, 3] and [s.group_index for s in samples] == [0, 0, 1, 1]
    assert all(s.raw_reward == len(s.response_tokens) == 3 for s in samples)  # its own reward
    assert metrics["rollout/my_metric"] == 42.0 and metrics["rollout/num_samples"] == 4


# ---------------------------------------------------------------------------- real loop runs
def test_multi_turn_from_the_launchpad_in_a_ci_test_run(tiny_hf_checkpoint, tmp_path):
    """The rl_training job with a multi-turn config, as the Launchpad sends it (the function's own
    flag as custom_function_flags), on real engines: 3-turn episodes (scripted tool calls, real
    tool, chat-template tool tokens) under top-k replay; --ci-test holds (its checks raise: step-0
    ppo_kl 0, trainer and engine log-probs agree); the shards keep the turns for DuckDB."""
    import dagster as dg

    from ops.training import rl_training
    from resources.storage import StorageRootResource

    kw = small_run_kwargs(
        tiny_hf_checkpoint,
        tmp_path,
        custom_generate_function_path="generate_fns.scripted_multi_turn",
        ci_test=True,
        num_rollout=1,
        rollout_top_k=6,
        rollout_max_response_len=64,
        rollout_stop_token_ids=list(range(3, 64)),
        rollout_max_concurrency=2,
    )
    root = kw.pop("storage_root")
    instance = dg.DagsterInstance.ephemeral()
    job_config = {**kw, "custom_function_flags": ["--my-episode-tag", "ci"]}
    result = rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": job_config}}},
        instance=instance,
        resources={"storage": StorageRootResource(root=root)},
    )
    assert result.success
    cfg = RunConfig(**{**kw, "storage_root": root})
    (record,) = instance.fetch_materializations(dg.AssetKey("policy_versions"), limit=5).records
    assert record.asset_materialization.metadata["multi_turn/turns/max"].value == 3
    samples = _shard_samples(cfg)
    assert all(s.metadata["generated_by"] == "scripted_multi_turn" for s in samples)
    assert max(s.metadata["turns"] for s in samples) == 3
    assert all(s.metadata["my_episode_tag"] == "ci" for s in samples)
    for s in samples:
        n = len(s.response_tokens)
        assert len(s.loss_mask) == len(s.rollout_log_probs) == len(s.rollout_sampling_support) == n <= 64
        tool = [j for j in range(n) if not s.loss_mask[j]]
        assert all(
            s.rollout_log_probs[j] == 0 and s.rollout_sampling_support[j] == [s.response_tokens[j]]
            for j in tool
        )
    assert any(0 in s.loss_mask and 1 in s.loss_mask for s in samples)
    # the shard keeps every turn: tool calls per episode and per tool, in SQL over the rollouts view
    _, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "SELECT index, len(list_filter(turns, lambda t: t.role = 'tool')) AS tool_turns, "
        "len(flatten(list_transform(list_filter(turns, lambda t: t.role = 'tool'), lambda t: t.tool_calls))) AS calls "
        f"FROM rollouts WHERE run = '{cfg.run_name}' ORDER BY index"
    )
    assert [(r[1], r[2]) for r in rows] == [(s.metadata["tool_call_count"],) * 2 for s in samples]
    _, per_tool = Catalog(StoragePaths(cfg.storage_root)).query(
        "SELECT c.name, count(*), count(c.error) FROM (SELECT unnest(flatten(list_transform(turns, "
        f"lambda t: t.tool_calls))) AS c FROM rollouts WHERE run = '{cfg.run_name}') WHERE c.result IS NOT NULL "
        "GROUP BY 1"
    )
    assert per_tool == [("add", sum(s.metadata["tool_call_count"] for s in samples), 0)]


def test_old_form_generate_runs_the_fully_async_rollout_and_the_eval(tiny_hf_checkpoint, tmp_path):
    cfg = small_run_config(
        tiny_hf_checkpoint,
        tmp_path,
        custom_generate_function_path="generate_fns.old_form_generate",
        debug_rollout_only=True,
        fully_async=True,
        eval_interval=1,
        eval_prompt_data=["heldout", write_prompts(_mkdir(tmp_path / "eval"), 2)],
    )
    res = train(cfg)
    assert res.last_rollout_id == 1 and res.eval_before_train  # v0 evaluated through the function
    calls = [json.loads(x) for x in open(os.path.join(cfg.storage_root, "generate_calls.jsonl"))]
    assert {c["how"] for c in calls} == {"old"} and sum(c["evaluation"] for c in calls) >= 2
    assert sum(not c["evaluation"] for c in calls) >= 8  # 2 rollouts x 4 samples (async may run ahead)
    samples = _shard_samples(cfg)
    assert len(samples) == 8 and all(s.metadata["generated_by"] == "old_form_generate" for s in samples)


def _mkdir(p):
    p.mkdir()
    return p


def _shard_samples(cfg) -> list[Sample]:
    cols, rows = Catalog(StoragePaths(cfg.storage_root)).query(
        "select * from rollouts order by rollout_id, index"
    )
    names = set(Sample.__dataclass_fields__) | {"reward_json", "response_length"}
    return [Sample.from_row({k: v for k, v in zip(cols, r) if k in names}) for r in rows]


def test_the_dagster_run_config_takes_the_new_flags():
    """The rl_training op's config is built from RunConfig's fields (a dict field must be skipped)."""
    from ops.training import RLTrainingConfig

    fields = RLTrainingConfig.model_fields
    assert {"custom_generate_function_path", "rollout_function_path", "generate_max_turns"} <= set(fields)
    assert "custom_function_args" not in fields


def test_rewards_a_generate_function_set_are_kept_and_group_rm_refuses_them(tiny_hf_checkpoint, tmp_path):
    """The run's reward scores only samples a generate function left unscored; a group RM, which
    scores whole groups, refuses a batch where some rewards were set by the function."""
    from types import SimpleNamespace

    cfg = small_run_config(tiny_hf_checkpoint, tmp_path)
    samples = [
        Sample(index=0, response="4", label="4", reward=0.25),
        Sample(index=1, response="4", label="4"),
    ]
    RolloutManager._score(SimpleNamespace(rewards=cfg.reward_settings(), generate_fn=object()), samples)
    assert [s.reward for s in samples] == [0.25, 1.0] and [s.raw_reward for s in samples] == [0.25, 1.0]
    group = RunConfig(**{**small_run_kwargs(tiny_hf_checkpoint, tmp_path), "group_rm": True})
    with pytest.raises(ConfigError, match="--group-rm scores every sample of a group"):
        RolloutManager._score(
            SimpleNamespace(rewards=group.reward_settings(), generate_fn=object()), [Sample(reward=1.0)]
        )


def test_a_hung_generate_function_fails_its_own_samples_after_the_timeout(tiny_hf_checkpoint, tmp_path):
    """A generate function that never returned hung the run forever (issue #49, item 10): now past
    --custom-generate-function-timeout its call is cancelled and its sample failed (out of the
    loss, counted in rollout/failed, the reason in metadata); the other samples are kept."""
    server = start_engine_server(tiny_hf_checkpoint)
    tok = load_tokenizer(tiny_hf_checkpoint)
    cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, rollout_batch_size=1, n_samples_per_prompt=4,
                                       custom_generate_function_path="generate_fns.hangs_on_odd_seeds",
                                       custom_generate_function_timeout=1.0))  # fmt: skip
    validate_before_start(cfg.validate())
    os.makedirs(cfg.storage_root, exist_ok=True)  # old_form_generate logs its calls there
    m = RolloutManager(cfg, tok, None, server.url)
    try:
        prompt = tok.encode(RECORD.prompt, add_special_tokens=False)
        [group] = m.generate_groups([RECORD], [prompt], [[10, 11, 12, 13]])
        samples = m.finalize(0, [group])
        metrics = m._metrics(samples, {}, 0.0)
    finally:
        m.close()
        server.stop()
    hung, ok = samples[1::2], samples[0::2]
    assert all(s.status == "failed" and s.remove_sample and s.loss_mask == [0] for s in hung)
    assert (
        "did not return within 1 s (--custom-generate-function-timeout)" in hung[0].metadata["generate_error"]
    )
    assert all(s.status != "failed" and s.metadata["generated_by"] == "old_form_generate" for s in ok)
    assert metrics["rollout/failed"] == 0.5
    with pytest.raises(ConfigError, match="--custom-generate-function-timeout"):
        RunConfig(
            **small_run_kwargs(tiny_hf_checkpoint, tmp_path, custom_generate_function_timeout=-1)
        ).validate()
