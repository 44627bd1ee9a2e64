"""Shared-prefix packing: one forward of a prompt for all the samples that share it.

GRPO's n samples of a prompt repeat its tokens n times in a right-padded micro-batch, and every row
is padded to the longest sample; on the quickstart's shape (6-token prompts, 2-8-token answers, 8
samples a prompt: bench_train's batch) a padded forward computes 1792 positions, packed 928. Packed, each
group of samples with the same prompt is one row: the prompt once, then each sample's response, the
positions of each response starting again at the prompt's length, and a mask under which a token
sees the prompt and the earlier tokens of its own response only. Each real position then gets the
logits the padded layout gives it (the same queries, keys, values and positions: equal up to the
order of floating-point sums), and the prompt's gradient is the sum of its samples' as before. A
gather puts the logits back at the padded layout's [B, T] positions, so what follows the forward
(temperature, sampling-support replay, entropy, candidates, each sample's response window) does not
change.

Used by a backend whose model attends only through the mask (backend.shares_prefixes: dense,
full-attention HF families; not MoE, whose load-balancing statistics count tokens, nor sliding or
linear attention), for micro-batches where it computes at least MIN_SAVING fewer token positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# pack only when the packed rows hold at most (1 - MIN_SAVING) of the padded layout's positions: a
# masked attention costs a little more per position than a causal one
MIN_SAVING = 0.1
# the [G, L, L] mask's elements at most (64 MiB of booleans): long prompts keep the padded layout
MAX_MASK_ELEMENTS = 64 * 1024**2
# the model families whose decoder layers all attend through the mask, with no sliding window
DENSE_FULL_ATTENTION = ("qwen3", "qwen2", "llama")


@dataclass
class PackedRows:
    """G packed rows for B padded rows of width T. `keep` [G, 1, L, L]: True where a query (row 2)
    attends to a key (row 3); `index` [B * T]: each padded position's flat position in [G * L]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    index: torch.Tensor
    rows: int
    width: int

    def unpack(self, logits: torch.Tensor) -> torch.Tensor:
        """Packed [G, L, V] logits -> the padded layout's [B, T, V] (a pad position gets its row's
        last real position: finite, and read by nobody)."""
        flat = logits.reshape(-1, logits.shape[-1])
        return flat[self.index].view(self.rows, self.width, -1)


def model_shares_prefixes(config) -> bool:
    """A model whose every layer is softmax attention under the given mask (sdpa), without experts."""
    text = getattr(config, "text_config", None) or config
    layer_types = getattr(text, "layer_types", None) or ["full_attention"]
    return (
        getattr(text, "model_type", None) in DENSE_FULL_ATTENTION
        and getattr(config, "_attn_implementation", None) == "sdpa"  # takes a boolean 4D mask as is
        and all(t == "full_attention" for t in layer_types)
        and not getattr(text, "use_sliding_window", False)
        and not getattr(text, "num_experts", 0)
    )


def pack_shared_prefixes(
    seqs: list[list[int]], prompt_lens: list[int], width: int, device: torch.device | str = "cpu"
) -> PackedRows | None:
    """The packed layout of right-padded rows `seqs` (width `width`), samples grouped by identical
    prompt tokens (their first `prompt_lens` tokens) in order of first appearance; None when it would
    not compute MIN_SAVING fewer positions or its mask would be too large."""
    if any(p < 1 or p > len(s) for s, p in zip(seqs, prompt_lens, strict=True)):
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
        groups.setdefault(tuple(s[:p]), []).append(i)
    sizes = [len(k) + sum(len(seqs[i]) - len(k) for i in m) for k, m in groups.items()]
    n_rows, length = len(groups), max(sizes)
    if n_rows * length > (1 - MIN_SAVING) * len(seqs) * width or n_rows * length**2 > MAX_MASK_ELEMENTS:
        return None
    # numpy slices, torch once at the end: a torch op per sample cost ~9 ms a 128-sample step
    ids = np.zeros((n_rows, length), dtype=np.int64)
    pos = np.zeros((n_rows, length), dtype=np.int64)
    # segment of each packed position: -1 the prompt, j the j-th sample's response, a pad its own
    seg = np.tile(length + np.arange(length), (n_rows, 1))
    index = np.empty((len(seqs), width), dtype=np.int64)
    ramp = np.arange(max(length, width))
    for g, (prompt, members) in enumerate(groups.items()):
        p, base = len(prompt), g * length
        ids[g, :p], pos[g, :p], seg[g, :p] = prompt, ramp[:p], -1
        at = p
        for j, i in enumerate(members):
            n = len(seqs[i]) - p
            ids[g, at : at + n] = seqs[i][p:]
            pos[g, at : at + n], seg[g, at : at + n] = ramp[p : p + n], j
            index[i, :p] = ramp[:p] + base
            index[i, p : p + n] = ramp[at : at + n] + base
            index[i, p + n :] = base + (at + n - 1 if n else p - 1)
            at += n
    seg = torch.from_numpy(seg)
    q, k = seg[:, :, None], seg[:, None, :]
    keep = torch.ones(length, length, dtype=torch.bool).tril() & ((k == -1) | (q == k))
    return PackedRows(
        torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device), keep[:, None].to(device),
        torch.from_numpy(index).reshape(-1).to(device), len(seqs), width,
    )  # fmt: skip
