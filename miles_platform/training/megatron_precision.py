"""`--bf16` on the megatron backend: bf16 parameters and forward, fp32 main parameters for the optimizer,
and the TransformerConfig of Megatron's precision and recompute flags.

What megatron-core's Float16OptimizerWithFloat16Params does, on any device (that class takes CUDA
tensors only): each trainable bf16 parameter has an fp32 main copy carrying its tensor-parallel
attributes; the actor's AdamW steps the main copies, whose gradients are the DDP main_grad buffers
(fp32 with --accumulate-allreduce-grads-in-fp32, else bf16 cast up); after the step the main copies
are rounded into the model. A checkpoint stores the main copies with the optimizer state
(training/megatron_checkpoint.py), so a resume continues from the fp32 values, not their rounding.
"""

from __future__ import annotations

from typing import Any

import torch

_TP_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "sequence_parallel",
    "allreduce",
)


def config_kwargs(cfg: Any) -> dict[str, Any]:
    """TransformerConfig kwargs of --bf16, --attention-softmax-in-fp32 and --recompute-*."""
    out: dict[str, Any] = {}
    if getattr(cfg, "bf16", False):
        out.update(
            bf16=True, attention_softmax_in_fp32=bool(getattr(cfg, "attention_softmax_in_fp32", False))
        )
    granularity = getattr(cfg, "recompute_granularity", None)
    if granularity:
        out["recompute_granularity"] = granularity
    if granularity == "full":
        out.update(recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers)
    return out


def params_dtype(cfg: Any) -> torch.dtype:
    return torch.bfloat16 if getattr(cfg, "bf16", False) else torch.float32


class MainParams:
    """fp32 main copies of a model's trainable low-precision parameters (see the module docstring)."""

    def __init__(self, named_params):
        self.pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            main = torch.nn.Parameter(p.detach().float().clone())
            for attr in _TP_ATTRS:
                if hasattr(p, attr):
                    setattr(main, attr, getattr(p, attr))
            self.pairs.append((name, p, main))
        self._model_of = {id(main): p for _, p, main in self.pairs}

    def named_parameters(self):
        return [(name, main) for name, _, main in self.pairs]

    def grads_from_model(self) -> None:
        """main.grad = the model parameter's accumulated (DDP: reduced) gradient, in fp32."""
        for _, p, main in self.pairs:
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            main.grad = None if g is None else g.float()

    @torch.no_grad()
    def to_model(self) -> None:
        """Round the stepped main copies into the model's parameters."""
        for _, p, main in self.pairs:
            p.copy_(main)

    @torch.no_grad()
    def from_model(self) -> None:
        for _, p, main in self.pairs:
            main.copy_(p)

    def model_param(self, main: torch.nn.Parameter) -> torch.nn.Parameter:
        """The model parameter a main copy belongs to."""
        return self._model_of[id(main)]
