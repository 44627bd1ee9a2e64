"""The tool-use task (`mul3`): data, calculator, tokenizer, final-answer reward, SFT masking of tool
tokens, and the eval's tool-call share. The learning proof is scripts/tool_learning.py (docs/rollout.md)."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_platform.config import RewardSettings
from miles_platform.data import tool_use
from miles_platform.data.sample import Sample
from miles_platform.data.tasks import cli_main, read_jsonl, write_tool_datasets
from miles_platform.errors import DataError
from miles_platform.models.tokenizer import build_task_tokenizer, build_tool_tokenizer
from miles_platform.rollout.evaluate import evaluate
from miles_platform.rollout.generate_hub import tool_call
from miles_platform.rollout.rm_hub import compute_rewards, validate_reward_config
from miles_platform.rollout.rm_hub.final_answer_rm import final_answer_reward
from miles_platform.training.sft import tokenize_sft


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("mul3")
    assert (
        cli_main(["--difficulty", "mul3", "--out", str(out), "--train-size", "3000", "--eval-size", "200"])
        == 0
    )
    return {
        k: str(out / f"{k}.{'json' if k == 'tools' else 'jsonl'}") for k in ("train", "eval", "sft", "tools")
    }


def _pair(r):
    a, b = r["metadata"]["a"], r["metadata"]["b"]
    return min(a, b), max(a, b)


def test_splits_are_disjoint_labelled_and_deterministic(task, tmp_path):
    train, evals, sft = (read_jsonl(task[k]) for k in ("train", "eval", "sft"))
    assert len(train) == len(sft) == 3000 and len(evals) == 200
    assert not {_pair(r) for r in train} & {_pair(r) for r in evals}  # not even commuted
    for r in train + evals:
        a, b = r["metadata"]["a"], r["metadata"]["b"]
        assert (
            r["prompt"] == f"{a}*{b}=" and r["label"] == str(a * b) and 100 <= min(a, b) <= max(a, b) <= 999
        )
    again = write_tool_datasets(tmp_path, seed=0, eval_size=200, train_size=3000)
    assert open(again["sft"]).read() == open(task["sft"]).read()


def test_sft_transcripts_parse_call_the_tool_right_or_guess_wrong(task):
    parse = tool_call.make_parser("qwen25", tool_use.TOOL_SPECS)
    rows = read_jsonl(task["sft"])
    share = sum(r["metadata"]["uses_tool"] for r in rows) / len(rows)
    assert 0.25 < share < 0.35  # --tool-share 0.3: a systematic majority guesses
    for r in rows:
        calls = parse(r["response"])
        if r["metadata"]["uses_tool"]:
            assert len(calls) == 1 and calls[0].name == "calculator"
            assert calls[0].arguments == {"expression": r["prompt"].rstrip("=")}
            assert asyncio.run(tool_use.execute_tool(calls[0].name, calls[0].arguments)) == r["label"]
            assert final_answer_reward(r["response"], r["label"]) == 1.0
        else:
            assert calls == [] and r["response"].isdigit() and r["response"] != r["label"]
            assert final_answer_reward(r["response"], r["label"]) == 0.0


def test_tools_json_is_the_openai_spec_with_a_valid_json_schema(task):
    jsonschema = pytest.importorskip("jsonschema")
    specs = json.loads(open(task["tools"]).read())
    assert specs == tool_use.TOOL_SPECS and tool_call.tool_names(specs) == {"calculator"}
    params = specs[0]["function"]["parameters"]
    jsonschema.Draft202012Validator.check_schema(params)
    jsonschema.validate({"expression": "123*456"}, params)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"expression": "1/0"}, params)


def test_the_calculator_answers_and_rejects_bad_calls_with_an_error_string():
    run = asyncio.run
    fn = tool_call.load_execute_tool("miles_platform.data.tool_use.execute_tool")  # as the flag loads it
    assert run(fn("calculator", {"expression": "123*456"})) == "56088"
    assert run(fn("calculator", {"expression": " -12 - 30 "})) == "-42"
    for name, params in [("calculator", {"expression": "1/0"}), ("calculator", {"x": 1}),
                         ("calculator", {"expression": 7}), ("calculator", {"expression": "2**9999"}),
                         ("rm_rf", {"expression": "1+1"})]:  # fmt: skip
        assert run(fn(name, params)).startswith("error: ")
    assert tool_call.load_tool_specs("miles_platform.data.tool_use.TOOL_SPECS") == tool_use.TOOL_SPECS


def test_tool_tokenizer_is_compact_keeps_tool_tokens_and_matches_multi_turn(tok):
    p = tool_use.MulProblem(123, 456)
    call = tool_use.tool_call_text(p)
    ids = tok.encode(call, add_special_tokens=False)
    assert len(ids) <= 25 and ids[0] == tok.convert_tokens_to_ids("<tool_call>")
    # the engine's text (special tokens skipped) keeps the call for the parser
    assert tok.decode(ids, skip_special_tokens=True) == call
    assert [tok.decode([i]) for i in tok.encode("987*654", add_special_tokens=False)] == list("987*654")
    msg = [{"role": "tool", "name": "calculator", "content": "56088"}]
    assert tool_use.tool_response_text("56088") == tool_call.tool_response_text(tok, msg)
    assert len(build_task_tokenizer()) == 259  # the arithmetic demo's tokenizer is untouched


def test_final_answer_grades_the_last_number_after_the_last_tool_answer(tok):
    label = "56088"
    tool = tool_use.tool_response_text(label)
    call = tool_use.tool_call_text(tool_use.MulProblem(123, 456))
    assert final_answer_reward(call + tool + "56088", label) == 1.0
    assert final_answer_reward(call + tool, label) == 0.0  # the tool's answer is not the model's
    assert final_answer_reward(call + tool + "56089", label) == 0.0
    assert final_answer_reward(call + tool + call, label) == 0.0  # a second call, no answer
    assert final_answer_reward("56088", label) == 1.0 and final_answer_reward("55200", label) == 0.0
    plain = "<tool_call>{}</tool_call>\n<tool_response>\n56088\n</tool_response>\n"  # no chat template
    assert final_answer_reward(plain, label) == 0.0 and final_answer_reward(plain + "56088", label) == 1.0
    args = RewardSettings(rm_type="final_answer")
    validate_reward_config(args)
    samples = [Sample(index=i, response=call + tool + "56088", label=label, status=st)
               for i, st in enumerate(["completed", "truncated"])]  # fmt: skip
    assert compute_rewards(args, samples) == [1.0, 0.0]  # truncated: no final answer


def test_sft_masks_tool_tokens_and_keeps_single_turn_rows_as_they_were(tok):
    p = tool_use.MulProblem(123, 456)
    parts = tool_use.transcript_parts(p, use_tool=True)
    row = {"prompt": p.prompt, "response": "".join(t for t, _ in parts), "response_parts": parts}
    ids, mask = tokenize_sft([row], tok)
    enc = [tok.encode(t, add_special_tokens=False) for t, _ in parts]
    prompt = tok.encode(p.prompt, add_special_tokens=False)
    # the tokens multi_turn assembles: prompt, model turn (+EOS), tool answer, final answer, EOS
    assert ids[0].tolist() == prompt + enc[0] + enc[1] + enc[2] + [tok.eos_token_id]
    assert enc[0][-1] == tok.eos_token_id
    want = [0] * len(prompt) + [1] * len(enc[0]) + [0] * len(enc[1]) + [1] * (len(enc[2]) + 1)
    assert mask[0].tolist() == want
    plain = {"prompt": "12+34=", "response": "46"}
    a_tok = build_task_tokenizer()
    ids2, mask2 = tokenize_sft([plain], a_tok)
    assert ids2[0].tolist() == a_tok.encode("12+34=46") + [a_tok.eos_token_id]
    assert mask2[0].tolist() == [0] * 6 + [1, 1, 1]
    with pytest.raises(DataError, match="response_parts"):
        tokenize_sft([{**row, "response": "56088"}], tok)


def test_eval_reports_tool_call_share_of_multi_turn_samples(tmp_path):
    path = tmp_path / "eval.jsonl"
    rows = [tool_use.prompt_row(tool_use.MulProblem(a, 111)) for a in (100, 200, 300, 400)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tool = tool_use.tool_response_text

    def fake_generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed):
        out = []
        for i, pr in enumerate(prompts):
            a = int(pr.split("*")[0])
            if i < 2:  # called the tool; the second episode ran out of budget after it
                s = Sample(response="<tool_call>x</tool_call>" + tool(str(a * 111)) + str(a * 111),
                           status="completed" if i == 0 else "truncated", metadata={"tool_call_count": 1})  # fmt: skip
            else:
                s = Sample(
                    response=str(a * 111 + (i == 3)), status="completed", metadata={"tool_call_count": 0}
                )
            out.append([s] * n)
        return out

    res = evaluate(
        None, [("t", str(path))], generate_fn=fake_generate, rm_type="final_answer", temperature=0.0
    )
    assert res["t"]["tool_call_share"] == 0.5 and res["t"]["pass@1"] == 0.5  # rows 0 and 2
