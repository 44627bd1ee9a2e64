"""Token-in, token-out over chat messages (Miles' TITOTokenizer, `--tito-model`).

The first turn of a session is the chat template over its messages with the generation prompt.
Every later turn keeps the exact ids the model saw and produced, and tokenizes only what the new
messages add: the template over `history + appended` minus the template over `history`, where
`history` ends with the model's assistant message. The model's own tokens end with the family's
end-of-turn token (Qwen `<|im_end|>`, Llama 3 `<|eot_id|>`); what the template puts after it
(Qwen: a newline) is not something the model said, so it opens the appended suffix. A model turn
that stopped elsewhere (a stop string, the length) gets the end-of-turn token appended too.

Append-only is checked on every turn, never assumed: the template must render the history the
model saw exactly as it did then (a template that rewrites earlier turns, e.g. one that drops old
reasoning or counts the turns, breaks it) and `history + appended` must extend `history`.
"""

from __future__ import annotations

from typing import Any

from miles_platform.errors import ConfigError
from miles_platform.rollout.chat import ChatError, render_text

# --tito-model -> the end-of-turn token its models end an assistant message with
END_OF_TURN = {"qwen3": "<|im_end|>", "qwen25": "<|im_end|>", "qwen2": "<|im_end|>", "llama3": "<|eot_id|>",
               # Miles' Qwen3.5, Qwen3-Next and Nemotron 3 TITO: Qwen3's <|im_end|> boundary
               "qwen35": "<|im_end|>", "qwennext": "<|im_end|>", "nemotron3": "<|im_end|>"}  # fmt: skip
TITO_MODELS = ("default", *END_OF_TURN)


class AppendOnlyViolation(ChatError):
    """The rendered history is not a prefix of the next turn's rendering: the session fails."""


class TitoTokenizer:
    def __init__(self, tokenizer: Any, family: str = "default"):
        if family not in TITO_MODELS:
            raise ConfigError(f"--tito-model {family!r}: must be one of {', '.join(TITO_MODELS)}")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("--use-session-server: the tokenizer of --hf-checkpoint has no chat template")
        eot = END_OF_TURN.get(family) or tokenizer.eos_token
        eot_id = tokenizer.convert_tokens_to_ids(eot) if eot else None
        if eot_id is None or eot_id == tokenizer.unk_token_id or tokenizer.decode([eot_id]) != eot:
            raise ConfigError(
                f"--tito-model {family}: the tokenizer of --hf-checkpoint has no {eot!r} token; pick the "
                f"family of the model ({', '.join(TITO_MODELS)}; default uses the tokenizer's EOS)"
            )
        self.tok, self.family, self.eot, self.eot_id = tokenizer, family, eot, int(eot_id)

    def first_prompt(self, messages: list, tools: list | None, kwargs: dict) -> tuple[list[int], str]:
        text = render_text(self.tok, messages, tools, kwargs, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False), text

    def suffix(
        self,
        history: list,
        appended: list,
        tools: list | None,
        kwargs: dict,
        seen_text: str,
        ended_with_eot: bool,
    ) -> tuple[list[int], str, str]:
        """(ids, text) to append after the model's last output, and the rendered text of the next
        turn's input. `seen_text`: the rendering the model's last turn was prompted with."""
        before = render_text(self.tok, history[:-1], tools, kwargs, add_generation_prompt=True)
        if before != seen_text:
            raise AppendOnlyViolation(
                "not append-only: the chat template now renders the earlier messages differently from what "
                f"the model was prompted with (then {seen_text[-120:]!r}, now {before[-120:]!r}); use a "
                "template that keeps earlier turns as they were"
            )
        prev = render_text(self.tok, history, tools, kwargs, add_generation_prompt=False)
        full = render_text(self.tok, history + appended, tools, kwargs, add_generation_prompt=True)
        if not full.startswith(prev) or not prev.startswith(before):
            raise AppendOnlyViolation(
                "not append-only: the chat template renders the history differently once the new messages "
                f"follow (history ends {prev[-120:]!r}, with them {full[len(before) :][:160]!r})"
            )
        turn = prev[len(before) :]  # the assistant turn as the template writes it
        cut = turn.rfind(self.eot)
        if cut < 0:
            raise AppendOnlyViolation(
                f"--tito-model {self.family}: the template's assistant turn {turn[-80:]!r} has no end-of-turn "
                f"token {self.eot!r}; pick the model's family"
            )
        closing = turn[cut + len(self.eot) :] if ended_with_eot else turn[cut:]
        text = closing + full[len(prev) :]
        return self.tok.encode(text, add_special_tokens=False), text, full
