"""Token-in, token-out over chat messages (Miles' TITOTokenizer, `--tito-model`).

The first turn of a session is the chat template over its messages with the generation prompt.
Every later turn keeps the exact ids the model saw and produced, and tokenizes only what the new
messages add: the template over `history + appended` minus the template over `history`, where
`history` ends with the model's assistant message. The model's own tokens end with the family's
end-of-turn token (Qwen `<|im_end|>`, Llama 3 `<|eot_id|>`); what the template puts after it
(Qwen: a newline) is not something the model said, so it opens the appended suffix. A model turn
that stopped elsewhere (a stop string, the length) gets the end-of-turn token appended too.

GLM-4.7 (`glm47`) has no end-of-turn token of its own: the model stops on the token that opens the
next message (`<|observation|>` before tool results, `<|user|>` before a user turn), which is also
where the template's next message begins. That token, when the model produced it and the next
message opens with it, is the model's and the suffix starts after it (Miles' GLM47 merge strips and
re-adds it: the same ids). A model that stopped on the other one (`<|observation|>`, then a user
message, e.g. after a failed tool call) has that stop token trimmed, as Miles' merge does: the suffix
replaces it (`trim` 1; the session server drops the token, its log-prob and mask).

Append-only is checked on every turn, never assumed: the template must render the history the
model saw exactly as it did then (a template that rewrites earlier turns, e.g. one that drops old
reasoning or counts the turns, breaks it) and `history + appended` must extend `history`.
"""

from __future__ import annotations

from typing import Any

from miles_platform.errors import ConfigError
from miles_platform.rollout import dsv32
from miles_platform.rollout.chat import ChatError, render_text, template_messages

# --tito-model -> the end-of-turn token its models end an assistant message with
END_OF_TURN = {"qwen3": "<|im_end|>", "qwen25": "<|im_end|>", "qwen2": "<|im_end|>", "llama3": "<|eot_id|>",
               # Miles' Qwen3.5, Qwen3-Next and Nemotron 3 TITO: Qwen3's <|im_end|> boundary
               "qwen35": "<|im_end|>", "qwennext": "<|im_end|>", "nemotron3": "<|im_end|>",
               # MiniMax-M2.5 / M2.7 (one tokenizer and stop semantics; Miles' fixed templates differ
               # only in the default system identity): `[e~[` then a newline the model does not say
               "minimax_m25": "[e~[", "minimax_m27": "[e~[",
               # DeepSeek-V3.2: the assistant turn ends with EOS and the next message follows at once
               "deepseekv32": "<｜end▁of▁sentence｜>"}  # fmt: skip
# --tito-model -> the tokens that both end the model's turn and open the next message (GLM-4.7)
OPENS_NEXT = {"glm47": ("<|observation|>", "<|user|>")}
TITO_MODELS = ("default", *END_OF_TURN, *OPENS_NEXT)
# --tito-model -> the tool-call parser Miles binds to it (its TITO class' tool_call_parser): the session
# server reads the model's tool calls with it; the others: qwen25, SGLang's default for Qwen
# --tito-model -> the template arguments Miles fixes for it (FIXED_TEMPLATE.extra_kwargs): they keep
# earlier turns' reasoning, so the renders stay append-only; a request or config that sets one to
# another value is refused, as Miles refuses a conflicting kwarg
FIXED_KWARGS = {
    f: {"clear_thinking": False}
    for f in ("qwen3", "qwen35", "qwennext", "glm47", "minimax_m25", "minimax_m27")
}
FIXED_KWARGS |= {"nemotron3": {"truncate_history_thinking": False}, "deepseekv32": {"drop_thinking": False}}
TOOL_CALL_PARSER = {"qwen3": "qwen25", "qwen35": "qwen3_coder", "nemotron3": "qwen3_coder", "glm47": "glm47",
                    "minimax_m25": "minimax-m2", "minimax_m27": "minimax-m2", "deepseekv32": "deepseekv32"}  # fmt: skip


class AppendOnlyViolation(ChatError):
    """The rendered history is not a prefix of the next turn's rendering: the session fails."""


class TitoTokenizer:
    def __init__(self, tokenizer: Any, family: str = "default"):
        if family not in TITO_MODELS:
            raise ConfigError(f"--tito-model {family!r}: must be one of {', '.join(TITO_MODELS)}")
        # DeepSeek-V3.2 ships no jinja template: Miles renders a deepseek_v32 checkpoint (and we, one
        # with no template) through DeepSeek's encoder (rollout/dsv32.py)
        self.dsv32 = family == "deepseekv32" and (
            not getattr(tokenizer, "chat_template", None) or _model_type(tokenizer) == "deepseek_v32"
        )
        if not self.dsv32 and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--use-session-server: the tokenizer of --hf-checkpoint has no chat template")
        self.tok, self.family = tokenizer, family
        self.tool_call_parser = TOOL_CALL_PARSER.get(family, "qwen25")
        self.opens_next = {t: self._token_id(t) for t in OPENS_NEXT.get(family, ())}
        self.eot = None if self.opens_next else END_OF_TURN.get(family) or tokenizer.eos_token
        self.eot_id = None if self.opens_next else self._token_id(self.eot)
        # the ids a model turn may end with, each closing the turn
        self.stop_ids = set(self.opens_next.values()) if self.opens_next else {self.eot_id}

    def _token_id(self, token: str | None) -> int:
        tok = self.tok
        tid = tok.convert_tokens_to_ids(token) if token else None
        if tid is None or tid == tok.unk_token_id or tok.decode([tid]) != token:
            raise ConfigError(
                f"--tito-model {self.family}: the tokenizer of --hf-checkpoint has no {token!r} token; pick "
                f"the family of the model ({', '.join(TITO_MODELS)}; default uses the tokenizer's EOS)"
            )
        return int(tid)

    def check_kwargs(self, kwargs: dict, where: str = "chat template kwarg") -> dict:
        """The template arguments Miles fixes for the family; a conflicting value: ChatError (a
        request) or ConfigError (`where` a flag, before the run starts)."""
        fixed = FIXED_KWARGS.get(self.family, {})
        for k, v in fixed.items():
            if k in kwargs and kwargs[k] != v:
                error = ChatError if where == "chat template kwarg" else ConfigError
                raise error(
                    f"{where} {k}={kwargs[k]!r}: --tito-model {self.family} fixes it to {v!r} "
                    "(Miles' registration; another value rewrites earlier turns)"
                )
        return fixed

    def _render(self, messages: list, tools: list | None, kwargs: dict, add_generation_prompt: bool) -> str:
        kwargs = {**kwargs, **self.check_kwargs(kwargs)}
        if not self.dsv32:
            return render_text(self.tok, messages, tools, kwargs, add_generation_prompt)
        try:
            return dsv32.render(template_messages(messages), tools, kwargs, add_generation_prompt)
        except (dsv32.Dsv32Error, KeyError, TypeError, ValueError) as e:
            raise ChatError(f"--tito-model deepseekv32 cannot render these messages: {e}") from e

    def first_prompt(self, messages: list, tools: list | None, kwargs: dict) -> tuple[list[int], str]:
        text = self._render(messages, tools, kwargs, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False), text

    def suffix(
        self,
        history: list,
        appended: list,
        tools: list | None,
        kwargs: dict,
        seen_text: str,
        last_id: int | bool | None,
    ) -> tuple[list[int], str, str, int]:
        """(ids, text) to append after the model's last output, the rendered text of the next
        turn's input, and how many of the model's last tokens the ids replace (GLM-4.7: 0 or 1). `seen_text`: the rendering the model's last turn was prompted with; `last_id`:
        the last token the model produced (True / False: it was / was not the end-of-turn token)."""
        before = self._render(history[:-1], tools, kwargs, add_generation_prompt=True)
        if before != seen_text:
            raise AppendOnlyViolation(
                "not append-only: the chat template now renders the earlier messages differently from what "
                f"the model was prompted with (then {seen_text[-120:]!r}, now {before[-120:]!r}); use a "
                "template that keeps earlier turns as they were"
            )
        prev = self._render(history, tools, kwargs, add_generation_prompt=False)
        full = self._render(history + appended, tools, kwargs, add_generation_prompt=True)
        if not full.startswith(prev) or not prev.startswith(before):
            raise AppendOnlyViolation(
                "not append-only: the chat template renders the history differently once the new messages "
                f"follow (history ends {prev[-120:]!r}, with them {full[len(before) :][:160]!r})"
            )
        turn = prev[len(before) :]  # the assistant turn as the template writes it
        if self.opens_next:
            return self._opens_next_suffix(turn, full[len(prev) :], last_id, full)
        ended_with_eot = last_id is True or (last_id is not False and last_id == self.eot_id)
        cut = turn.rfind(self.eot)
        if cut < 0:
            raise AppendOnlyViolation(
                f"--tito-model {self.family}: the template's assistant turn {turn[-80:]!r} has no end-of-turn "
                f"token {self.eot!r}; pick the model's family"
            )
        closing = turn[cut + len(self.eot) :] if ended_with_eot else turn[cut:]
        text = closing + full[len(prev) :]
        return self.tok.encode(text, add_special_tokens=False), text, full, 0

    def _opens_next_suffix(
        self, turn: str, nxt: str, last_id: Any, full: str
    ) -> tuple[list[int], str, str, int]:
        """GLM-4.7: the appended text opens with a boundary token; the model's stop token, if it is
        that one, is already in the trajectory."""
        opener = next((t for t in self.opens_next if nxt.startswith(t)), None)
        if opener is None:
            raise AppendOnlyViolation(
                f"--tito-model {self.family}: the template's next message {nxt[:80]!r} opens with none of "
                f"{', '.join(self.opens_next)}; pick the model's family"
            )
        stopped = next((t for t, i in self.opens_next.items() if i == last_id), None)
        trim = int(stopped is not None and stopped != opener)  # the other opener: trimmed, replaced
        text = nxt[len(opener) :] if stopped == opener else nxt
        return self.tok.encode(text, add_special_tokens=False), text, full, trim


def _model_type(tokenizer: Any) -> str | None:
    """config.json's model_type next to the tokenizer's files (None: none there)."""
    import json
    from pathlib import Path

    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
