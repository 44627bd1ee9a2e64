"""Miles' INT4 quantization-aware training: training sees the int4 weights the engines serve.

Miles turns it on with two environment variables in every trainer worker's environment (its Ray
runtime env, or `--train-env-vars`), not flags: `OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1` and
`OPEN_TRAINING_INT4_GROUP_SIZE` (default 128). Here the driver's values reach the trainer actors'
runtime env, and `--train-env-vars` overrides them (run_services.py). Here, as there, each covered Linear's forward uses `fake_int4_quant(weight)`
(kernels/quant.py: `scale = max(amax / 7, 1e-5)`, `clamp(round(w / scale), -7, 7) * scale` per group
of input columns; backward straight-through), so the parameters, the optimizer and the exported
weights stay in the training dtype and only the forward sees int4.

Covered: the Linear modules the int4 rollout checkpoint stores packed (its `weight_packed` names;
Miles covers the routed experts its int4 checkpoints pack), on the actor and the reference model
alike, so at step 0 the trainer's log-probs are the int4 engine's. A run without an int4
pack-quantized --hf-checkpoint, or on --train-backend megatron, is refused (preflight).
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
    if cfg.train_backend != "fsdp":
        raise ConfigError(
            f"{QAT_FLAG_ENV}=1 on --train-backend {cfg.train_backend}: INT4 QAT hooks the HF model's Linear "
            "modules of --train-backend fsdp; megatron's layers are not hooked here (use fsdp)"
        )
    note = "" if group == rq.group_size else (
        f"; the checkpoint packs groups of {rq.group_size}: training and serving round differently "
        f"(set {QAT_GROUP_ENV}={rq.group_size} to match)"
    )  # fmt: skip
    return f"INT4 QAT on: {len(rq.modules)} Linear modules fake-quantized in groups of {group}{note}"


def _fake_int4_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, kq.fake_int4_quant(self.weight, self.int4_qat_group), self.bias)


def apply_int4_qat(model: torch.nn.Module, modules: frozenset[str], group: int) -> int:
    """Hook the forward of every Linear named in `modules` (HF names); returns how many. Before any
    wrapping (LoRA keeps the hooked Linear as its base layer; FSDP2 unshards before the forward)."""
    hooked = set()
    for name, m in model.named_modules():
        if name in modules and isinstance(m, torch.nn.Linear):
            kq.int4_group_size(m.in_features, group)  # raises naming the size that does not divide
            m.int4_qat_group = group
            m.forward = types.MethodType(_fake_int4_forward, m)
            hooked.add(name)
    missing = sorted(modules - hooked)
    if missing:
        raise ConfigError(
            f"INT4 QAT: {len(missing)} modules the int4 checkpoint packs are not torch Linear modules of the "
            f"trainer's model (e.g. {missing[:3]}; fused MoE experts are not hooked): their training forward "
            "would not see int4"
        )
    return len(hooked)


def maybe_apply_int4_qat(model: torch.nn.Module, hf_checkpoint: str) -> int:
    """The trainer side: INT4 QAT as this worker's environment says (0 when off)."""
    group = qat_group_size()
    if group is None:
        return 0
    from miles_platform.weights.rollout_quant import rollout_quant

    rq = rollout_quant(hf_checkpoint)
    if rq is None or rq.fmt != "int4":
        raise ConfigError(f"{QAT_FLAG_ENV}=1 needs an int4 pack-quantized --hf-checkpoint ({hf_checkpoint})")
    return apply_int4_qat(model, rq.modules, group)
