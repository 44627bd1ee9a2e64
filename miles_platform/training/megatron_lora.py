"""LoRA on the megatron backend (docs/lora.md): one adapter per HF projection on megatron's fused
layers, trained, saved and exported under PEFT's HF names, so the adapter is the fsdp backend's
(training/lora.py) tensor for tensor and the engines serve it with the same loader.

    HF module (PEFT target)                  megatron module, rows of its output
    model.layers.i.self_attn.{q,k,v}_proj    decoder.layers.i.self_attention.linear_qkv, per query group
                                             [q heads of the group; k; v] (the bridge's layout)
    model.layers.i.self_attn.o_proj          decoder.layers.i.self_attention.linear_proj
    model.layers.i.mlp.{gate,up}_proj        decoder.layers.i.mlp.linear_fc1, [gate; up]
    model.layers.i.mlp.down_proj             decoder.layers.i.mlp.linear_fc2
    lm_head                                  output_layer (the tied head too: PEFT adapts the head only)
    model.layers.i.mlp.experts.gate_up_proj  ...mlp.experts.local_experts.e.linear_fc1 (expert e's factors)
    model.layers.i.mlp.experts.down_proj     ...mlp.experts.local_experts.e.linear_fc2
    model.layers.i.mlp.shared_experts.{gate,up,down}_proj
                                             ...mlp.shared_experts.linear_fc1 [gate; up] / linear_fc2

Multi-latent attention (DeepSeek-V3 / V3.2, GLM-4.7-Flash: models/bridge/deepseek_v3.py), Miles' MLA
targets (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj` beside `o_proj`; the V3.2 indexer never):

    model.layers.i.self_attn.q_a_proj            self_attention.linear_q_down_proj (whole on every TP rank)
    model.layers.i.self_attn.q_b_proj            self_attention.linear_q_up_proj, rope rows in megatron's order
    model.layers.i.self_attn.q_proj (no q latent) self_attention.linear_q_proj, likewise
    model.layers.i.self_attn.kv_a_proj_with_mqa  self_attention.linear_kv_down_proj (whole), likewise
    model.layers.i.self_attn.kv_b_proj           self_attention.linear_kv_up_proj

The bridge stores a head's rope rows in megatron's order where HF's differ (`rope_row_order`); the hook
computes the HF projection's delta and takes its rows in that order, so the factors stay PEFT's.

Each target gets its own `lora_A [r, in]` / `lora_B [out, r]` (Miles' `canonical_lora` layout: split
Q/K/V and gate/up), and a forward hook on the megatron linear adds `scale * B @ A @ dropout(x)` into
that projection's rows of the fused output: the arithmetic of PEFT's LoRA layer, so a megatron step
equals the fsdp step (tests/unit/training/test_lora_megatron.py). The adapter parameters live beside
the GPTModel, not inside it: its state dict, torch_dist checkpoints and bridges are the base's,
unchanged. Target selection is training/lora.py's, resolved against the HF model's module names.

Built at any tensor parallel (sequence parallel too:
the factors stay whole on every TP rank, see `_gather_input` / `_to_output`; MLA's duplicated latent
down projections see this rank's sequence slice and sum their factors' gradients over TP) and data
and context parallel (the backend averages the factors' gradients over data x context parallel ranks),
expert parallel (each rank hooks its own experts) and pipeline parallel (each stage holds its layers' factors;
the adapter file gathers them), without virtual pipeline stages.
Packed routed experts (PEFT's `target_parameters` layout, one LoRA per expert) at TP 1; routers are never
targets (training/lora.py)."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from miles_platform.errors import ConfigError
from miles_platform.training.lora import (
    hf_meta_model,
    peft_module,
    resolve_target_modules,
    split_targets,
)

_HF = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|mlp\.shared_experts?|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
)
_MEGATRON = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
             "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
             "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}  # fmt: skip
# multi-latent attention's projections (no k_proj / v_proj: the keys and values come from the latent)
_MLA = {"q_proj": "self_attention.linear_q_proj", "q_a_proj": "self_attention.linear_q_down_proj",
        "q_b_proj": "self_attention.linear_q_up_proj", "kv_a_proj_with_mqa": "self_attention.linear_kv_down_proj",
        "kv_b_proj": "self_attention.linear_kv_up_proj", "o_proj": "self_attention.linear_proj"}  # fmt: skip
_DUPLICATED = (
    "linear_q_down_proj",
    "linear_kv_down_proj",
)  # whole on every TP rank (training/megatron_mla.py)


_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def check_lora_model(hf_config: dict) -> None:
    """LoRA on megatron is built for the layers the dense / Qwen3-MoE, GLM-4.5 and DeepSeek-V3 bridges map
    (GQA or multi-latent attention, gated MLPs, packed routed and shared experts); a family whose bridge
    says why is refused by name (`Bridge.lora_refusal`: GPT-OSS, MiniMax-M2, Qwen3.5 / Qwen3-Next, and any
    bridge that does not declare adapters built)."""
    from miles_platform.errors import CheckpointError
    from miles_platform.models.bridge import get_bridge

    try:
        why = get_bridge(hf_config).lora_refusal
    except CheckpointError:  # no bridge: the megatron backend refuses the model itself (preflight)
        return
    if why:
        raise ConfigError(f"--lora-rank with --train-backend megatron: {hf_config.get('architectures')}{why}")


def megatron_target(hf_name: str, mla: bool = False) -> tuple[str, str]:
    """(megatron module name, projection) of a PEFT target; refuses what has no megatron adapter. A
    packed expert weight maps to the layer's `mlp.experts` (its `local_experts.e.linear_fc1 / fc2`);
    `mla`: the model's attention is multi-latent (DeepSeek-V3's projections)."""
    if hf_name == "lm_head":
        return "output_layer", "lm_head"
    m = _EXPERTS.fullmatch(hf_name)
    if m is not None:
        return f"decoder.layers.{m.group(1)}.mlp.experts", m.group(2)
    m = _HF.fullmatch(hf_name)
    table = _MLA if mla and m is not None and m.group(2) == "self_attn" else _MEGATRON
    if m is None or m.group(3) not in table:
        raise ConfigError(
            f"--target-modules: {hf_name} has no adapter on the megatron backend (built: q/k/v/o_proj or "
            "multi-latent attention's q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj, gate/up/down_proj of the dense MLPs "
            "and shared experts, packed experts, lm_head); use --train-backend fsdp or exclude it"
        )
    block = "mlp.shared_experts" if m.group(2).startswith("mlp.shared_expert") else "mlp"
    sub = table[m.group(3)] if m.group(2) == "self_attn" else f"{block}.{table[m.group(3)]}"
    return f"decoder.layers.{m.group(1)}.{sub}", m.group(3)


class MegatronLora(nn.Module):
    """The adapter factors of one GPTModel and the hooks that apply them.

    Parameters are named `<megatron module>.lora_{A,B}.<projection>` (each a [r, in] / [out, r] factor);
    `peft_key` gives the PEFT file key of each."""

    def __init__(self, model: nn.Module, hf_config: dict, cfg):
        super().__init__()
        check_lora_model(hf_config)
        self.rank, self.alpha, self.dropout = int(cfg.lora_rank), cfg.lora_alpha, float(cfg.lora_dropout)
        self.scale = self.alpha / self.rank
        self.targets = resolve_target_modules(
            hf_meta_model(hf_config), cfg.target_modules, cfg.exclude_modules
        )
        heads = hf_config["num_attention_heads"]
        self.groups = hf_config.get("num_key_value_heads") or heads
        self.head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
        self.q_per_group = heads // self.groups
        from miles_platform.models.bridge import get_bridge

        bridge = get_bridge(hf_config)  # (the model was built with it)
        # Qwen3.5 / Qwen3-Next: q_proj's rows are [query; gate] per head, megatron's [queries; gates] per group
        self.q_gate = bool(bridge.transformer_config(hf_config).get("attention_output_gate"))
        # GPT-OSS: HF's gate_up columns interleave gate and up, megatron's fc1 rows are [gate; up]
        self._interleaved_gate_up = bridge.interleaved_gate_up
        mla = bool(hf_config.get("kv_lora_rank"))
        modules = dict(model.named_modules())
        dev = next(model.parameters()).device  # (a tied output_layer has no parameter of its own)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        self._hooks_experts: list = []
        self._keys: dict[str, str] = {}  # factor key -> PEFT file key
        self._parts: dict[str, list[str]] = {}  # megatron module -> its adapted projections
        # megatron module -> the HF delta's output rows in the module's order (MLA's rope rows)
        self._rows: dict[str, torch.Tensor] = {}
        dims = _projection_dims(hf_config)
        expert_targets = split_targets(self.targets)[1]
        # pipeline parallel: this stage's decoder layers by global index (megatron's 1-based layer_number);
        # a target of another stage's layer (or of the head, off the last stage) has no factors here
        local = {m.layer_number - 1: n for n, m in modules.items()
                 if re.fullmatch(r"decoder\.layers\.\d+", n) and hasattr(m, "layer_number")}  # fmt: skip
        # every target's PEFT file keys, this stage's or not (an adapter file holds them all)
        self.all_keys = {
            f"{peft_module(t, expert_targets)}.lora_{f}.weight" for t in self.targets for f in "AB"
        }
        for hf_name in self.targets:
            mod, proj = megatron_target(hf_name, mla)
            layer = re.match(r"decoder\.layers\.(\d+)\.", mod)
            if layer is not None:
                if int(layer.group(1)) not in local:
                    continue
                mod = local[int(layer.group(1))] + mod[layer.end() - 1 :]
            elif mod == "output_layer" and mod not in modules:
                continue
            if mod not in modules:
                raise ConfigError(f"--target-modules: {hf_name}: the megatron model has no {mod}")
            if hf_name in expert_targets:
                self._add_experts(modules, mod, proj, hf_name, expert_targets, hf_config, dev)
                continue
            mla_attn = mla and ".self_attention." in mod
            d_in, d_out = dims[
                ("shared_" if ".shared_experts." in mod else "mla_" if mla_attn else "") + proj
            ]
            if proj == "q_proj" and self.q_gate:
                d_out *= 2
            if mla_attn:
                rows = _mla_row_order(bridge, hf_config, proj)
                if rows is not None:
                    self._rows[mod] = rows.to(dev)
            key = f"{mod}.{proj}".replace(".", "__")
            a = torch.empty(self.rank, d_in, device=dev)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's init: B = 0, so v0 is the base policy
            self.A[key] = nn.Parameter(a)
            self.B[key] = nn.Parameter(torch.zeros(d_out, self.rank, device=dev))
            self._keys[key] = peft_module(hf_name, expert_targets)
            self._parts.setdefault(mod, []).append(proj)
        self._hooks = [
            modules[mod].register_forward_hook(self._hook(mod), with_kwargs=True) for mod in self._parts
        ]
        self._sequence_parallel = bool(getattr(getattr(model, "config", None), "sequence_parallel", False))

    def _add_experts(self, modules, mod, proj, hf_name, expert_targets, hf_config, dev) -> None:
        """PEFT's factors of a packed expert weight (`lora_A [E*r, in]`, `lora_B [out, r*E]`, B's columns
        rank-major) and a hook per local expert's linear_fc1 / fc2 adding its own `B[e] @ A[e]`."""
        from megatron.core import parallel_state as ps

        if ps.get_tensor_model_parallel_world_size() > 1 or ps.get_expert_tensor_parallel_world_size() > 1:
            raise ConfigError(
                f"--target-modules: {hf_name}: expert adapters on megatron are built at tensor parallel 1; use "
                "--tensor-model-parallel-size 1, --target-modules attn, or --train-backend fsdp"
            )
        n = int(
            hf_config.get("num_experts")
            or hf_config.get("n_routed_experts")
            or hf_config["num_local_experts"]
        )
        h = hf_config["hidden_size"]
        inter = (
            hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]
        )  # (MiniMax-M2: the latter)
        d_in, d_out = (h, 2 * inter) if proj == "gate_up_proj" else (inter, h)
        key = f"{mod}.{proj}".replace(".", "__")
        rows = None
        if proj == "gate_up_proj" and self._interleaved_gate_up:
            rows = torch.cat([torch.arange(0, d_out, 2), torch.arange(1, d_out, 2)]).to(dev)
        a = torch.empty(n * self.rank, d_in, device=dev)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.A[key], self.B[key] = (
            nn.Parameter(a),
            nn.Parameter(torch.zeros(d_out, self.rank * n, device=dev)),
        )
        self._keys[key] = peft_module(hf_name, expert_targets)
        fc = "linear_fc1" if proj == "gate_up_proj" else "linear_fc2"
        # expert parallel: this rank's experts are local 0.. of its slice of the global ids; the factors of
        # every expert stay on every rank (the others' get no gradient here: the data-parallel sum fills them)
        n_local = n // ps.get_expert_model_parallel_world_size()
        first = ps.get_expert_model_parallel_rank() * n_local
        for e in range(n_local):
            local = modules[f"{mod}.local_experts.{e}.{fc}"]
            self._hooks_experts.append(
                local.register_forward_hook(self._expert_hook(key, first + e, n, rows), with_kwargs=True)
            )

    def _expert_hook(self, key: str, e: int, n: int, rows: torch.Tensor | None = None):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
            out, bias = output
            a = self.A[key].view(n, self.rank, -1)[e]
            b = self.B[key].view(-1, self.rank, n)[:, :, e]
            d = F.linear(F.linear(x.to(a.dtype), a), b) * self.scale
            return out + (d if rows is None else d[..., rows]).to(out.dtype), bias

        return hook

    # ---- forward ----
    def _delta(self, mod: str, proj: str, x: torch.Tensor) -> torch.Tensor:
        key = f"{mod}.{proj}".replace(".", "__")
        a, b = self.A[key], self.B[key]
        x = F.dropout(x.to(a.dtype), self.dropout, self.training) if self.dropout else x.to(a.dtype)
        return F.linear(F.linear(x, a), b) * self.scale

    def _hook(self, mod: str):
        parts = self._parts[mod]
        row = mod.endswith(("linear_proj", "linear_fc2"))
        rows = self._rows.get(mod)

        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs.get("input_", kwargs.get("input"))
            out, bias = output
            if mod.endswith(_DUPLICATED):  # the whole weight here, on this rank's tokens: a plain linear
                (p,) = parts
                d = self._delta(mod, p, x)
                return out + (d if rows is None else d[..., rows]).to(out.dtype), bias
            x = self._gather_input(x, row, module)
            deltas = {p: self._delta(mod, p, x) for p in parts}
            if rows is not None:
                deltas = {p: d[..., rows] for p, d in deltas.items()}
            full = self._fused(mod, deltas, x.shape[:-1], out.shape[-1] * self.tp)
            return out + self._to_output(mod, full, row, module).to(out.dtype), bias

        return hook

    @property
    def tp(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_world_size()

    def _gather_input(self, x: torch.Tensor, row: bool, module) -> torch.Tensor:
        """The full input of the adapted projection on every TP rank. Column-parallel: the input is
        replicated (its gradient all-reduced here, as the base linear does) or, under sequence
        parallelism, this rank's sequence slice (gathered). Row-parallel: this rank's feature slice
        (gathered; the backward keeps this rank's part)."""
        if self.tp == 1:
            return x
        from megatron.core import tensor_parallel as tpl

        if row:
            return tpl.gather_from_tensor_model_parallel_region(x)
        if getattr(module, "sequence_parallel", False):
            return tpl.gather_from_sequence_parallel_region(x)
        return tpl.copy_to_tensor_model_parallel_region(x)

    def _to_output(self, mod: str, full: torch.Tensor, row: bool, module) -> torch.Tensor:
        """This rank's part of the full delta: a column-parallel module's output rows (megatron's TP
        split of that weight); a row-parallel one's output whole, or its sequence slice under SP."""
        if self.tp == 1:
            return full
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel as tpl

        from miles_platform.models.bridge.base import tp_shard

        if row:
            seq_par = getattr(module, "sequence_parallel", False)
            return tpl.scatter_to_sequence_parallel_region(full) if seq_par else full
        rank = ps.get_tensor_model_parallel_rank()
        return tp_shard(f"{mod}.weight", full.movedim(-1, 0), rank, self.tp).movedim(0, -1)

    def reduce_grads(self) -> None:
        """After the backward, over the TP group: a column-parallel module's factors hold the gradient
        of this rank's output rows only, summed here; a row-parallel module's are complete already."""
        if self.tp == 1:
            return
        from megatron.core import parallel_state as ps

        from miles_platform.training.backend import all_reduce_grads

        sequence_parallel, summed = self._sequence_parallel, []
        for key in self._keys:
            if "__linear_proj__" in key or "__linear_fc2__" in key:
                continue
            # MLA's latent down projections: each rank's factors saw its own tokens under sequence
            # parallelism (summed, as megatron sums the weight's); all tokens, the same gradient, without
            if any(f"__{d}__" in key for d in _DUPLICATED) and not sequence_parallel:
                continue
            summed += [self.A[key], self.B[key]]
        all_reduce_grads(summed, group=ps.get_tensor_model_parallel_group())

    def _fused(self, mod: str, deltas: dict[str, torch.Tensor], lead, width: int) -> torch.Tensor:
        """The deltas of one module's projections placed in its full fused output's row layout
        (`width`: the full output size, the padded vocabulary for the output layer)."""
        zero = next(iter(deltas.values())).new_zeros(())
        if mod.endswith("linear_qkv"):
            g, hd, qpg = self.groups, self.head_dim, self.q_per_group
            gated = 2 if self.q_gate else 1
            q, k, v = (deltas.get(p, zero).expand(*lead, n) for p, n in
                       (("q_proj", g * qpg * gated * hd), ("k_proj", g * hd), ("v_proj", g * hd)))  # fmt: skip
            if self.q_gate:  # per head [query; gate] -> per group [queries; gates]
                q = q.reshape(*lead, g, qpg, 2, hd).transpose(-3, -2)
            return torch.cat([q.reshape(*lead, g, gated * qpg * hd), k.reshape(*lead, g, hd),
                              v.reshape(*lead, g, hd)], dim=-1).reshape(*lead, -1)  # fmt: skip
        if mod.endswith("linear_fc1"):
            half = width // 2
            return torch.cat([deltas.get(p, zero).expand(*lead, half) for p in ("gate_proj", "up_proj")], -1)
        (d,) = deltas.values()
        if mod.endswith(("linear_proj", "linear_fc2")):
            return d
        return F.pad(d, (0, width - d.shape[-1]))  # output_layer: the padded vocabulary rows get nothing

    # ---- PEFT files ----
    def peft_state(self) -> dict[str, torch.Tensor]:
        """{PEFT file key: tensor} (CPU copies), as training/lora.py's fsdp export names them."""
        out = {}
        for key, name in self._keys.items():
            out[f"{name}.lora_A.weight"] = self.A[key].detach().to("cpu").clone()
            out[f"{name}.lora_B.weight"] = self.B[key].detach().to("cpu").clone()
        return out

    def gathered_peft_state(self) -> dict[str, torch.Tensor]:
        """Collective over the pipeline stages: every stage's `peft_state` in one dict (the adapter file)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return self.peft_state()
        import torch.distributed as dist

        parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, self.peft_state(), group=ps.get_pipeline_model_parallel_group())
        return {k: v for part in parts for k, v in part.items()}

    def load_peft_state(self, state: dict[str, torch.Tensor]) -> None:
        """A whole adapter (every stage's keys); this stage takes its own factors."""
        want = self.all_keys
        if set(state) != want:
            raise ValueError(
                f"adapter mismatch: missing {sorted(want - set(state))[:3]} unexpected {sorted(set(state) - want)[:3]}"
            )
        with torch.no_grad():
            for key, name in self._keys.items():
                for fac, params in (("A", self.A), ("B", self.B)):
                    t = state[f"{name}.lora_{fac}.weight"]
                    if t.shape != params[key].shape:
                        raise ValueError(f"adapter {name}.lora_{fac}: shape {tuple(t.shape)}, "
                                         f"expected {tuple(params[key].shape)}")  # fmt: skip
                    params[key].copy_(t)

    def named_factors(self):
        """(PEFT-style parameter name, parameter): what the optimizer steps and checkpoints name."""
        for key, name in self._keys.items():
            yield f"{name}.lora_A.default.weight", self.A[key]
            yield f"{name}.lora_B.default.weight", self.B[key]


def _projection_dims(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each HF projection of the decoder layers and the head; `shared_*`: a
    shared expert's (DeepSeek MoE), `mla_*`: multi-latent attention's."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    groups = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    ffn = c.get("intermediate_size") or 0
    shared = c.get("shared_expert_intermediate_size") or (  # Qwen3.5-MoE / Qwen3-Next; DeepSeek's below
        (c.get("moe_intermediate_size") or 0) * (c.get("n_shared_experts") or 0)
    )
    out = {"q_proj": (h, heads * hd), "k_proj": (h, groups * hd), "v_proj": (h, groups * hd),
           "o_proj": (heads * hd, h), "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h),
           "shared_gate_proj": (h, shared), "shared_up_proj": (h, shared), "shared_down_proj": (shared, h),
           "lm_head": (h, c["vocab_size"])}  # fmt: skip
    if c.get("kv_lora_rank"):
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
        out.update({"mla_q_proj": (h, heads * (nope + rope)), "mla_q_a_proj": (h, q_lora or 0),
                    "mla_q_b_proj": (q_lora or 0, heads * (nope + rope)),
                    "mla_kv_a_proj_with_mqa": (h, kv_lora + rope), "mla_kv_b_proj": (kv_lora, heads * (nope + v)),
                    "mla_o_proj": (heads * v, h)})  # fmt: skip
    return out


def _mla_row_order(bridge, c: dict, proj: str) -> torch.Tensor | None:
    """The rows of an MLA projection's HF output in the megatron module's order (the bridge's rope
    permutation of q_proj / q_b_proj per head and of kv_a_proj_with_mqa's rope rows); None: the same."""
    from miles_platform.models.bridge.deepseek_v3 import permute_head_rows, rope_row_order

    d = bridge.dims(c)
    order = rope_row_order(d)
    if order is None or proj not in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa"):
        return None
    heads, lead = (c["num_attention_heads"], d.nope) if proj != "kv_a_proj_with_mqa" else (1, d.kv_lora)
    per_head = torch.cat([torch.arange(lead), lead + order])
    return permute_head_rows(torch.arange(heads * len(per_head))[:, None], per_head, heads)[:, 0]
