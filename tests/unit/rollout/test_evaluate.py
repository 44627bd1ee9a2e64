import json

import pytest
import torch

from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.rollout.evaluate import cli_main, evaluate, generate_local, generate_tokens, pass_at_k


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


def _no_cache_greedy(model, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([out]), use_cache=False).logits[0, -1]
        out.append(int(logits.argmax()))
    return out[len(ids) :]


def test_batched_kv_cache_greedy_matches_unbatched_full_recompute(tiny_hf_checkpoint):
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    prompts = [tok.encode("7+8="), tok.encode("What is 12+34? ")]  # different lengths: left padding
    res = generate_tokens(
        model, prompts, eos_token_id=-1, pad_token_id=tok.pad_token_id, max_new_tokens=6, temperature=0
    )
    for p, (toks, ended) in zip(prompts, res, strict=True):
        assert toks == _no_cache_greedy(model, p, 6) and not ended


class _EosAfter:
    """Fake LM: emits token 5, 6, then EOS (2) for every row."""

    training = False

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, input_ids, cache=None, **kw):
        if cache is not None:
            cache.steps = getattr(cache, "steps", -1) + 1
        nxt = [5, 6, 2, 7][min(cache.steps, 3)]
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], 10)
        logits[:, -1, nxt] = 1.0
        return type("Out", (), {"logits": logits})()


def test_generation_stops_at_eos_and_sampling_is_seeded(tiny_hf_checkpoint):
    res = generate_tokens(
        _EosAfter(), [[1, 3], [4]], eos_token_id=2, pad_token_id=0, max_new_tokens=8, temperature=0
    )
    assert res == [([5, 6, 2], True), ([5, 6, 2], True)]
    model, tok = load_hf_checkpoint(tiny_hf_checkpoint)
    a = generate_local(model, tok, ["1+2=", "33+44="], 5, temperature=1.0, n=3, seed=11)
    b = generate_local(model, tok, ["1+2=", "33+44="], 5, temperature=1.0, n=3, seed=11)
    assert a == b and len(a) == 2 and all(len(x) == 3 for x in a)


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


def test_rows_written_before_the_names_read_with_them():
    """Tables are append-only: a row named `pass@k` / `mean_reward` with its sampling columns reads
    as the name it would get now; greedy and diffusion rows keep theirs."""
    from miles_platform.metric_names import metric_name

    assert metric_name("pass@k", 4, 1.0) == "pass@4(T=1)"
    assert metric_name("mean_reward", 2, 0.7) == "mean_reward@2(T=0.7)"
    assert metric_name("mean_reward", 8, None) == "mean_reward"  # a diffusion eval (no temperature)
    assert metric_name("pass@1", 1, 0.0) == "pass@1" and metric_name("pass@4(T=1)", 4, 1.0) == "pass@4(T=1)"
