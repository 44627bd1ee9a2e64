"""Our own tokenizer: byte-level BPE trained offline on the task corpus, digits split one per token.

Saved as standard HF tokenizer files (tokenizer.json + tokenizer_config.json with a chat
template), so `AutoTokenizer.from_pretrained(dir)` loads it and SGLang can serve it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|im_end|>"
PAD = "<|endoftext|>"
BOS_CHAT = "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS_CHAT, EOS]

# Qwen-style chat template: the same prompt text an SGLang server would build. Generic: our task
# models train on raw prompts (`18+25=`), so none of them learned it unless a run passed
# --apply-chat-template; the engine's chat route refuses it (`has_learned_chat_template`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def has_learned_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` carries a chat template of its own: not none, not our generic one."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and template != CHAT_TEMPLATE


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus`; every digit is its own token (arithmetic needs that)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_task_tokenizer(difficulties: Iterable[str] = ("add2", "sub2")) -> PreTrainedTokenizerFast:
    """The platform's tokenizer: BPE over the arithmetic task corpus (see miles_platform.data.tasks).

    Deterministic (same corpus -> same vocab); add3 prompts use the same symbols. Digits, `+`, `-`, `=` are single tokens, so a
    prompt `12+34=` is 6 tokens and an answer `46` is 2 tokens plus EOS.
    """
    from miles_platform.data.tasks import task_corpus

    corpus = [text for d in difficulties for text in task_corpus(d)]
    return train_tokenizer(corpus, vocab_size=256)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tool-use task's tokenizer (miles_platform.data.tool_use): the same BPE trained on tool
    episodes with 64 merges, so a calculator call is ~25 tokens, plus `<tool_call>` and `</tool_call>`
    as single non-special tokens (the engine's text keeps them for the tool-call parser). The
    arithmetic tokenizer above is a separate object and stays as it is (vocabulary and hashes)."""
    from tokenizers import AddedToken

    from miles_platform.data.tool_use import TOOL_TOKENS, tool_corpus

    tok = train_tokenizer(tool_corpus(), vocab_size=len(SPECIAL_TOKENS) + 256 + 64)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


# `miles-platform sft --from-scratch --tokenizer NAME`: which task's tokenizer a new model gets
TASK_TOKENIZERS = {"arithmetic": build_task_tokenizer, "tool_use": build_tool_tokenizer}
