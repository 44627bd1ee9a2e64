"""The tiny random checkpoints the test suite and tests/gpu run on (product API, not
a test file: a model family's config from `families.tiny_config` + a small trained tokenizer)."""

from __future__ import annotations

from miles_platform.models.families import build_model, tiny_config


def save_tiny_checkpoint(path, family: str = "qwen3") -> str:
    """A random tiny checkpoint of `family` (qwen3, qwen2, llama, qwen3_moe) + a 128-token BPE
    tokenizer trained on addition strings, saved as an HF dir at `path` (< 2 s): what the test
    suite (`tiny_hf_checkpoint`) and tests/gpu run on."""
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.tokenizer import train_tokenizer

    corpus = [f"What is {a}+{b}? {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    tok = train_tokenizer(corpus, vocab_size=128)
    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    cfg = tiny_config(family, len(tok), **dims, head_dim=16, num_hidden_layers=2)
    save_hf_checkpoint(build_model(cfg, seed=0), tok, path)
    return str(path)


def save_untied_checkpoint(tied, path) -> str:
    """A tiny Qwen3 with GQA (2 query groups) and untied embeddings, the tokenizer of `tied`: the
    second shape the megatron parity checks run on (tests/unit/training, tests/gpu)."""
    from miles_platform.models import qwen3
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tied)
    cfg = qwen3.tiny_qwen3_config(
        len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, tie_word_embeddings=False,
    )  # fmt: skip
    save_hf_checkpoint(qwen3.build_model(cfg, seed=2), tok, path)
    return str(path)


def save_layout_checkpoint(tokenizer_src, path, tied: bool = True, num_hidden_layers: int = 4) -> str:
    """A tiny Qwen3 that every megatron layout of the tests splits: 4 heads in 2 query groups
    (TP 2), 4 layers (PP 2 with 2 virtual stages of 1 layer, or uneven 1 + 3), tied or untied
    embeddings; the tokenizer of `tokenizer_src`."""
    from miles_platform.models import qwen3
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    tok = load_tokenizer(tokenizer_src)
    cfg = qwen3.tiny_qwen3_config(
        len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=num_hidden_layers, tie_word_embeddings=tied,
    )  # fmt: skip
    save_hf_checkpoint(qwen3.build_model(cfg, seed=3), tok, path)
    return str(path)
