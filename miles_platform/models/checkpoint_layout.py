"""HF's on-disk tensor layout of each family <-> the parameters transformers 5's modules hold.

What `save_pretrained` writes (and the published checkpoints, SGLang's loaders and the run's HF
exports and disk-delta publications hold) differs from the module's `state_dict` for MoE experts
and a few families' names:

layout     module (state_dict)                                  on disk (one tensor per expert)
qwen-style `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows      `mlp.experts.e.{gate,up,down}_proj.weight`
           first), `mlp.experts.down_proj` [E, H, I]             (Qwen3-MoE / 3.5-MoE / Next, GLM, DeepSeek)
gpt-oss    `mlp.experts.gate_up_proj` [E, H, 2I] + biases        the same tensors (kept fused)
minimax    `mlp.experts.*`, `mlp.gate`, `mlp.e_score_correction_bias`
                                                                 `block_sparse_moe.experts.e.w1 / w3 / w2.weight`
                                                                 (gate / up / down), `block_sparse_moe.gate`, ...
nemotron   `model.*`; `mixer.experts.up_proj` [E, I, H],         `backbone.*`; `mixer.experts.e.up_proj.weight`,
           `mixer.experts.down_proj` [E, H, I] (no gate)         `mixer.experts.e.down_proj.weight`

The layout is read off the names, on either side (no config needed): MiniMax-M2's module is the
only one with an `mlp.e_score_correction_bias` (DeepSeek / GLM keep theirs in `mlp.gate`), and
Nemotron-H's the only one with `model.embeddings`; on disk, `block_sparse_moe.` and `backbone.`.
Checked against `save_pretrained` for every family (tests/unit/models/test_hf_families.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first model, not with the module (the Dagster code location)
    import torch

_GATED = ("gate_proj", "up_proj", "down_proj")  # module-side projections of a gated expert
_MINIMAX = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _is_minimax_module(state) -> bool:
    return any(n.endswith(".mlp.e_score_correction_bias") for n in state)


def _is_nemotron_module(state) -> bool:
    return "model.embeddings.weight" in state


def fuse_checkpoint_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's on-disk tensors as the module's parameters (per-expert tensors fused, the
    family's names mapped); a dense or qwen-style-free state comes back as it is."""
    if any(n.startswith("backbone.") for n in state):  # Nemotron-H
        renamed = {
            ("model." + n[len("backbone.") :] if n.startswith("backbone.") else n): t
            for n, t in state.items()
        }
        return _fuse(renamed, "mixer", {"up_proj": "up_proj", "down_proj": "down_proj"})
    if any(".block_sparse_moe." in n for n in state):  # MiniMax-M2
        renamed = {n.replace(".block_sparse_moe.", ".mlp."): t for n, t in state.items()}
        return _fuse(renamed, "mlp", _MINIMAX)
    return _fuse(state, "mlp", {p: p for p in _GATED})


def split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_checkpoint_experts`: the module's parameters in HF's on-disk layout
    (what the run's HF exports and publications hold); a dense state comes back as it is."""
    if _is_nemotron_module(state):
        out = _split(state, "mixer", {"up_proj": "up_proj", "down_proj": "down_proj"})
        return {
            ("backbone." + n[len("model.") :] if n.startswith("model.") else n): t for n, t in out.items()
        }
    if _is_minimax_module(state):
        out = _split(state, "mlp", _MINIMAX)
        return {n.replace(".mlp.", ".block_sparse_moe."): t for n, t in out.items()}
    return _split(state, "mlp", {p: p for p in _GATED})


def _fuse(state: dict, block: str, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Per-expert `{block}.experts.e.{disk name}.weight` -> fused `{block}.experts.{gate_up_proj |
    up_proj, down_proj}`; `names`: module projection -> its on-disk name (a gated expert has 3)."""
    import torch

    disk = {v: k for k, v in names.items()}
    pattern = re.compile(
        rf"^(?P<pre>.*\.{block}\.experts\.)(?P<e>\d+)\.(?P<proj>{'|'.join(map(re.escape, disk))})\.weight$"
    )
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m["pre"], {}).setdefault(disk[m["proj"]], {})[int(m["e"])] = t
    for pre, projs in groups.items():
        n = {len(v) for v in projs.values()}
        experts = sorted(projs.get("down_proj", {}))
        if len(projs) != len(names) or len(n) != 1 or experts != list(range(len(experts))):
            raise ValueError(
                f"{pre}*: per-expert tensors are incomplete ({ {p: len(v) for p, v in projs.items()} })"
            )
        stacked = {p: torch.stack([projs[p][e] for e in experts]) for p in projs}
        if "gate_proj" in stacked:  # gate rows first, as transformers' fused gate_up_proj
            out[f"{pre}gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        else:
            out[f"{pre}up_proj"] = stacked["up_proj"]
        out[f"{pre}down_proj"] = stacked["down_proj"]
    return out


def _split(state: dict, block: str, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Fused `{block}.experts.*` parameters -> one `{block}.experts.e.{disk name}.weight` each.
    GPT-OSS's biased experts stay fused (HF saves them so)."""
    fused_on_disk = {
        n[: -len("gate_up_proj_bias")] for n in state if n.endswith(f"{block}.experts.gate_up_proj_bias")
    }
    out = {}
    for name, t in state.items():
        pre, _, proj = name.rpartition(".")
        pre += "."
        if pre in fused_on_disk or not pre.endswith(f".{block}.experts.") or t.dim() != 3:
            out[name] = t
        elif proj == "gate_up_proj" and "gate_proj" in names:
            gates, ups = t.chunk(2, dim=1)  # [E, I, H] each: gate rows, then up rows
            for e in range(t.shape[0]):
                out[f"{pre}{e}.{names['gate_proj']}.weight"] = gates[e].contiguous()
                out[f"{pre}{e}.{names['up_proj']}.weight"] = ups[e].contiguous()
        elif proj in names:
            for e in range(t.shape[0]):
                out[f"{pre}{e}.{names[proj]}.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out
