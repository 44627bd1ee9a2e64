"""MoE routing of HF models: record the top-k experts per token (the engine, SGLang's
`return_routed_experts`) and replay recorded ones (the trainer, Miles' Rollout Routing Replay, R3).

Works on the HF MoE blocks whose router is a module returning `(router_logits, scores, indices)`
(transformers' `*TopKRouter`, e.g. Qwen3-MoE). Replay keeps the trainer's own router logits and
takes only the expert choice from the rollout: the gate values are the trainer's softmax over the
replayed experts (renormalized as the model does), so gradients still reach the router; tokens
without a recorded route (padding, the last token) route as usual. Routes travel as SGLang sends
them: int32 `(num_tokens - 1, num_layers, top_k)`, base64 of the raw bytes in `meta_info`.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of `model`, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


def encode_routes(routes: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("ascii")


def decode_routes(data: str, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` -> int32 `(tokens - 1, num_layers, top_k)`."""
    flat = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts: {flat.size} ints do not form (n, {num_layers}, {top_k})")
    return flat.reshape(-1, num_layers, top_k)


class RoutingReplay:
    """Forward hooks on every router of `model`: `record()` collects each layer's top-k indices of
    one forward; `replay(routes)` makes the routers use the given ones and counts route flips."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("not an MoE model: no top-k router modules")
        self.num_layers, self.top_k = len(self.routers), int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self._record: list | None = None
        self._replay: torch.Tensor | None = None
        # since the last reset(): (token, layer) pairs replayed, those whose own choice differed, and
        # tokens per expert of every forward
        self.flips = self.routed = 0
        self.load = torch.zeros(self.num_layers, self.num_experts)
        for layer, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(layer))

    @classmethod
    def of(cls, model: nn.Module) -> RoutingReplay | None:
        """The model's (attached once), or None for a dense model."""
        rr = model.__dict__.get("_miles_routing_replay", ...)
        if rr is ...:  # looked up once per model, dense ones included
            rr = cls(model) if is_moe(model) else None
            model.__dict__["_miles_routing_replay"] = rr
        return rr

    def reset(self) -> None:
        self.flips = self.routed = 0
        self.load.zero_()

    @contextlib.contextmanager
    def record(self) -> Iterator[list]:
        """Yields a list that holds, after the forward, one `[B*T, top_k]` index tensor per layer."""
        self._record = [None] * self.num_layers
        try:
            yield self._record
        finally:
            self._record = None

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor | None) -> Iterator[RoutingReplay]:
        """`routes`: `[B*T, num_layers, top_k]` (long), rows of -1 route as the model would."""
        self._replay = routes
        try:
            yield self
        finally:
            self._replay = None

    def _hook(self, layer: int):
        def hook(mod, _inputs, out):
            logits, scores, idx = out
            if self._record is not None:
                self._record[layer] = idx.detach()
            want = None if self._replay is None else self._replay[:, layer]
            if want is not None:
                if want.shape != idx.shape:
                    raise ValueError(
                        f"routing replay: layer {layer} routes {tuple(idx.shape)} tokens x top-k, the replayed "
                        f"routes {tuple(want.shape)}"
                    )
                use = (want >= 0).all(-1)
                same = (idx.sort(-1).values == want.sort(-1).values).all(-1)
                self.flips += int((use & ~same).sum())
                self.routed += int(use.sum())
                idx = torch.where(use[:, None], want, idx)
                vals = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
                if getattr(mod, "norm_topk_prob", False):
                    vals = vals / vals.sum(-1, keepdim=True)
                scores = vals.to(logits.dtype)
            self.load[layer] += torch.bincount(idx.detach().reshape(-1), minlength=self.num_experts)[
                : self.num_experts
            ].float()
            return logits, scores, idx

        return hook

    def load_balance(self) -> float:
        """Max over mean tokens per expert since reset(), averaged over layers (1 = even)."""
        per_layer = self.load.max(-1).values / self.load.mean(-1).clamp_min(1e-9)
        return float(per_layer.mean())
