import json
import threading

import pytest
import torch

from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.rollout import evaluate as ev
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.evaluate import cli_main, evaluate, pass_at_k


@pytest.fixture()
def tiny_eval_data(tmp_path):
    rows = [
        {"prompt": "12+34=", "label": "46", "metadata": {"carry": False}},
        {"prompt": "18+25=", "label": "43", "metadata": {"carry": True}},
    ]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_scores_known_correct_and_known_wrong_with_the_rl_reward(tiny_eval_data):
    answers = {"12+34=": "46", "18+25=": "33"}  # right, and the dropped-carry error

    def fake_generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        return [[answers[p]] * n for p in prompts]

    res = evaluate(None, [("add", tiny_eval_data)], n_samples_per_eval_prompt=4, generate_fn=fake_generate)[
        "add"
    ]
    assert res["pass@1"] == 0.5 and res["pass@4(T=1)"] == 0.5 and res["mean_reward@4(T=1)"] == 0.5
    assert res["pass@1/carry=False"] == 1.0 and res["pass@1/carry=True"] == 0.0
    assert res["num_prompts"] == 2 and res["k"] == 4


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - (3 * 2) / (5 * 4))


def _no_cache_greedy(model, ids: list[int], steps: int, eos: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out[len(ids) :]


def _responses_of(monkeypatch) -> list:
    """What `evaluate` hands the reward hub, per generation call: [greedy answers, samples]."""
    seen, real = [], ev.score

    def spy(args, rows, responses):
        seen.append(responses)
        return real(args, rows, responses)

    monkeypatch.setattr(ev, "score", spy)
    return seen


PROMPTS = ["12+34=", "18+25=", "7+8=", "What is 12+34? "]  # different lengths: left padding


def _eval_data(tmp_path) -> str:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": "46"}) + "\n" for p in PROMPTS))
    return str(path)


def test_greedy_answers_match_unbatched_full_recompute(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """pass@1's answers are the model's greedy continuations, whatever the batch and padding."""
    seen = _responses_of(monkeypatch)
    evaluate(tiny_hf_checkpoint, [("d", _eval_data(tmp_path))], max_new_tokens=6, temperature=0.0)
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    want = [
        tok.decode(_no_cache_greedy(model, tok.encode(p, add_special_tokens=False), 6, tok.eos_token_id),
                   skip_special_tokens=True)
        for p in PROMPTS
    ]  # fmt: skip
    assert [r[0] for r in seen[0]] == want


def test_eval_samples_are_the_engines_draws_for_the_same_seed(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """One sampler: the eval's samples are what the embedded engine draws for the same prompts,
    sampling params and per-row seeds (row k: seed * 1000003 + k, as the run's in-loop eval asks its
    engines), so pass@k does not depend on which path computed it."""
    seen = _responses_of(monkeypatch)
    n, seed, sampling = 3, 7, {"temperature": 0.9, "top_p": 0.8, "top_k": 12}
    evaluate(tiny_hf_checkpoint, [("d", _eval_data(tmp_path))], n_samples_per_eval_prompt=n, max_new_tokens=6,
             seed=seed, **sampling)  # fmt: skip
    core = EngineCore(tiny_hf_checkpoint)
    try:
        tok = core.tokenizer
        ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS for _ in range(n)]
        params = [{"max_new_tokens": 6, "stop_token_ids": [tok.eos_token_id], **sampling,
                   "sampling_seed": seed * 1000003 + k} for k in range(len(ids))]  # fmt: skip
        outs = core.generate(input_ids=ids, sampling_params=params, return_logprob=False)
    finally:
        core.stop()
    texts = [o["text"] for o in outs]
    assert seen[1] == [texts[i * n : (i + 1) * n] for i in range(len(PROMPTS))]
    assert len({t for rs in seen[1] for t in rs}) > 1  # sampled, not one answer repeated


def test_sampling_is_seeded_and_engines_are_stopped(tiny_hf_checkpoint, tmp_path, monkeypatch):
    """The same seed gives the same samples, another seed others; an engine `evaluate` started is
    stopped when it returns, one the caller passed keeps running."""
    seen = _responses_of(monkeypatch)
    data = [("d", _eval_data(tmp_path))]
    kw = dict(n_samples_per_eval_prompt=4, max_new_tokens=6, temperature=1.0)
    for seed in (11, 11, 12):
        evaluate(tiny_hf_checkpoint, data, seed=seed, **kw)
    assert seen[1] == seen[3] != seen[5]
    assert not [t for t in threading.enumerate() if t.name == "engine-scheduler"]
    core = EngineCore(tiny_hf_checkpoint)
    try:
        evaluate(core, data, seed=11, **kw)
        assert seen[7] == seen[1] and core.is_alive()
    finally:
        core.stop()
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)  # what evaluate once took: refused by name
    with pytest.raises(TypeError, match="an HF dir or a running EngineCore, not tuple"):
        evaluate((model, tok), data, **kw)


def test_cli_on_an_hf_checkpoint(tiny_hf_checkpoint, tiny_eval_data, capsys):
    rc = cli_main(
        ["--hf-checkpoint", tiny_hf_checkpoint, "--eval-prompt-data", "add", tiny_eval_data]
        + ["--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "4", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(out["add"]) >= {"pass@1", "pass@2(T=1)", "mean_reward@2(T=1)"}
    assert 0.0 <= out["add"]["pass@1"] <= 1.0


def test_cli_takes_and_honours_the_dataset_flags_train_takes(tiny_hf_checkpoint, tmp_path, capsys):
    """Chat data: the error says to pass --apply-chat-template, and eval accepts it (and --metadata-key)."""
    from miles_platform.errors import DataError

    rows = [
        {"messages": [{"role": "user", "content": "12+34="}], "answer": "46", "info": {"carry": False}},
        {"messages": [{"role": "user", "content": "18+25="}], "answer": "43", "info": {"carry": True}},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--hf-checkpoint", tiny_hf_checkpoint, "--eval-prompt-data", "chat", str(path), "--input-key",
            "messages", "--label-key", "answer", "--eval-max-response-len", "1", "--json"]  # fmt: skip
    with pytest.raises(DataError, match="pass --apply-chat-template"):
        cli_main(argv)
    assert cli_main(argv + ["--apply-chat-template", "--metadata-key", "info"]) == 0
    out = json.loads(capsys.readouterr().out)["chat"]
    assert out["num_prompts"] == 2 and {"pass@1/carry=False", "pass@1/carry=True"} <= set(out)


def test_evaluate_renders_chat_prompts_with_the_tokenizer(tiny_hf_checkpoint, tmp_path):
    """What the loop's in-loop eval relies on: prompts reach generation rendered by the chat template."""
    _, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "12+34=", "label": "46", "meta": {"carry": False}}) + "\n")
    seen = []

    def fake_generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        seen.extend(prompts)
        return [["46"] * n for _ in prompts]

    res = evaluate(None, [("c", str(path))], generate_fn=fake_generate, metadata_key="meta",
                   apply_chat_template=True, tokenizer=tok)["c"]  # fmt: skip
    want = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True
    )
    assert seen[0] == want != "12+34=" and res["pass@1"] == 1.0 and res["pass@1/carry=False"] == 1.0


def _options_without_help(help_text: str) -> list[str]:
    """Option entries of an argparse --help that carry no description."""
    lines, bare = help_text.splitlines(), []
    for i, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        has_inline = len(line.strip().split("  ", 1)) == 2
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        has_next = nxt.startswith("   ") and nxt.strip() != ""  # option lines are indented by two
        if not (has_inline or has_next):
            bare.append(line.strip())
    return bare


@pytest.mark.parametrize("command", ["eval", "train"])
def test_every_option_in_help_has_a_description(command, capsys):
    from miles_platform.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0 and _options_without_help(text) == []
    assert "--apply-chat-template" in text and "--metadata-key" in text


def test_evals_rows_record_the_sampling_behind_each_metric():
    """pass@1, its breakdowns and tool_call_share come from the one greedy answer per prompt;
    pass@<n>(T=..) and mean_reward@<n>(T=..) from the n samples at the eval's sampling."""
    from miles_platform.metric_names import is_greedy_metric
    from miles_platform.rollout.evaluate import evals_table_rows

    res = {"heldout": {"pass@1": 0.5, "pass@4(T=0.7)": 0.75, "mean_reward@4(T=0.7)": 0.4, "pass@1/carry=True": 0.25,
                       "tool_call_share": 0.9, "n": 4, "k": 4, "num_prompts": 8}}  # fmt: skip
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 8, "max_new_tokens": 6}
    rows = {r["metric"]: r for r in evals_table_rows("t.v000003", res, "asset", sampling)}
    assert set(rows) == {
        "pass@1",
        "pass@4(T=0.7)",
        "mean_reward@4(T=0.7)",
        "pass@1/carry=True",
        "tool_call_share",
    }
    for m in ("pass@1", "pass@1/carry=True", "tool_call_share"):
        r = rows[m]
        assert (r["n_samples"], r["temperature"], r["top_p"], r["top_k"], r["max_new_tokens"]) == (
            1,
            0.0,
            1.0,
            -1,
            6,
        )
    for m in ("pass@4(T=0.7)", "mean_reward@4(T=0.7)"):
        r = rows[m]
        assert (r["n_samples"], r["temperature"], r["top_p"], r["top_k"], r["max_new_tokens"]) == (
            4,
            0.7,
            0.9,
            8,
            6,
        )
    assert {r["version"] for r in rows.values()} == {3} and {r["source"] for r in rows.values()} == {"asset"}
    assert not is_greedy_metric("pass@10") and not is_greedy_metric("pass@k")
    assert not is_greedy_metric("pass@1(T=1)")  # one sample at temperature 1: sampled, not greedy


# ---------------------------------------------------------------- metrics named by their sampling (issue 48)
def test_sampled_metrics_are_named_with_their_temperature_and_k(tiny_eval_data):
    """`pass@1` is the greedy answer; what k samples at temperature T gave says so in its name,
    so a sampled pass@1 at T = 1 below the greedy one is no contradiction."""
    from miles_platform.rollout.evaluate import evals_table_rows

    answers = {"12+34=": "46", "18+25=": "33"}

    def fake_generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        return [[answers[p]] * n for p in prompts]

    res = evaluate(None, [("add", tiny_eval_data)], n_samples_per_eval_prompt=4, temperature=0.8,
                   generate_fn=fake_generate)["add"]  # fmt: skip
    metrics = {k for k, v in res.items() if isinstance(v, float)}
    assert metrics == {
        "pass@1",
        "pass@4(T=0.8)",
        "mean_reward@4(T=0.8)",
        "pass@1/carry=False",
        "pass@1/carry=True",
    }
    one = evaluate(None, [("add", tiny_eval_data)], temperature=1.0, generate_fn=fake_generate)["add"]
    assert {"pass@1", "pass@1(T=1)", "mean_reward@1(T=1)"} <= set(one)
    sampling = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
    rows = {r["metric"]: r for r in evals_table_rows("t.v000001", {"add": res}, "loop", sampling)}
    assert (rows["pass@4(T=0.8)"]["n_samples"], rows["pass@4(T=0.8)"]["temperature"]) == (4, 0.8)
    assert (rows["pass@1"]["n_samples"], rows["pass@1"]["temperature"]) == (1, 0.0)


def test_log_passrate_adds_miles_pass_at_k_of_the_samples(tiny_eval_data):
    """--log-passrate: Miles' pass@1, 2, 4 of the k = 4 sampled answers (1 and 2 right), unbiased; not
    an `evals` row (the sampled pass@4(T=..) is)."""
    from miles_platform.rollout.evaluate import evals_table_rows

    samples = {"12+34=": ["46", "0", "0", "0"], "18+25=": ["43", "43", "0", "0"]}

    def fake_generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        return [samples[p][:n] for p in prompts]

    res = evaluate(None, [("add", tiny_eval_data)], n_samples_per_eval_prompt=4, generate_fn=fake_generate,
                   log_passrate=True)["add"]  # fmt: skip
    assert res["passrate"] == pytest.approx({"pass@1": 0.375, "pass@2": (0.5 + 5 / 6) / 2, "pass@4": 1.0})
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
    assert "passrate" not in {
        r["metric"] for r in evals_table_rows("t.v000001", {"add": res}, "loop", sampling)
    }
    assert "passrate" not in evaluate(None, [("add", tiny_eval_data)], n_samples_per_eval_prompt=4,
                                      generate_fn=fake_generate)["add"]  # fmt: skip


def test_the_loop_eval_logs_miles_passrate_names(tiny_eval_data, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from miles_platform.config import RunConfig
    from miles_platform.rollout import manager as manager_module
    from miles_platform.rollout.loop_eval import evaluate_policy
    from miles_platform.store.paths import StoragePaths

    samples = {"12+34=": ["46", "0", "0", "0"], "18+25=": ["43", "43", "0", "0"]}

    def fake(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        return [samples[p][:n] for p in prompts]

    monkeypatch.setattr(manager_module, "router_generate_fn", lambda manager: fake)
    cfg = RunConfig(rollout_batch_size=1, rm_type="math", eval_prompt_data=["add", tiny_eval_data], eval_interval=1, input_key="prompt",
                    n_samples_per_eval_prompt=4, log_passrate=True, run_name="r", storage_root=str(tmp_path)).validate()  # fmt: skip
    m, _ = evaluate_policy(cfg, StoragePaths(str(tmp_path)), SimpleNamespace(tok=None), version=1)
    assert m["eval/add-pass@1"] == 0.375 and m["eval/add-pass@4"] == 1.0 and "eval/add/pass@4(T=1)" in m


def test_rows_written_before_the_names_read_with_them():
    """Tables are append-only: a row named `pass@k` / `mean_reward` with its sampling columns reads
    as the name it would get now; greedy and diffusion rows keep theirs."""
    from miles_platform.metric_names import metric_name

    assert metric_name("pass@k", 4, 1.0) == "pass@4(T=1)"
    assert metric_name("mean_reward", 2, 0.7) == "mean_reward@2(T=0.7)"
    assert metric_name("mean_reward", 8, None) == "mean_reward"  # a diffusion eval (no temperature)
    assert metric_name("pass@1", 1, 0.0) == "pass@1" and metric_name("pass@4(T=1)", 4, 1.0) == "pass@4(T=1)"


def test_eval_function_path_replaces_the_eval_and_logs_as_miles(tmp_path):
    """--eval-function-path: called with (args, rollout_id, data_source, evaluation=True); its
    RolloutFnEvalOutput logged as eval/<dataset> (None rewards as 0), -none_reward_ratio,
    -truncated_ratio, plus its metrics; one evals row per dataset; a function without `evaluation` is refused."""
    from types import SimpleNamespace

    import hook_fns

    from miles_platform.config import ConfigError, RunConfig, parse_run_config
    from miles_platform.preflight import check_hooks
    from miles_platform.rollout.loop_eval import evaluate_policy
    from miles_platform.store.paths import StoragePaths
    from miles_platform.store.tables import read_rows

    cfg = RunConfig(rollout_batch_size=1, eval_prompt_data=["d", "unused.jsonl"], eval_interval=1, run_name="r",
                    storage_root=str(tmp_path), eval_function_path="hook_fns.eval_rollout").validate()  # fmt: skip
    hook_fns.CALLS.clear()
    manager = SimpleNamespace(args=SimpleNamespace(), data_source="SRC", client=None)
    m, _ = evaluate_policy(cfg, StoragePaths(str(tmp_path)), manager, version=3, rollout_id=5)
    assert hook_fns.CALLS["eval"] == [(5, True, "SRC")]
    assert (
        m["eval/d"] == 0.5 and m["eval/d-none_reward_ratio"] == 0.25 and m["eval/d-truncated_ratio"] == 0.25
    )
    assert m["eval/extra"] == 3.0
    rows = read_rows(StoragePaths(str(tmp_path)), "evals", "r")
    assert [(r["version"], r["dataset"], r["metric"], r["value"]) for r in rows] == [
        (3, "d", "mean_reward", 0.5)
    ]
    # --log-passrate: Miles' eval/<dataset>-pass@<k> over groups of --n-samples-per-eval-prompt ([1, 0], [0, 1])
    cfg.log_passrate, cfg.n_samples_per_eval_prompt = True, 2
    m, _ = evaluate_policy(cfg, StoragePaths(str(tmp_path)), manager, version=4, rollout_id=6)
    assert m["eval/d-pass@1"] == 0.5 and m["eval/d-pass@2"] == 1.0
    with pytest.raises(ConfigError, match="--eval-function-path: runs at this run's evals"):
        parse_run_config(["--rollout-batch-size", "1", "--eval-function-path", "hook_fns.eval_rollout"])
    cfg.eval_function_path = "hook_fns.rollout_without_evaluation"
    with pytest.raises(ConfigError, match="takes no `evaluation` argument"):
        check_hooks(cfg)
