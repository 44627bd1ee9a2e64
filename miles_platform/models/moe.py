"""MoE routing of HF models: record the top-k experts per token (the engine, SGLang's
`return_routed_experts`) and replay recorded ones (the trainer, Miles' Rollout Routing Replay, R3).

Works on the HF MoE blocks whose router is a module returning `(router_logits, scores, indices)`
(transformers' `*TopKRouter`: Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, GLM-4.5, GLM-4.7-Flash, DeepSeek-V3 /
V3.2, GPT-OSS, Nemotron-H, MiniMax-M2). Replay keeps the trainer's own router logits and takes only the expert choice from
the rollout: the gate values are the router's own function of its logits at the replayed experts
(`gate_values`: softmax or sigmoid, renormalized and scaled as the family does), so gradients still
reach the router; tokens
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
    """The MoE routers of `model`, in layer order (empty for a dense model): transformers'
    `*TopKRouter` / `*TopkRouter` modules, each returning `(router_logits, gates, expert_indices)`."""
    return [
        m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter") and hasattr(m, "top_k")
    ]


def route_in_fp32(model: nn.Module) -> int:
    """--moe-router-dtype fp32 under a bf16 / fp16 forward, as megatron-core's
    `TransformerConfig.moe_router_dtype` does (router.py `gating` -> `router_gating_linear`): the
    router's input (the forward-dtype hidden states) and its weight as a bf16 / fp16 forward holds it
    (megatron's Float16Module keeps the router weight in bf16 / fp16, the engine gets that copy; an
    fp32 master here is rounded to the forward dtype first) are cast to fp32, and the gate's linear,
    softmax / sigmoid, top-k and gate values run in fp32, autocast off (its expert bias: fp32); the logits (hence the aux / z-losses) and the gate values come out fp32,
    which the experts multiply their outputs by before casting back (megatron's unpermute does the
    same). Shared by the trainer (fsdp_backend) and the embedded engine (EngineCore) so both route
    alike; routing replay's hooks see the fp32 logits. Wraps each router's `forward` once; returns
    the number of routers. (megatron's own routers take it from its TransformerConfig instead.)"""
    from torch.nn.utils.stateless import _reparametrize_module

    found = routers(model)
    for r in found:
        if getattr(r, "_miles_fp32_router", False):
            continue

        def forward(hidden_states, *args, _r=r, _orig=r.forward, **kwargs):
            low = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float16) else None
            cast = {  # parameters as the forward holds them (megatron's bf16 / fp16 model), then fp32
                n: (t.to(low) if low else t).float()
                for n, t in _r.named_parameters(recurse=False)
                if t.is_floating_point() and (low or t.dtype != torch.float32)
            }
            cast.update(  # buffers (an expert bias) as they are, in fp32 (megatron keeps its bias fp32)
                (n, t.float())
                for n, t in _r.named_buffers(recurse=False)
                if t.is_floating_point() and t.dtype != torch.float32
            )
            with torch.autocast(hidden_states.device.type, enabled=False), _reparametrize_module(_r, cast):
                return _orig(hidden_states.float(), *args, **kwargs)

        r.forward = forward
        r._miles_fp32_router = True
    return len(found)


def gate_values(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The gate values `router` gives the experts `idx` (`[tokens, top_k]`) from its logits, as its
    own forward does for the experts it picks: what a replayed route is weighted by.
    - softmax over all experts, renormalized over the top-k when the router does (Qwen3-MoE with
      norm_topk_prob; Qwen3.5-MoE always);
    - softmax over the chosen experts' logits (GPT-OSS);
    - sigmoid scores, renormalized with norm_topk_prob, times routed_scaling_factor (DeepSeek-V3 /
      V3.2, GLM-4.5, GLM-4.7-Flash, Nemotron-H: their bias only picks experts, it does not weigh
      them); MiniMax-M2: sigmoid, renormalized."""
    kind = type(router).__name__
    if kind.startswith("GptOss"):
        return F.softmax(logits.gather(-1, idx), dim=-1)
    if kind.startswith("MiniMaxM2"):  # sigmoid, always renormalized, no scaling
        vals = logits.float().sigmoid().gather(-1, idx)
        return vals / vals.sum(-1, keepdim=True)
    if hasattr(router, "e_score_correction_bias"):
        vals = logits.float().sigmoid().gather(-1, idx)
        if router.norm_topk_prob:
            vals = vals / (vals.sum(-1, keepdim=True) + 1e-20)
        return vals * router.routed_scaling_factor
    vals = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
    if getattr(router, "norm_topk_prob", kind.startswith("Qwen3_5Moe")):
        vals = vals / vals.sum(-1, keepdim=True)
    return vals.to(logits.dtype)


def _scores_with_sigmoid(router: nn.Module) -> bool:
    return hasattr(router, "e_score_correction_bias") or type(router).__name__.startswith("MiniMaxM2")


def routed_shape(hf_checkpoint: str) -> tuple[int, int]:
    """(MoE layers, top_k) of an HF checkpoint dir: the shape of a token's routes. The family's own
    model, built on the meta device (no weights), counts its routers: dense layers (DeepSeek's
    first ones, Nemotron-H's Mamba and attention blocks) route nothing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_checkpoint))
    found = routers(model)
    if not found:
        raise ValueError(f"{hf_checkpoint}: not an MoE model (no top-k routers)")
    return len(found), int(found[0].top_k)


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


def _replayed(counter, layer: int, idx: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The experts a router takes under replay: the recorded ones (`want`, `[tokens, top_k]`) where a
    row is recorded (>= 0), its own (`idx`) elsewhere; counts on `counter` the (token, layer) pairs
    replayed (`routed`) and those whose own choice differed (`flips`)."""
    if want.shape != idx.shape:
        raise ValueError(
            f"routing replay: layer {layer} routes {tuple(idx.shape)} tokens x top-k, the replayed "
            f"routes {tuple(want.shape)}"
        )
    use = (want >= 0).all(-1)
    same = (idx.sort(-1).values == want.sort(-1).values).all(-1)
    counter.flips += int((use & ~same).sum())
    counter.routed += int(use.sum())
    return torch.where(use[:, None], want, idx)


def balance_loss(
    logits: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, score: str = "softmax"
) -> torch.Tensor:
    """Megatron's switch_load_balancing_loss with coefficient 1 over the given tokens' router
    logits (`[T, E]`): E / (k T^2) * sum_e (sum_t p_te) * tokens_e; 1.0 when perfectly even. `p` as
    megatron's compute_routing_scores_for_aux_loss: the softmax, or for a sigmoid router (`score`
    "sigmoid": DeepSeek-V3 / V3.2, GLM-4.5 / 4.7-Flash, Nemotron-H, MiniMax-M2) the sigmoid
    normalized over the experts."""
    if score == "sigmoid":
        probs = logits.float().sigmoid()
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    else:
        probs = F.softmax(logits.float(), dim=-1)
    n, e = probs.shape
    return e / (top_k * max(n, 1) ** 2) * (probs.sum(0) * tokens_per_expert.float()).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Megatron's z_loss_func with coefficient 1: mean over the tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class _AuxLoss:
    """`aux_loss(mask)` of both routing kinds: the routers' hooks append one load-balancing and one
    z-loss term per layer, over the tokens of the mask, while it is open."""

    _aux_mask: torch.Tensor | None = None  # [tokens] bool in the kind's token order, the real tokens
    _aux: list
    z_terms: list

    def _token_order(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.reshape(-1)

    @contextlib.contextmanager
    def aux_loss(self, mask: torch.Tensor) -> Iterator[list[torch.Tensor]]:
        """Collect the load-balancing loss of one forward over the tokens of `mask` (`[B, T]` bool,
        batch-first as the samples): the yielded list holds, after it, one `balance_loss` term per
        layer; `z_terms` then holds one `z_loss` term per layer."""
        self._aux_mask, self._aux, self.z_terms = self._token_order(mask), [], []
        try:
            yield self._aux
        finally:
            self._aux_mask = None

    def _add_aux_terms(
        self, logits: torch.Tensor, tokens_per_expert: torch.Tensor, score: str = "softmax"
    ) -> None:
        real = logits.reshape(-1, logits.shape[-1])[self._aux_mask]
        self._aux.append(balance_loss(real, tokens_per_expert, self.top_k, score))
        self.z_terms.append(z_loss(real))


class RoutingReplay(_AuxLoss):
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
        self._aux: list[torch.Tensor] = []
        self.z_terms: list[torch.Tensor] = []  # filled beside _aux: one router z-loss term per layer
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
        """`routes`: `[B, T, num_layers, top_k]` or `[B*T, ...]` (long), rows of -1 route as the
        model would."""
        self._replay = None if routes is None else routes.reshape(-1, *routes.shape[-2:])
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
                idx = _replayed(self, layer, idx, want)
                scores = gate_values(mod, logits, idx)
            if self._aux_mask is not None:
                chosen = idx[self._aux_mask].reshape(-1)
                score = "sigmoid" if _scores_with_sigmoid(mod) else "softmax"
                self._add_aux_terms(
                    logits, torch.bincount(chosen, minlength=self.num_experts)[: self.num_experts], score
                )
            counts = torch.bincount(idx.detach().reshape(-1), minlength=self.num_experts)[: self.num_experts]
            self.load = self.load.to(counts.device)  # kept where the routers run (no sync per layer)
            self.load[layer] += counts.float()
            return logits, scores, idx

        return hook

    def load_balance(self) -> float:
        """Max over mean tokens per expert since reset(), averaged over layers (1 = even)."""
        per_layer = self.load.max(-1).values / self.load.mean(-1).clamp_min(1e-9)
        return float(per_layer.mean())


class MegatronRoutingReplay(_AuxLoss):
    """The megatron backend's MoE routing (megatron-core's `TopKRouter`s): tokens per expert from
    each router's routing map (`load_balance()` as RoutingReplay's), and R3: `replay(routes)` makes
    every router take the recorded experts, through the router's own replay hook (megatron's
    `router_replay.get_replay_topk`, called by its top-k routing with the scores it ranks). As
    RoutingReplay: rows of -1 route as the model would, the gate values are the router's own scores
    gathered at the replayed experts (softmax over them when megatron softmaxes after the top-k, i.e.
    HF's norm_topk_prob), and `flips` / `routed` count (token, layer) pairs replayed and changed.
    `aux_loss(mask)` as RoutingReplay's, from the logits each router's `routing` is given and the
    experts its routing map sends each token to (megatron's own aux loss stays off: its terms
    enter through an autograd side door, MoEAuxLossAutoScaler, whose scale a training loop sets, and
    count padded tokens unless GPTModel gets a padding mask).
    Megatron routes tokens sequence-first: `[T * B]`, where HF's are batch-first."""

    def __init__(self, model: nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter" and hasattr(m, "topk")]
        if not self.routers:
            raise ValueError("not a megatron MoE model: no TopKRouter modules")
        self.num_layers, self.top_k = len(self.routers), int(self.routers[0].topk)
        self.num_experts = int(self.routers[0].config.num_moe_experts)
        self.flips = self.routed = 0
        self.load = torch.zeros(self.num_layers, self.num_experts)
        self._replay: torch.Tensor | None = None  # [T * B, num_layers, top_k]
        self._aux, self.z_terms = [], []
        for layer, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(layer))
            r.router_replay = _LayerReplay(self, layer)
            r.routing = self._routing(r.routing)  # TopKRouter.forward calls self.routing(logits, ...)

    @classmethod
    def of(cls, model: nn.Module) -> MegatronRoutingReplay | None:
        got = model.__dict__.get("_miles_megatron_routing", ...)
        if got is ...:
            has = any(type(m).__name__ == "TopKRouter" for m in model.modules())
            got = cls(model) if has else None
            model.__dict__["_miles_megatron_routing"] = got
        return got

    @contextlib.contextmanager
    def replay(self, routes: torch.Tensor | None) -> Iterator[MegatronRoutingReplay]:
        """`routes`: `[B, T, num_layers, top_k]` (long), batch-first as the samples are."""
        self._replay = None if routes is None else routes.transpose(0, 1).reshape(-1, *routes.shape[2:])
        try:
            yield self
        finally:
            self._replay = None

    def _token_order(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.transpose(0, 1).reshape(-1)  # [B, T] -> megatron's [T * B]

    def _routing(self, routing):
        def wrapped(logits, *args, **kwargs):
            probs, routing_map = routing(logits, *args, **kwargs)
            if self._aux_mask is not None:
                mask = sequence_parallel_rows(self._aux_mask, routing_map.shape[0], False)
                if mask is self._aux_mask:
                    self._add_aux_terms(logits, routing_map[mask].sum(0))
                else:  # logits: [T / TP, B, E] (or flat), routing_map: [T / TP * B, E]
                    flat = logits.reshape(-1, logits.shape[-1])
                    self._add_sequence_parallel_aux_terms(flat[mask], routing_map[mask].sum(0))
            return probs, routing_map

        return wrapped

    def _add_sequence_parallel_aux_terms(self, real: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        """Under --sequence-parallel a router sees its TP rank's slice of the tokens: the load-balancing
        and z terms over all of them are sums of per-slice parts once the token counts are the TP
        group's (as megatron's router reduces `tokens_per_expert` over TP). Each rank's term has the
        whole value (the TP group's sum) and its own part's gradient: the slices' gradients add up
        as every sequence-parallel activation's do."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        counts = tokens_per_expert.float()
        n = torch.tensor(float(real.shape[0]), device=real.device)
        dist.all_reduce(counts, group=group)
        dist.all_reduce(n, group=group)
        probs = F.softmax(real.float(), dim=-1)
        balance = probs.shape[-1] / (self.top_k * n.clamp_min(1) ** 2) * (probs.sum(0) * counts).sum()
        z = torch.logsumexp(real.float(), dim=-1).square().sum() / n.clamp_min(1)
        for terms, part in ((self._aux, balance), (self.z_terms, z)):
            whole = part.detach().clone()
            dist.all_reduce(whole, group=group)
            terms.append(part + (whole - part.detach()))

    def _hook(self, layer: int):
        def hook(mod, _inputs, out):
            _probs, routing_map = out  # [tokens, experts] bool: the experts each token goes to
            counts = routing_map.detach().sum(0).float()
            self.load = self.load.to(counts.device)  # kept where the routers run (no sync per layer)
            self.load[layer] += counts

        return hook

    def reset(self) -> None:
        self.flips = self.routed = 0
        self.load.zero_()

    load_balance = RoutingReplay.load_balance


def sequence_parallel_rows(full: torch.Tensor, local: int, fill) -> torch.Tensor:
    """The rows of `full` (one per token of a micro-batch, megatron's sequence-first order) that this
    TP rank's router sees: all of them, or under --sequence-parallel its slice of the sequence (the
    width padded to a multiple of TP: padding tokens, `fill`, come last in sequence-first order)."""
    if full.shape[0] == local:
        return full
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pad = local * size - full.shape[0]
    if size == 1 or pad < 0:
        raise ValueError(
            f"routing: a router sees {local} tokens of a micro-batch of {full.shape[0]} (TP {size})"
        )
    full = torch.cat([full, full.new_full((pad, *full.shape[1:]), fill)])
    return full[rank * local : (rank + 1) * local]


class _LayerReplay:
    """One router's `router_replay` (megatron's RouterReplay interface: `get_replay_topk`)."""

    def __init__(self, owner: MegatronRoutingReplay, layer: int):
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes = self.owner._replay
        if routes is None:
            return probs, idx
        want = sequence_parallel_rows(routes[:, self.layer], idx.shape[0], -1)
        idx = _replayed(self.owner, self.layer, idx, want.to(idx.device))
        return scores.gather(1, idx), idx


def upcycle_dense_to_moe(
    dense_dir: str,
    out_dir: str,
    num_experts: int = 4,
    top_k: int = 2,
    router_std: float = 0.02,
    seed: int = 0,
) -> str:
    """Sparse upcycling: a Qwen3 HF checkpoint -> a Qwen3-MoE one whose every expert is a copy of
    the dense MLP and whose routers are random (normal, `router_std`). With `norm_topk_prob` the
    top-k gate values sum to one, so the MoE computes the dense model's function (to float rounding)
    and keeps what it learned, errors included; experts diverge once training routes gradients to
    them. Tokenizer copied. Returns `out_dir`."""
    from miles_platform.models.checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from miles_platform.models.families import build_model, tiny_config

    dense, tok = load_hf_checkpoint(dense_dir)
    c = dense.config
    if c.architectures != ["Qwen3ForCausalLM"]:
        raise ValueError(f"{dense_dir}: upcycling takes a Qwen3ForCausalLM, got {c.architectures}")
    moe_cfg = tiny_config(
        "qwen3_moe", c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, moe_intermediate_size=c.intermediate_size,
        num_experts=num_experts, num_experts_per_tok=top_k, rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        bos_token_id=c.bos_token_id,
    )  # fmt: skip
    moe = build_model(moe_cfg, seed=seed)
    src, dst = dense.state_dict(), moe.state_dict()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in dst.items():
            if ".mlp.experts.gate_up_proj" in name:  # [E, 2I, H]: gate rows, then up rows
                pre = name.split(".mlp.")[0]
                both = torch.cat([src[f"{pre}.mlp.gate_proj.weight"], src[f"{pre}.mlp.up_proj.weight"]], 0)
                t.copy_(both.expand_as(t))
            elif ".mlp.experts.down_proj" in name:  # [E, H, I]
                t.copy_(src[f"{name.split('.mlp.')[0]}.mlp.down_proj.weight"].expand_as(t))
            elif ".mlp.gate.weight" in name:  # the router
                t.copy_(torch.randn(t.shape, generator=gen) * router_std)
            else:
                t.copy_(src[name])
    return str(save_hf_checkpoint(moe, tok, out_dir))
