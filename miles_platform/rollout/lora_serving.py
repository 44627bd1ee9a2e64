"""LoRA adapters served by the embedded engine, unmerged, several at once (SGLang's multi-LoRA).

The base model stays as loaded. Each adapted `nn.Linear` gets a forward hook that adds, for the
batch rows whose request named an adapter (`lora_path`), `scale * (x @ A^T) @ B^T` of that
adapter: the same arithmetic, in the same order, as PEFT's LoRA layer, so engine log-probs
match a PEFT-wrapped trainer. Rows of other adapters, or of none, are untouched: adapters never
see each other's weights. Adapters are PEFT adapter dirs / tensors (`adapter_model.safetensors`
keys `base_model.model.<module>.lora_{A,B}.weight`, `adapter_config.json`), immutable once loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from miles_platform.errors import CheckpointError

PREFIX = "base_model.model."
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers' packed routed experts, [E, out, in]
# adapter_config.json settings the engine does not implement: refused, never silently ignored
_UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "bias": "none", "fan_in_fan_out": False}


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str | None
    version: int
    scale: float
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r])
    tensors: dict[str, torch.Tensor] = field(repr=False)  # file key -> served tensor (checksums)
    owner: str | None = None  # the tenant whose key loaded it (http_common.tenant_key); None: the admin key
    # packed expert weight (`...mlp.experts.gate_up_proj`) -> (A [E, r, in], B [E, out, r]): one LoRA per expert
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def checksums(self) -> dict[str, str]:
        """SHA-256 of every served tensor's bytes (Miles' --check-lora-weight-equal)."""
        return {k: tensor_sha256(t) for k, t in sorted(self.tensors.items())}


def read_adapter_dir(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config.json) of a PEFT adapter dir."""
    from safetensors.torch import load_file

    p = Path(path)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        if not (p / f).is_file():
            raise FileNotFoundError(f"LoRA adapter dir {path}: {f} missing (a PEFT adapter dir has both)")
    return load_file(str(p / "adapter_model.safetensors")), json.loads(
        (p / "adapter_config.json").read_text()
    )


def expert_layout(experts: nn.Module) -> str | None:
    """How a transformers experts module computes, if the engine's expert-adapter forward knows it:
    "qwen" ([E, out, in] weights, no biases, `act_fn(gate) * up` on the halves) or "gpt_oss" ([E, in, out]
    weights with biases, gate / up interleaved, its clamped `_apply_gate`); None otherwise."""
    names = {n for n, _ in experts.named_parameters(recurse=False)}
    if getattr(experts, "is_transposed", False):
        biased = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
        return "gpt_oss" if names == biased and type(experts).__name__ == "GptOssExperts" else None
    return "qwen" if hasattr(experts, "act_fn") and names <= set(EXPERT_PARAMS) else None


def expert_peft_prefix(param: str, targeted: list[str]) -> str:
    """PEFT's module path of the adapter on packed expert weight `param` (`...experts.gate_up_proj`):
    PEFT wraps the experts module once per targeted weight, in the module's parameter order, the first
    innermost, so with both targeted gate_up_proj's factors are under `experts.base_layer` and
    down_proj's under `experts`. `targeted`: every targeted weight (adapter_config `target_parameters`)."""
    module, leaf = param.rsplit(".", 1)
    mine = [p for p in EXPERT_PARAMS if f"{module}.{p}" in targeted]
    return module + ".base_layer" * (len(mine) - 1 - mine.index(leaf))


def peft_module(target: str, expert_targets: list[str]) -> str:
    """PEFT's file-key prefix of a resolved target (`base_model.model.<module>`; a packed expert weight's
    per `expert_peft_prefix`); `expert_targets`: every targeted packed expert weight."""
    return PREFIX + (expert_peft_prefix(target, expert_targets) if target in expert_targets else target)


def expert_factors(
    tensors: dict[str, torch.Tensor], config: dict
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{packed expert weight: (A [E, r, in], B [E, out, r])} from PEFT's `lora_A [E*r, in]` /
    `lora_B [out, r*E]` (B's columns rank-major, expert-minor), so delta_e = B[e] @ A[e]."""
    targeted = sorted(config.get("target_parameters") or [])
    r, out = int(config["r"]), {}
    for param in targeted:
        key = peft_module(param, targeted)
        a, b = tensors.get(f"{key}.lora_A.weight"), tensors.get(f"{key}.lora_B.weight")
        if a is None or b is None or a.shape[0] % r or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{param}: no lora_A [E*r, in] / lora_B [out, E*r] pair under {key}")
        e = a.shape[0] // r
        out[param] = (a.reshape(e, r, a.shape[1]), b.reshape(b.shape[0], r, e).permute(2, 0, 1))
    return out


def expert_keys(config: dict) -> set[str]:
    targeted = sorted(config.get("target_parameters") or [])
    return {f"{peft_module(p, targeted)}.lora_{f}.weight" for p in targeted for f in "AB"}


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def parse_adapter(
    name: str, tensors: dict[str, torch.Tensor], config: dict, model: nn.Module, dtype: torch.dtype,
    version: int, path: str | None = None,
) -> LoraAdapter:  # fmt: skip
    """Validate a PEFT LoRA adapter against the served model; errors name the adapter and the key."""
    where = f"LoRA adapter {name!r}" + (f" ({path})" if path else "")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r}, the engine serves LORA only")
    for k, ok in _UNSUPPORTED.items():
        if config.get(k, ok) not in (ok, [], {}):
            raise CheckpointError(f"{where}: adapter_config {k}={config[k]!r} is not supported (need {ok!r})")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise CheckpointError(f"{where}: adapter_config r={r!r}: must be a whole number >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < abs(alpha) <= 1e6:
        raise CheckpointError(
            f"{where}: adapter_config lora_alpha={alpha!r}: must be a finite number, 0 < |alpha| <= 1e6"
        )
    scale = alpha / r**0.5 if config.get("use_rslora") else alpha / r
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    modules, served, experts = {}, {}, {}
    try:
        factors = expert_factors(tensors, config)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e
    params = dict(model.named_parameters())
    for param, (a, b) in factors.items():
        w = params.get(param)
        layout = expert_layout(model.get_submodule(param.rsplit(".", 1)[0])) if w is not None else None
        if w is None or w.ndim != 3 or layout is None:
            raise CheckpointError(f"{where}: {param}: the served model has no packed expert weight there")
        e, d_out, d_in = (w.shape[0], w.shape[2], w.shape[1]) if layout == "gpt_oss" else w.shape
        if (a.shape[0], a.shape[2], b.shape[1]) != (e, d_in, d_out):
            raise CheckpointError(f"{where}: {param}: adapter for {a.shape[0]} experts of "
                                  f"[{b.shape[1]}, {a.shape[2]}], the weight is {tuple(w.shape)}")  # fmt: skip
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise CheckpointError(f"{where}: {param}: lora_A / lora_B hold NaN or inf values")
        experts[param] = (
            a.detach().to(w.device, dtype).contiguous(),
            b.detach().to(w.device, dtype).contiguous(),
        )
    for key in expert_keys(config):
        served[key] = tensors[key].detach().to(dtype)
    tensors = {k: v for k, v in tensors.items() if k not in served}
    for key in tensors:
        if not (
            key.startswith(PREFIX) and (key.endswith(".lora_A.weight") or key.endswith(".lora_B.weight"))
        ):
            raise CheckpointError(
                f"{where}: tensor {key!r} is not a LoRA factor (<prefix><module>.lora_A.weight)"
            )
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module = key[len(PREFIX) : -len(".lora_A.weight")]
        bkey = key.replace(".lora_A.", ".lora_B.")
        if bkey not in tensors:
            raise CheckpointError(f"{where}: {key} has no {bkey}")
        lin = linears.get(module)
        if lin is None:
            raise CheckpointError(f"{where}: {key}: the served model has no linear module {module!r}")
        a, b = tensors[key], tensors[bkey]
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise CheckpointError(f"{where}: {module}: lora_A / lora_B hold NaN or inf values")
        if tuple(a.shape) != (r, lin.in_features) or tuple(b.shape) != (lin.out_features, r):
            raise CheckpointError(
                f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, expected "
                f"({r}, {lin.in_features}) / ({lin.out_features}, {r})"
            )
        dev = lin.weight.device
        a, b = a.detach().to(dev, dtype).contiguous(), b.detach().to(dev, dtype).contiguous()
        modules[module], served[key], served[bkey] = (a, b), a, b
    if len(served) != len(tensors) + len(expert_keys(config)):
        orphans = sorted(set(tensors) - set(served))
        raise CheckpointError(f"{where}: lora_B tensors without lora_A: {orphans[:3]}")
    if not modules and not experts:
        raise CheckpointError(f"{where}: no LoRA tensors")
    return LoraAdapter(name, path, int(version), scale, r, modules, served, experts=experts)


class LoraSlots:
    """The adapters an engine holds, and the hooks that apply them per batch row."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._groups: dict[str, list[tuple[torch.Tensor, LoraAdapter]]] = {}  # set per forward
        self._patched: set[str] = set()  # experts modules whose forward applies expert adapters
        self._rows = 0  # batch rows of the current forward

    def load(self, adapter: LoraAdapter, replace: bool = False) -> None:
        if adapter.name in self.adapters and not replace:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded; unload it first")
        self.adapters[adapter.name] = adapter
        self._sync_hooks()

    def unload(self, name: str) -> LoraAdapter:
        if name not in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.adapters)})")
        adapter = self.adapters.pop(name)
        self._sync_hooks()
        return adapter

    def _sync_hooks(self) -> None:
        wanted = {m for a in self.adapters.values() for m in a.modules}
        modules = dict(self.model.named_modules())
        for m in set(self._hooks) - wanted:
            self._hooks.pop(m).remove()
        for m in wanted - set(self._hooks):
            self._hooks[m] = modules[m].register_forward_hook(self._hook(m))
        experts = {p.rsplit(".", 1)[0] for a in self.adapters.values() for p in a.experts}
        for m in set(self._patched) - experts:  # the class's own forward again
            del modules[m].forward
            self._patched.discard(m)
        for m in experts - set(self._patched):
            modules[m].forward = self._expert_forward(m, modules[m])
            self._patched.add(m)

    @contextlib.contextmanager
    def active(self, rows: list[str | None]) -> Iterator[None]:
        """During one forward: batch row i uses adapter rows[i] (None: the base)."""
        by_name: dict[str, list[int]] = {}
        for i, name in enumerate(rows):
            if name is not None:
                by_name.setdefault(name, []).append(i)
        groups: dict[str, list] = {}
        for name, idx in by_name.items():
            a = self.adapters[name]
            for m in a.modules:
                rows_t = torch.tensor(idx, device=a.modules[m][0].device)  # where the adapter (and batch) is
                groups.setdefault(m, []).append((rows_t, a, len(idx) == len(rows)))
            for m in {p.rsplit(".", 1)[0]: p for p in a.experts}.items():
                rows_t = torch.tensor(idx, device=a.experts[m[1]][0].device)
                groups.setdefault(m[0], []).append((rows_t, a, len(idx) == len(rows)))
        self._groups, self._rows = groups, len(rows)
        try:
            yield
        finally:
            self._groups, self._rows = {}, 0

    def _hook(self, module: str):
        def hook(_mod, inputs, out):
            groups = self._groups.get(module)
            if not groups:
                return None
            x = inputs[0]
            for idx, a, whole in groups:
                lora_a, lora_b = a.modules[module]
                if whole:  # one adapter for the whole batch: PEFT's exact expression
                    out = out + F.linear(F.linear(x, lora_a), lora_b) * a.scale
                else:
                    out = out.index_add(0, idx, F.linear(F.linear(x[idx], lora_a), lora_b) * a.scale)
            return out

        return hook

    def _expert_forward(self, name: str, experts: nn.Module):
        """The packed experts' forward (transformers' loop: gate_up, the experts' gate (`act(gate) * up`;
        GPT-OSS: interleaved, clamped, biased), then down, weighted) with each token's adapter added to its
        experts' gate_up / down projections: the tokens of a batch row (hidden states are the batch's
        `[rows * T, H]`) use that row's adapter."""
        base = type(experts).forward.__get__(experts)
        gpt_oss = expert_layout(experts) == "gpt_oss"

        def proj(x, which: str, e: int, tok, users):
            w = getattr(experts, which)[e]
            y = self._expert_proj(x, w.t() if gpt_oss else w, f"{name}.{which}", e, tok, users)
            return y + getattr(experts, f"{which}_bias")[e] if gpt_oss else y

        def forward(hidden_states, top_k_index, top_k_weights):
            groups = self._groups.get(name)
            if not groups:
                return base(hidden_states, top_k_index, top_k_weights)
            n = hidden_states.shape[0]
            row = torch.arange(n, device=hidden_states.device) // (n // self._rows)
            users = [(torch.isin(row, idx) if not whole else None, a) for idx, a, whole in groups]
            out = torch.zeros_like(hidden_states)
            hit = F.one_hot(top_k_index, experts.num_experts + 1).sum((0, 1)).nonzero()[:, 0].tolist()
            for e in hit:
                if e == experts.num_experts:
                    continue
                tok, pos = torch.where(top_k_index == e)
                x = hidden_states[tok]
                gate_up = proj(x, "gate_up_proj", e, tok, users)
                if gpt_oss:
                    act = experts._apply_gate(gate_up)
                else:
                    gate, up = gate_up.chunk(2, -1)
                    act = experts.act_fn(gate) * up
                y = proj(act, "down_proj", e, tok, users)
                out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
            return out

        return forward

    @staticmethod
    def _expert_proj(x, weight, param, e, tok, users):
        y = F.linear(x, weight)
        for mask, a in users:
            pair = a.experts.get(param)
            if pair is None:
                continue
            lora_a, lora_b = pair[0][e], pair[1][e]
            if mask is None:
                y = y + F.linear(F.linear(x, lora_a), lora_b) * a.scale
            else:
                m = mask[tok]
                y = y.index_add(0, m.nonzero()[:, 0], F.linear(F.linear(x[m], lora_a), lora_b) * a.scale)
        return y
