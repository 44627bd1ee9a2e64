"""Miles' INT4 quantization-aware training: training sees the int4 weights the engines serve.

Miles turns it on with two environment variables in every trainer worker's environment (its Ray
runtime env, or `--train-env-vars`), not flags: `OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1` and
`OPEN_TRAINING_INT4_GROUP_SIZE` (default 128). Here the driver's values reach the trainer actors'
runtime env, and `--train-env-vars` overrides them (run_services.py). As there, each covered
weight's forward uses `fake_int4_quant(weight)` (kernels/quant.py: `scale = max(amax / 7, 1e-5)`,
`clamp(round(w / scale), -7, 7) * scale` per group of input columns; backward straight-through), so
the parameters, the optimizer and the exported weights stay in the training dtype and only the
forward sees int4.

Covered: every weight the int4 rollout checkpoint stores packed (its `weight_packed` names): Linear
layers, MoE routers, and an MoE's fused experts (`mlp.experts.gate_up_proj` / `down_proj`, whose
per-expert tensors the checkpoint packs; Miles covers exactly those routed experts in its int4
recipes), on the actor and the reference model alike, so at step 0 the trainer's log-probs are the
int4 engine's. On --train-backend megatron the layers holding those weights (training/megatron_qat.py).
A run without an int4 pack-quantized --hf-checkpoint is refused (preflight).
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping

import torch

from kernels import quant as kq
from miles_platform.errors import ConfigError

QAT_FLAG_ENV = "OPEN_TRAINING_INT4_FAKE_QAT_FLAG"
QAT_GROUP_ENV = "OPEN_TRAINING_INT4_GROUP_SIZE"
DEFAULT_GROUP = 128  # Miles' default for OPEN_TRAINING_INT4_GROUP_SIZE


def qat_group_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """The fake-quantization group size when INT4 QAT is on, else None (values checked)."""
    on = environ.get(QAT_FLAG_ENV, "0").strip()
    if on not in ("0", "1", ""):
        raise ConfigError(f"{QAT_FLAG_ENV}={on!r}: must be 1 (INT4 QAT on) or 0 (off)")
    if on != "1":
        return None
    raw = environ.get(QAT_GROUP_ENV, str(DEFAULT_GROUP)).strip()
    if not raw.isdigit() or int(raw) < kq.PACK_FACTOR or int(raw) % kq.PACK_FACTOR:
        raise ConfigError(f"{QAT_GROUP_ENV}={raw!r}: a group size, a positive multiple of {kq.PACK_FACTOR}")
    return int(raw)


def qat_env_vars(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The driver's INT4 QAT variables, for the trainer actors' runtime env (what preflight checked)."""
    return {k: environ[k] for k in (QAT_FLAG_ENV, QAT_GROUP_ENV) if k in environ}


def trainer_environ(cfg) -> dict[str, str]:
    """The environment the trainer processes get: the driver's, then --train-env-vars (run_services.py)."""
    train_env = cfg.train_env() if hasattr(cfg, "train_env") else {}
    return {**os.environ, **train_env}


def check_int4_qat(cfg, environ: Mapping[str, str] | None = None) -> str | None:
    """Preflight: refuse INT4 QAT where it cannot mean what it says; the line the run logs, or None.
    `environ`: the trainers' environment (default: the driver's with --train-env-vars over it)."""
    group = qat_group_size(trainer_environ(cfg) if environ is None else environ)
    if group is None:
        return None
    from miles_platform.weights.rollout_quant import rollout_quant

    rq = rollout_quant(cfg.hf_checkpoint)
    if rq is None or rq.fmt != "int4":
        raise ConfigError(
            f"{QAT_FLAG_ENV}=1 fake-quantizes the trainer's Linear weights to int4 so that training sees what "
            f"int4 engines serve, but --hf-checkpoint is {f'{rq.fmt}-quantized' if rq else 'not quantized'}: "
            "serve an int4 pack-quantized checkpoint (`miles-platform quantize --format int4`) or unset it"
        )
    note = "" if group == rq.group_size else (
        f"; the checkpoint packs groups of {rq.group_size}: training and serving round differently "
        f"(set {QAT_GROUP_ENV}={rq.group_size} to match)"
    )  # fmt: skip
    return f"INT4 QAT on: {len(rq.modules)} packed weights fake-quantized in groups of {group}{note}"


def _fake_int4(p: torch.Tensor, group: int) -> torch.Tensor:
    """A weight [out, in] or an MoE's fused experts [E, out, in] on the int4 grid (rows are
    independent, so [E * out, in] groups are each expert's, gate and up rows alike)."""
    return kq.fake_int4_quant(p.reshape(-1, p.shape[-1]), group).reshape(p.shape)


def fake_int4_forward(self: torch.nn.Module, *args, **kwargs):
    """The module's own forward with its covered parameters swapped for their fake-quantized values
    for the call (a function of the parameter: the gradient reaches it, straight through)."""
    saved = {n: self._parameters[n] for n in self.int4_qat_params}
    try:
        for n, p in saved.items():
            del self._parameters[n]
            self.__dict__[n] = _fake_int4(p, self.int4_qat_group)
        return type(self).forward(self, *args, **kwargs)
    finally:
        for n, p in saved.items():
            self.__dict__.pop(n, None)
            self._parameters[n] = p


def _covered(model: torch.nn.Module, modules: frozenset[str]) -> dict[str, list[str]]:
    """{module name: its parameters whose on-disk tensors the checkpoint packs}: 2-D `<m>.weight`
    named in `modules`, and an MoE's fused experts [E, out, in] when every per-expert tensor is."""
    from miles_platform.models.checkpoint_layout import split_fused_experts

    params = dict(model.named_parameters())
    # the names the on-disk layout is recognized by (MiniMax-M2, Nemotron-H) go along with each split
    marks = {n: p.detach().to("meta") for n, p in params.items()
             if n.endswith(".mlp.e_score_correction_bias") or n == "model.embeddings.weight"}  # fmt: skip
    mark_out = set(split_fused_experts(marks))
    out: dict[str, list[str]] = {}
    for name, p in params.items():
        owner, _, local = name.rpartition(".")
        if p.dim() == 2 and local == "weight" and owner in modules:
            out.setdefault(owner, []).append(local)
        elif p.dim() == 3:
            disk = set(split_fused_experts({**marks, name: p.detach().to("meta")})) - mark_out
            if disk and all(d.endswith(".weight") and d[: -len(".weight")] in modules for d in disk):
                out.setdefault(owner, []).append(local)
    return out


def apply_int4_qat(model: torch.nn.Module, modules: frozenset[str], group: int) -> int:
    """Hook the forward of every module holding a weight the int4 checkpoint packs (HF names: Linear
    layers, routers, an MoE's fused experts); returns how many modules. Before any wrapping (LoRA
    keeps the hooked Linear as its base layer; FSDP2 unshards before the forward)."""
    from miles_platform.models.checkpoint_layout import split_fused_experts

    covered = _covered(model, modules)
    for owner, locals_ in covered.items():
        m = model.get_submodule(owner)
        for local in locals_:
            kq.int4_group_size(
                getattr(m, local).shape[-1], group
            )  # raises naming a size that does not divide
        m.int4_qat_group, m.int4_qat_params = group, tuple(locals_)
        m.forward = types.MethodType(fake_int4_forward, m)
    meta = {f"{o}.{n}": model.get_submodule(o).get_parameter(n).detach().to("meta")
            for o, ns in covered.items() for n in ns}  # fmt: skip
    missing = sorted(modules - {d.removesuffix(".weight") for d in split_fused_experts(meta)})
    if missing:
        raise ConfigError(
            f"INT4 QAT: {len(missing)} modules the int4 checkpoint packs are not weights of the trainer's "
            f"model (e.g. {missing[:3]}): their training forward would not see int4"
        )
    return len(covered)


def packed_modules(hf_checkpoint: str) -> tuple[frozenset[str], int] | None:
    """The trainer side: (the modules the int4 checkpoint packs, the QAT group size) when this
    worker's environment turns INT4 QAT on, else None."""
    group = qat_group_size()
    if group is None:
        return None
    from miles_platform.weights.rollout_quant import rollout_quant

    rq = rollout_quant(hf_checkpoint)
    if rq is None or rq.fmt != "int4":
        raise ConfigError(f"{QAT_FLAG_ENV}=1 needs an int4 pack-quantized --hf-checkpoint ({hf_checkpoint})")
    return rq.modules, group


def maybe_apply_int4_qat(model: torch.nn.Module, hf_checkpoint: str) -> int:
    """INT4 QAT on the fsdp backend's HF module as the environment says (0 when off); megatron's:
    training/megatron_qat.py."""
    packed = packed_modules(hf_checkpoint)
    return apply_int4_qat(model, *packed) if packed else 0
