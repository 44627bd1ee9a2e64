"""--apply-chat-template-kwargs (Miles: a JSON object passed to the tokenizer's apply_chat_template):
train prompts, eval prompts, the multi-turn tool turns and the session server's default all render
with it; refused where no template is rendered."""

from __future__ import annotations

import json

import pytest

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.models.checkpoint import load_tokenizer

# a template that shows one argument, shout: "LOUD " first and "<assistant!>" as the generation prompt
TEMPLATE = (
    "{% if shout %}LOUD {% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant{% if shout %}!{% endif %}>{% endif %}"
)
KW = json.dumps({"shout": True})


@pytest.fixture()
def tok(tiny_hf_checkpoint):
    t = load_tokenizer(tiny_hf_checkpoint)
    t.chat_template = TEMPLATE
    return t


def _prompts(tmp_path) -> str:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"input": "1+1", "label": "2"}) + "\n")
    return str(p)


def test_prompts_train_and_eval_render_with_the_kwargs(tok, tmp_path):
    from miles_platform.data.source import RolloutDataSource
    from miles_platform.rollout.evaluate import load_eval_rows

    data = _prompts(tmp_path)
    kw = dict(rollout_batch_size=1, prompt_data=data, label_key="label", apply_chat_template=True)
    plain = RolloutDataSource.from_config(RunConfig(**kw).validate(), tokenizer=tok).records[0].prompt
    cfg = RunConfig(**kw, apply_chat_template_kwargs=KW, eval_prompt_data=["d", data]).validate()
    loud = RolloutDataSource.from_config(cfg, tokenizer=tok).records[0].prompt
    assert plain == "<user>1+1<assistant>" and loud == "LOUD <user>1+1<assistant!>"
    e = cfg.eval_settings()
    rows = load_eval_rows(data, e.input_key, e.label_key, e.metadata_key, e.apply_chat_template, tok,
                          e.chat_template_kwargs)  # fmt: skip
    assert rows[0]["prompt"] == loud


def test_tool_turns_and_the_session_server_default(tok):
    from miles_platform.rollout import chat
    from miles_platform.rollout.generate_hub.tool_call import tool_response_text
    from miles_platform.rollout.sessions import Session, SessionServer

    tool = [{"role": "tool", "name": "add", "content": "2"}]
    assert tool_response_text(tok, tool) == "<tool>2<assistant>"
    assert tool_response_text(tok, tool, {"shout": True}) == "<tool>2<assistant!>"
    server = SessionServer(tok, "http://127.0.0.1:1", None, chat_template_kwargs={"shout": True})
    req = chat.parse_request({"messages": [{"role": "user", "content": "hi"}]})
    plan = server._plan(Session(id="s"), req)
    assert tok.decode(plan["prompt"]).startswith("LOUD")
    quiet = chat.parse_request(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"shout": False}}
    )
    assert not tok.decode(server._plan(Session(id="t"), quiet)["prompt"]).startswith(
        "LOUD"
    )  # the request's win


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--apply-chat-template-kwargs", KW], "renders no chat template"),
        (["--apply-chat-template", "--apply-chat-template-kwargs", "{bad"], "not JSON"),
        (["--apply-chat-template", "--apply-chat-template-kwargs", "[1]"], "expected a JSON object"),
    ],
)
def test_refused_where_nothing_renders_it(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "2", *argv])
    assert parse_run_config(
        ["--rollout-batch-size", "2", "--apply-chat-template", "--apply-chat-template-kwargs", KW]
    )
