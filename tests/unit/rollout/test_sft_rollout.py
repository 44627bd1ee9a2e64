"""Miles' SFT rollout function over multi-turn `messages` data: token ids are the chat template's
rendering and the loss mask is 1 on exactly the assistant spans (content + end of turn), checked
against the rendered text's character spans, not against the implementation's turn-by-turn walk."""

from __future__ import annotations

import json
import re

import pytest
from loop_helpers import chat_rows, sft_argv

from miles_platform.config import parse_run_config
from miles_platform.data.source import RolloutDataSource
from miles_platform.errors import DataError
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.sft_rollout import conversation_tokens, generate_rollout

# our chat template (models/tokenizer.py): an assistant turn is "<|im_start|>assistant\n" + content +
# "<|im_end|>\n"; the trained span is content + end of turn, as Miles' MultiTurnLossMaskGenerator
ASSISTANT_SPAN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)", re.S)


def _template_mask(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, mask) from the whole rendered conversation: a token is trained iff its characters lie
    in an assistant span whose message has no `step_loss_mask` 0."""
    text = tok.apply_chat_template(messages, tokenize=False)
    trained_turns = [m.get("step_loss_mask", 1) == 1 for m in messages if m["role"] == "assistant"]
    spans = [m.span(1) for m in ASSISTANT_SPAN.finditer(text)]
    assert len(spans) == len(trained_turns)
    spans = [s for s, keep in zip(spans, trained_turns, strict=True) if keep]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= lo and hi <= b for a, b in spans)) for lo, hi in enc["offset_mapping"]]
    return enc["input_ids"], mask


def test_masks_are_the_chat_templates_assistant_spans(tiny_hf_checkpoint, tmp_path):
    tok = load_tokenizer(tiny_hf_checkpoint)
    rows = chat_rows(4)
    rows[2]["messages"][2]["step_loss_mask"] = 0  # Miles' per-turn switch: this answer is context
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_run_config(sft_argv(tiny_hf_checkpoint, str(data)))
    groups = generate_rollout(cfg, 0, RolloutDataSource.from_config(cfg, tokenizer=tok))
    assert [len(g) for g in groups] == [1, 1, 1, 1]
    for (s,), row in zip(groups, rows, strict=True):
        ids, mask = _template_mask(tok, row["messages"])
        n = len(s.prompt_tokens)
        assert s.prompt_tokens + s.response_tokens == ids  # the template's rendering, token for token
        assert [0] * n + s.loss_mask == mask  # the prompt ends where the first trained token starts
        assert s.loss_mask[0] == 1 and s.reward == 0.0
        trained = [t for t, m in zip(s.response_tokens, s.loss_mask, strict=True) if m]
        answers = [
            m["content"] for m in row["messages"] if m["role"] == "assistant" and m.get("step_loss_mask", 1)
        ]
        assert tok.decode(trained) == "".join(a + "<|im_end|>\n" for a in answers)
    # the switched-off turn is context: its tokens are in the response but untrained
    (s,) = groups[2]
    assert "calc 2+2" in tok.decode(s.prompt_tokens) and sum(s.loss_mask) < sum(groups[0][0].loss_mask)


def test_a_bad_step_loss_mask_names_the_record_and_message(tiny_hf_checkpoint):
    tok = load_tokenizer(tiny_hf_checkpoint)
    messages = chat_rows(1)[0]["messages"]
    messages[2]["step_loss_mask"] = 2
    with pytest.raises(DataError, match="rec 7: message 2 has step_loss_mask 2: 0 or 1"):
        conversation_tokens(tok, messages, "rec 7")


def test_tools_of_the_record_reach_the_template(tiny_hf_checkpoint):
    """Miles passes the record's metadata["tools"] to the chat template: a template that renders
    them puts them in the (untrained) prompt."""
    tok = load_tokenizer(tiny_hf_checkpoint)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + tok.chat_template
    )
    messages = chat_rows(1)[0]["messages"]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    with_tools, mask = conversation_tokens(tok, messages, tools=tools)
    plain, _ = conversation_tokens(tok, messages)
    assert '"calc"' in tok.decode(with_tools[: len(with_tools) - len(plain)])
    assert len(with_tools) > len(plain) and with_tools[-len(plain) :] == plain
    assert 1 not in mask[: len(with_tools) - len(plain)]


def test_eval_flags_in_an_sft_run_are_refused_not_ignored(tiny_hf_checkpoint, tmp_path):
    from miles_platform.errors import ConfigError

    data = str(tmp_path / "chat.jsonl")
    for extra in (["--eval-interval", "1"], ["--eval-prompt-data", "heldout", data]):
        with pytest.raises(ConfigError, match="with --debug-train-only: no engine starts to generate eval"):
            parse_run_config(sft_argv(tiny_hf_checkpoint, data, *extra))


def test_miles_loss_mask_type_qwen_is_taken_in_sft_and_refused_elsewhere(tiny_hf_checkpoint, tmp_path):
    """Miles' SFT scripts may pass --loss-mask-type qwen: the template walk gives its masks; its
    other rules, and the flag outside the SFT rollout (where Miles reads it nowhere), are refused."""
    from miles_platform.errors import ConfigError

    data = str(tmp_path / "chat.jsonl")
    cfg = parse_run_config(sft_argv(tiny_hf_checkpoint, data, "--loss-mask-type", "qwen"))
    assert any(line.startswith("--loss-mask-type") for line in cfg.miles_flags_taken())
    with pytest.raises(ConfigError, match="--loss-mask-type qwen3: .*qwen only"):
        parse_run_config(sft_argv(tiny_hf_checkpoint, data, "--loss-mask-type", "qwen3"))
    with pytest.raises(ConfigError, match="--loss-mask-type qwen: .*with the SFT rollout function"):
        parse_run_config(
            ["--hf-checkpoint", tiny_hf_checkpoint, "--rollout-batch-size", "2", "--loss-mask-type", "qwen"]
        )
