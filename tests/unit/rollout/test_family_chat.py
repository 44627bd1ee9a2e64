"""GLM-4.7, MiniMax-M2.5 and DeepSeek-V3.2 chat (Miles' `--tito-model glm47 | minimax_m25 |
deepseekv32` and SGLang's `glm47`, `minimax-m2`, `deepseekv32` tool-call parsers), unit level: each
parser on hand-written outputs and on what the family's template writes for a call; each TITO model
over a tool round and a user round of the family's template (prompt + the model's tokens + the
suffix is the template's rendering of the whole chat), and a template that rewrites history caught.

The templates below keep what matters of the published ones: the turn openers / closers and the
tool-call syntax (GLM-4.7's chat_template.jinja, MiniMax-M2.5's, DeepSeek-V3.2's encoding_dsv32
rendered as jinja), with thinking off."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from miles_platform.config import ConfigError, RunConfig
from miles_platform.config.agentic import TITO_NOT_BUILT
from miles_platform.models.tokenizer import train_tokenizer
from miles_platform.rollout import dsv32
from miles_platform.rollout import tito as tito_module
from miles_platform.rollout.chat import ChatError, template_messages
from miles_platform.rollout.generate_hub.tool_call import TOOL_CALL_PARSERS
from miles_platform.rollout.tito import TITO_MODELS, AppendOnlyViolation, TitoTokenizer

_ARGS = (
    "{% for k, v in tc.function.arguments.items() %}{OPEN}{{ v if v is string else v | tojson }}{CLOSE}"
    "{% endfor %}"
)
GLM47 = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}[gMASK]<sop>{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|><think>{% if (clear_thinking is defined and not clear_thinking)"
    " or loop.index0 > ns.last_user %}{{ m.reasoning_content or '' }}{% endif %}</think>{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    + _ARGS.replace("{OPEN}", "<arg_key>{{ k }}</arg_key><arg_value>").replace("{CLOSE}", "</arg_value>")
    + "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}"
    "<tool_response>{{ m.content }}</tool_response>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% if enable_thinking is defined and not enable_thinking %}"
    "</think>{% endif %}{% endif %}"
)
MINIMAX = (
    "]~!b[{% for m in messages %}{% set prev = messages[loop.index0 - 1].role if loop.index0 else '' %}"
    "{% set nxt = messages[loop.index0 + 1].role if not loop.last else '' %}"
    "{% if m.role in ('system', 'user') %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n"
    "{% elif m.role == 'assistant' %}]~b]ai\n{{ m.content or '' }}"
    "{% if m.tool_calls %}\n<minimax:tool_call>\n{% for tc in m.tool_calls %}"
    '<invoke name="{{ tc.function.name }}">\n'
    + _ARGS.replace("{OPEN}", '<parameter name="{{ k }}">').replace("{CLOSE}", "</parameter>\n")
    + "</invoke>\n{% endfor %}</minimax:tool_call>{% endif %}[e~[\n"
    "{% elif m.role == 'tool' %}{% if prev != 'tool' %}]~b]tool{% endif %}\n<response>{{ m.content }}</response>"
    "{% if nxt != 'tool' %}[e~[\n{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% endif %}"
)
DSML = "｜DSML｜"
DEEPSEEKV32 = (
    "<｜begin▁of▁sentence｜>{% for m in messages %}{% set nxt = messages[loop.index0 + 1].role if not loop.last else '' %}"
    "{% if m.role == 'system' %}{{ m.content }}"
    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}<｜Assistant｜></think>"
    "{% elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{% if m.tool_calls %}\n\n<DSMLfunction_calls>\n{% for tc in m.tool_calls %}"
    '<DSMLinvoke name="{{ tc.function.name }}">\n'
    "{% for k, v in tc.function.arguments.items() %}"
    "<DSMLparameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else 'false' }}\">"
    "{{ v if v is string else v | tojson }}</DSMLparameter>\n{% endfor %}</DSMLinvoke>\n"
    "{% endfor %}</DSMLfunction_calls>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}\n\n<function_results>{% endif %}"
    "\n<result>{{ m.content }}</result>{% if nxt != 'tool' %}\n</function_results>\n\n</think>{% endif %}"
    "{% endif %}{% endfor %}"
).replace("DSML", DSML)
FAMILIES = {  # --tito-model: (template, its special tokens, --generate-tool-call-parser)
    "glm47": (GLM47, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], "glm47"),
    "minimax_m25": (MINIMAX, ["]~!b[", "]~b]", "[e~["], "minimax-m2"),
    "minimax_m27": (MINIMAX, ["]~!b[", "]~b]", "[e~["], "minimax-m2"),  # M2.5's tokenizer and stops
    "deepseekv32": (DEEPSEEKV32, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                  "<｜end▁of▁sentence｜>"], "deepseekv32"),
}  # fmt: skip
SPECS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def base_tok():
    return train_tokenizer([f"What is {a}+{b}? {a + b}" for a in range(9) for b in range(9)], vocab_size=64)


def _tok(base, family, encoder=False):
    """The family's tokenizer; `encoder`: no jinja template (DeepSeek-V3.2 as published)."""
    import copy

    template, specials, _ = FAMILIES[family]
    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True) for t in specials]})
    tok.chat_template = None if encoder else template
    return tok


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _turn(tito, hist, seen_text, last_id=None):
    """The model's turn (the template's own text for it, then the stop token the model ends with)."""
    before, prev = tito._render(hist[:-1], None, {}, True), tito._render(hist, None, {}, False)
    assert before == seen_text and prev.startswith(before)
    turn = prev[len(before) :]
    if tito.opens_next:  # GLM: the model stops on the next message's opener
        return turn, last_id
    cut = turn.rfind(tito.eot) + len(tito.eot)
    return turn[:cut], tito.eot_id


@pytest.mark.parametrize("family", [*sorted(FAMILIES), "deepseekv32-encoder"])
def test_a_family_tito_joins_a_tool_round_and_a_user_round_as_its_template_renders_them(
    base_tok, family, monkeypatch
):
    family, encoder = family.split("-")[0], family.endswith("encoder")
    tok = _tok(base_tok, family, encoder)
    tito = TitoTokenizer(tok, family)
    if encoder:  # DeepSeek's encoder (its output checked equal to Miles' vendored encoding_dsv32)
        render_all = lambda m: dsv32.render(template_messages(m), None, {}, True)  # noqa: E731
    else:
        render_all = lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)  # noqa: E731
    msgs = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "What is 2+3?"}]
    ids, text = tito.first_prompt(msgs, None, {})
    assert tok.decode(ids) == text
    if encoder:
        assert text == "<｜begin▁of▁sentence｜>use tools<｜User｜>What is 2+3?<｜Assistant｜><think>"
    a1 = {"role": "assistant", "content": "", "tool_calls": [_call("add", a=2, b=3), _call("add", a=5, b=0)]}
    obs, user = (tito.opens_next.get(t) for t in ("<|observation|>", "<|user|>"))
    said, stop = _turn(tito, msgs + [a1], text, obs)
    # the parser of the family reads the calls the template writes for the model
    parse = TOOL_CALL_PARSERS[FAMILIES[family][2]](SPECS)
    assert [(c.name, c.arguments) for c in parse(said)] == [
        ("add", {"a": 2, "b": 3}),
        ("add", {"a": 5, "b": 0}),
    ]
    tools = [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "add", "content": "5"}]
    got, suffix, full, trim = tito.suffix(msgs + [a1], tools, None, {}, text, stop)
    model_text = said + ("<|observation|>" if tito.opens_next else "")
    assert text + model_text + suffix == full == render_all(msgs + [a1] + tools)
    assert got == tok.encode(suffix, add_special_tokens=False) and trim == 0
    # a turn that stopped elsewhere (the length): the closing token is the suffix's
    cut = said[: len(said) - len(tito.eot or "")]
    _, suffix2, full2, _ = tito.suffix(msgs + [a1], tools, None, {}, text, None)
    assert text + cut + suffix2 == full2
    # a user round after a plain answer
    hist = msgs + [a1] + tools
    a2 = {"role": "assistant", "content": "10", "reasoning_content": "2+3+5"}
    said, stop = _turn(tito, hist + [a2], full, user)
    more = [{"role": "user", "content": "And 1+1?"}]
    _, suffix, full3, _ = tito.suffix(hist + [a2], more, None, {}, full, stop)
    assert full + said + ("<|user|>" if tito.opens_next else "") + suffix == full3
    # the template arguments Miles fixes for the family keep old reasoning: another value is refused
    for k, v in tito_module.FIXED_KWARGS.get(family, {}).items():
        with pytest.raises(ChatError, match=f"{k}={not v}: --tito-model {family} fixes it"):
            tito.suffix(hist + [a2], more, None, {k: not v}, full, stop)
    if family == "glm47":  # without clear_thinking=False GLM's template drops the reasoning: caught
        monkeypatch.setattr(tito_module, "FIXED_KWARGS", {})
        with pytest.raises(AppendOnlyViolation, match="not append-only"):
            tito.suffix(hist + [a2], more, None, {}, full, stop)
    if encoder:
        return
    # a template that rewrites history (counts the messages) is caught
    tok.chat_template = FAMILIES[family][0].replace(
        "{{ m.content }}", "{{ m.content }}{{ messages | length }}", 1
    )
    with pytest.raises(AppendOnlyViolation, match="not append-only"):
        tito.suffix(hist + [a2], more, None, {}, full, stop)


def test_glm47_a_stop_token_the_next_message_does_not_open_with_is_trimmed(base_tok):
    tito = TitoTokenizer(_tok(base_tok, "glm47"), "glm47")
    msgs = [{"role": "user", "content": "2+3?"}]
    _, text = tito.first_prompt(msgs, None, {})
    hist, more = [*msgs, {"role": "assistant", "content": "5"}], [{"role": "user", "content": "ok"}]
    _, suffix, full, trim = tito.suffix(hist, more, None, {}, text, tito.opens_next["<|observation|>"])
    assert trim == 1 and suffix.startswith("<|user|>") and text + "</think>5" + suffix == full
    # --apply-chat-template-kwargs against the fixed arguments: before the run starts (validate_config)
    with pytest.raises(
        ConfigError, match="--apply-chat-template-kwargs clear_thinking=True: --tito-model glm47"
    ):
        tito.check_kwargs({"clear_thinking": True}, "--apply-chat-template-kwargs")
    # a tokenizer without the family's tokens is refused at construction
    with pytest.raises(Exception, match="has no '\\[e~\\[' token"):
        TitoTokenizer(_tok(base_tok, "glm47"), "minimax_m25")


def test_the_glm47_minimax_and_dsml_parsers_read_calls_as_sglang_does():
    glm = TOOL_CALL_PARSERS["glm47"](SPECS)
    text = ("x<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>note</arg_key>"
            "<arg_value>007</arg_value></tool_call><tool_call>nope<arg_key>a</arg_key><arg_value>1</arg_value>"
            "</tool_call><tool_call>add\n<arg_key>b</arg_key>\n<arg_value>2.5</arg_value>\n</tool_call>"
            "<tool_call>add<arg_key>a</arg_key><arg_value>x")  # fmt: skip
    assert [c.arguments for c in glm(text)] == [{"a": 1, "note": "007"}, {"b": 2.5}, {"a": "x"}]
    assert glm("no call") == [] and glm("<tool_call>add</tool_call>")[0].arguments == {}
    mm = TOOL_CALL_PARSERS["minimax-m2"](SPECS)
    text = ('<minimax:tool_call>\n<invoke name="add">\n<parameter name="a">4</parameter>\n</invoke>\n'
            '<invoke name="nope"><parameter name="a">1</parameter></invoke>\n<invoke name="add">'
            '<parameter name="note">hi</parameter></invoke></minimax:tool_call> <invoke name="add"></invoke>'
            '<minimax:tool_call><invoke name="add"><parameter name="b">1e3')  # fmt: skip
    assert [c.arguments for c in mm(text)] == [
        {"a": 4},
        {"note": "hi"},
        {"b": 1000.0},
    ]  # outside a block: none
    assert mm("plain") == []
    ds = TOOL_CALL_PARSERS["deepseekv32"](SPECS)
    text = (f'<{DSML}function_calls>\n<{DSML}invoke name="add">\n<{DSML}parameter name="a" string="false">7'
            f'</{DSML}parameter>\n<{DSML}parameter name="note" string="true">[1]</{DSML}parameter>\n</{DSML}invoke>\n'
            f'<{DSML}invoke name="add">\n<{DSML}parameter name="a" string="false">{{bad</{DSML}parameter>\n'
            f"</{DSML}invoke>\n</{DSML}function_calls>")  # fmt: skip
    assert [c.arguments for c in ds(text)] == [{"a": 7, "note": "[1]"}]  # not JSON: that call skipped
    assert ds("<｜tool▁calls▁begin｜>") == []
    fields = RunConfig.__dataclass_fields__  # the flags offer exactly what is built
    assert set(fields["generate_tool_call_parser"].metadata["choices"]) == set(TOOL_CALL_PARSERS)
    # the built families and Miles' others, which validate refuses by name (config.agentic.TITO_NOT_BUILT)
    assert set(fields["tito_model"].metadata["choices"]) == set(TITO_MODELS) | set(TITO_NOT_BUILT)
    assert not set(TITO_MODELS) & set(TITO_NOT_BUILT)


def test_a_glm47_session_parses_its_calls_and_trims_a_stop_token_the_next_message_replaces(base_tok):
    """The session server with --tito-model glm47 and a stub engine: the tool calls are read with
    GLM-4.7's parser (Miles binds it to the family); a turn that stopped on <|observation|> followed
    by a user message has that token trimmed (Miles' GLM47 merge), log-prob and mask with it, and a
    retry of that turn restores it first. The session's tokens are the template's text throughout."""
    import asyncio

    from miles_platform.rollout.sessions import SessionServer

    tok = _tok(base_tok, "glm47")
    server = SessionServer(
        tok, "http://127.0.0.1:9", None, "glm47", chat_template_kwargs={"enable_thinking": False}
    )
    obs, user = (tok.convert_tokens_to_ids(t) for t in ("<|observation|>", "<|user|>"))
    answers, inputs = [], []

    async def engine(s, plan, sp):
        inputs.append(list(plan["input"]))
        text, stop = answers.pop(0)
        ids = tok.encode(text, add_special_tokens=False) + [stop]
        lps = [[-0.5, t] for t in ids]
        return {"text": text, "output_ids": ids, "meta_info": {"output_token_logprobs": lps,
                                                               "finish_reason": {"type": "stop"}}}  # fmt: skip

    server._generate = engine
    s = server.create({})
    tools = [{"type": "function", "function": SPECS[0]["function"]}]
    msgs = [{"role": "user", "content": "2+3?"}]
    call = "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key><arg_value>3</arg_value></tool_call>"
    answers += [(call, obs), ("5", obs), ("ok", user), ("ok", user)]
    resp, _ = asyncio.run(server.chat(s, {"messages": msgs, "tools": tools}))
    a1 = resp["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in a1["tool_calls"]] == [
        ("add", '{"a": 2, "b": 3}')
    ]
    msgs += [a1, {"role": "tool", "name": "add", "content": "5"}]
    resp, _ = asyncio.run(server.chat(s, {"messages": msgs, "tools": tools}))
    assert (
        inputs[1][: len(s.calls[0].seen_text)]
        and inputs[1][len(inputs[0]) + len(tok.encode(call, add_special_tokens=False))] == obs
    )
    n_before = len(s.tokens)  # ends with the model's <|observation|> after "5"
    msgs += [resp["choices"][0]["message"], {"role": "user", "content": "thanks"}]
    for _ in range(2):  # the second: a retry of the same turn (rolled back, then trimmed again)
        asyncio.run(server.chat(s, {"messages": msgs, "tools": tools}))
        assert inputs[-1][n_before - 1] == user and obs not in inputs[-1][n_before - 1 : n_before]
        rec = s.record()
        assert len(rec["response_log_probs"]) == len(rec["loss_mask"]) == len(rec["response_token_ids"])
        whole = template_messages([*msgs, {"role": "assistant", "content": "ok"}])
        kw = {"enable_thinking": False, "clear_thinking": False}
        assert tok.decode(s.tokens) == tok.apply_chat_template(whole, tokenize=False, **kw) + "<|user|>"
        assert s.turns[-3]["end"] == n_before - 1 - len(s.prompt_ids)  # the "5" turn lost its stop token
