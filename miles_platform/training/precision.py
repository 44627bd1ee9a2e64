"""Precision control: rules, the `--fsdp-precision-rules` parser, the wrap-plan compiler, alignment metrics.

Three dtype axes, each with one owner:

    master   resident dtype the optimizer steps on          --fsdp-master-dtype
    gather   dtype weights carry in the forward              FSDP2 param_dtype, refined per module by rules
    compute  dtype the ops run at                            --train-forward-dtype (autocast)

A model declares `Rule`s; `compile_precision` lowers them onto nested `fully_shard` wrap units
(one per module whose gather dtype differs from its parent's) plus, where a single module needs
two gather dtypes, per-wrap maps of wrap-local parameter names. Everything here is pure and runs
on CPU without a process group; `miles_platform.training.fsdp` applies a plan.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from miles_platform.errors import MilesError

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
INPUT_DTYPE_VALUES = ("default", "fp32", "bf16", "fp16", None)
# Wrapper segments that activation checkpointing / torch.compile / FSDP1 insert into FQNs. Rules are
# written against the model's own names, so these are stripped before matching and in wrap-local names.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


class PrecisionError(MilesError, ValueError):
    """A precision rule or policy that cannot be honoured: names the rule/flag and what to do."""


def to_dtype(name: str, what: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise PrecisionError(f"{what}: unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """Give `dtype` (gather) to the selected parameters.

    A module rule selects modules by root-relative FQN glob (`module`) and/or class-name glob
    (`cls`; both must match when both are set) and covers every parameter under them. A parameter
    rule selects parameters by root-relative FQN glob (`param`).
    """

    dtype: str
    module: str | None = None
    cls: str | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        to_dtype(self.dtype, f"precision rule {self}")
        if self.param is not None and (self.module is not None or self.cls is not None):
            raise PrecisionError(f"precision rule {self}: a rule selects modules or parameters, not both")
        if self.param is None and self.module is None and self.cls is None:
            raise PrecisionError(f"precision rule {self}: give module=, cls= or param=")

    def __str__(self) -> str:
        sel = [
            f"{k}:{v}" for k, v in (("module", self.module), ("class", self.cls), ("param", self.param)) if v
        ]
        return "&".join(sel) + f"={self.dtype}"


def parse_precision_rules(text: str | None) -> list[Rule]:
    """Parse `--fsdp-precision-rules`.

    Grammar: rules separated by `;`, each `SELECTOR=DTYPE`; SELECTOR is `module:GLOB`, `class:GLOB`,
    `param:GLOB`, or `module:GLOB&class:GLOB` (both must match). DTYPE is fp32, bf16 or fp16.
    Example: `module:model.layers.*.mlp=fp32;class:*RMSNorm=fp32;param:lm_head.weight=fp32`.
    """
    rules: list[Rule] = []
    for i, raw in enumerate((text or "").split(";")):
        item = raw.strip()
        if not item:
            continue
        where = f"--fsdp-precision-rules rule {i + 1} {item!r}"
        sel, eq, dtype = item.rpartition("=")
        if not eq or not sel.strip():
            raise PrecisionError(f"{where}: expected SELECTOR=DTYPE, e.g. class:*RMSNorm=fp32")
        parts: dict[str, str] = {}
        for term in sel.split("&"):
            kind, colon, pattern = term.strip().partition(":")
            kind = {"module": "module", "class": "cls", "param": "param"}.get(kind.strip(), "")
            if not colon or not kind or not pattern.strip() or kind in parts:
                raise PrecisionError(
                    f"{where}: selector terms are module:GLOB, class:GLOB or param:GLOB, each once"
                )
            parts[kind] = pattern.strip()
        try:
            rules.append(Rule(dtype=dtype.strip(), **parts))
        except PrecisionError as e:
            raise PrecisionError(f"{where}: {e}") from None
    return rules


def normalize_fqn(fqn: str) -> str:
    return ".".join(s for s in fqn.split(".") if s and s not in _WRAPPER_SEGMENTS)


def _glob(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


# ---------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class PrecisionPolicy:
    """The three axes resolved for one run. `gather` is the group default gather dtype."""

    master: str = "fp32"
    gather: str = "fp32"
    compute: str = "fp32"
    reduce: str = "fp32"
    rules: tuple[Rule, ...] = ()
    # False reproduces the naive policy (for the census): no model rules, FSDP re-casts unit inputs.
    aligned: bool = True
    input_dtype_policy: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def autocast(self) -> bool:
        """Forward autocast is active exactly when compute runs below fp32."""
        return self.compute != "fp32"

    @property
    def cast_forward_inputs(self) -> bool:
        """With autocast on, each wrap unit must not re-cast activations up to its gather dtype."""
        return not (self.autocast and self.aligned)

    @classmethod
    def from_config(cls, cfg: Any, gather_dtype: str | None = None) -> PrecisionPolicy:
        """From a RunConfig. The gather default is the master dtype unless given (no down-cast).
        An unset forward dtype is resolved per device by the backend (cluster/devices.py); a
        config used here directly without one computes in fp32, the CPU's default."""
        master = cfg.fsdp_master_dtype
        return cls(
            master=master,
            gather=gather_dtype or master,
            compute=cfg.train_forward_dtype or getattr(cfg, "rollout_dtype", None) or "fp32",
            reduce=cfg.fsdp_reduce_dtype,
            rules=tuple(parse_precision_rules(cfg.fsdp_precision_rules)),
        )


def _qwen_rules(policy: PrecisionPolicy) -> list[Rule]:
    # F.embedding is not autocast-covered: the embedding output would seed the residual stream in the
    # gather dtype. Qwen3RMSNorm ends in `weight * x.to(input_dtype)`, which promotes to the weight's
    # dtype. Gathering both at the compute dtype keeps the stream there, as the engine's bf16 weights do.
    return [Rule(policy.compute, module="model.embed_tokens"), Rule(policy.compute, cls="*RMSNorm")]


def _qwen_moe_rules(policy: PrecisionPolicy) -> list[Rule]:
    # the experts hold their weights as raw [E, out, in] parameters indexed per expert and fed to
    # F.linear / grouped matmuls that CPU autocast does not cover (measured: their activations stayed
    # in the gather dtype); gathered at the compute dtype they match the engine's bf16 experts
    return [*_qwen_rules(policy), Rule(policy.compute, cls="*Experts")]


MODEL_RULES = {"qwen3": _qwen_rules, "qwen2": _qwen_rules, "llama": _qwen_rules, "qwen3_moe": _qwen_moe_rules}


def model_rules(model: nn.Module, policy: PrecisionPolicy) -> list[Rule]:
    """The family's declared rules; self-activating: empty unless a forward autocast is on."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not policy.autocast or not policy.aligned or model_type not in MODEL_RULES:
        return []
    return MODEL_RULES[model_type](policy)


def effective_rules(model: nn.Module, policy: PrecisionPolicy) -> list[Rule]:
    """Model rules first, then the operator's `--fsdp-precision-rules` (later overrides earlier)."""
    return model_rules(model, policy) + list(policy.rules)


def default_wrap_classes(model: nn.Module) -> tuple[str, ...]:
    """The per-layer default wrap units: HF's `_no_split_modules` (decoder layers)."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


# ---------------------------------------------------------------------------- compiler


@dataclass(frozen=True)
class WrapUnit:
    """One `fully_shard` call: `param_dtype` for the group, overrides by wrap-local name."""

    fqn: str  # root-relative; "" is the root
    param_dtype: str
    param_dtype_map: Mapping[str, str] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        return 0 if not self.fqn else self.fqn.count(".") + 1


@dataclass
class PrecisionPlan:
    units: list[WrapUnit]  # deepest first: the order FSDP2 claims parameters
    node_dtype: dict[str, str]  # gather dtype of every module (root "")
    param_dtype: dict[str, str]  # gather dtype every floating parameter carries in the forward

    @property
    def needs_param_maps(self) -> bool:
        return any(u.param_dtype_map for u in self.units)

    def unit(self, fqn: str) -> WrapUnit:
        return next(u for u in self.units if u.fqn == fqn)


@dataclass
class _Node:
    fqn: str
    cls: str
    params: list[str]  # root-relative FQNs of the floating parameters owned directly
    children: list[_Node]


def _tree(model: nn.Module) -> tuple[_Node, dict[str, list[str]]]:
    """Module tree (first occurrence of shared modules/params wins, as in FSDP2) + aliases per param."""
    nodes: dict[str, _Node] = {}
    seen: set[int] = set()
    aliases: dict[int, list[str]] = {}
    owner: dict[int, str] = {}
    users: dict[int, list[str]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        nodes[fqn] = _Node(fqn, type(mod).__name__, [], [])
        if fqn:
            nodes[fqn.rpartition(".")[0]].children.append(nodes[fqn])
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            aliases.setdefault(id(p), []).append(f"{fqn}.{name}" if fqn else name)
            users.setdefault(id(p), []).append(fqn)
            if id(p) not in seen and p.is_floating_point():
                seen.add(id(p))
                owner[id(p)] = aliases[id(p)][0]
    for key, canon in owner.items():
        # A tied parameter belongs to the lowest common ancestor of its users: one FSDP group must hold it.
        segs = [u.split(".") if u else [] for u in users[key]]
        nodes[".".join(_common_prefix(segs))].params.append(canon)
    return nodes[""], {owner[k]: v for k, v in aliases.items() if k in owner}


def _common_prefix(segs: list[list[str]]) -> list[str]:
    out: list[str] = []
    for parts in zip(*segs, strict=False):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return out


def resolve_param_dtypes(model: nn.Module, rules: Sequence[Rule], default: str) -> dict[str, str]:
    """Pass 1: one gather dtype per floating parameter (canonical FQN), rules in declaration order."""
    root, aliases = _tree(model)
    dtypes = dict.fromkeys(aliases, default)
    names = {canon: [normalize_fqn(a) for a in al] for canon, al in aliases.items()}
    modules = [
        (normalize_fqn(fqn), type(m).__name__, fqn) for fqn, m in model.named_modules(remove_duplicate=False)
    ]
    for rule in rules:
        hit = False
        if rule.param is not None:
            for canon, al in names.items():
                if any(_glob(a, rule.param) for a in al):
                    dtypes[canon], hit = rule.dtype, True
        else:
            for norm, cls, fqn in modules:
                if (rule.module is None or _glob(norm, rule.module)) and (
                    rule.cls is None or _glob(cls, rule.cls)
                ):
                    hit = True
                    prefix = f"{fqn}." if fqn else ""
                    for canon, al in aliases.items():
                        if any(a.startswith(prefix) for a in al):
                            dtypes[canon] = rule.dtype
        if not hit:
            raise PrecisionError(
                f"precision rule {rule} matches nothing in {type(model).__name__}; rules are root-relative "
                "globs (e.g. model.layers.*.mlp, *RMSNorm, lm_head.weight): fix or remove it"
            )
    return dtypes


def compile_precision(
    model: nn.Module,
    rules: Sequence[Rule],
    default: str,
    wrap_classes: Iterable[str] | None = None,
    master: str | None = None,
) -> PrecisionPlan:
    """Lower rules to a minimal cover of wrap units (+ per-wrap parameter maps where unavoidable).

    Root and `wrap_classes` modules (default: the decoder layers) are always units. Any other module is
    a unit iff its gather dtype differs from its enclosing unit's. A module's gather dtype is its own
    parameters' dtype when they agree; only when they disagree do the minority go into the enclosing
    unit's map. Among covers, a tree DP picks fewest map entries, then fewest wrap units, then gives
    each module the dtype most of its weights want.
    """
    to_dtype(default, "gather dtype")
    forced = set(default_wrap_classes(model) if wrap_classes is None else wrap_classes)
    want = resolve_param_dtypes(model, rules, default)
    root, _ = _tree(model)
    order = {d: i for i, d in enumerate(dict.fromkeys([default, *DTYPES]))}

    @functools.cache
    def subtree_dtypes(fqn: str) -> frozenset[str]:
        node = by_fqn[fqn]
        return frozenset([want[p] for p in node.params]).union(
            *(subtree_dtypes(c.fqn) for c in node.children)
        )

    numel = {n: p.numel() for n, p in model.named_parameters()}

    @functools.cache
    def subtree_numel(fqn: str, dtype: str) -> int:
        node = by_fqn[fqn]
        own = sum(numel[p] for p in node.params if want[p] == dtype)
        return own + sum(subtree_numel(c.fqn, dtype) for c in node.children)

    @functools.cache
    def best(fqn: str, ctx: str) -> tuple[tuple[int, int], str]:
        node = by_fqn[fqn]
        wrapped = node.fqn == "" or node.cls in forced
        own = {want[p] for p in node.params}
        candidates = own or ({ctx} | subtree_dtypes(fqn))
        scored = []
        for d in candidates:
            maps = sum(want[p] != d for p in node.params)
            wraps = int(d != ctx and not wrapped)
            for c in node.children:
                (cm, cw), _ = best(c.fqn, d)
                maps, wraps = maps + cm, wraps + cw
            # ties: the dtype most of the subtree's weights want, then the enclosing one
            scored.append(((maps, wraps, -subtree_numel(fqn, d), d != ctx, order[d]), d))
        (maps, wraps, *_), d = min(scored)
        return (maps, wraps), d

    by_fqn: dict[str, _Node] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        by_fqn[n.fqn] = n
        stack.extend(n.children)

    units: list[WrapUnit] = []
    node_dtype: dict[str, str] = {}

    def emit(node: _Node, ctx: str, unit: str) -> None:
        _, d = best(node.fqn, ctx)
        node_dtype[node.fqn] = d
        if node.fqn == "" or node.cls in forced or d != ctx:
            unit = node.fqn
            members[unit] = {}
            units.append(WrapUnit(unit, d))
        for p in node.params:
            local = normalize_fqn(p[len(unit) + 1 :] if unit else p)
            members[unit].setdefault(local, {})[p] = want[p]
        for c in node.children:
            emit(c, d, unit)

    members: dict[str, dict[str, dict[str, str]]] = {}  # unit -> wrap-local name -> {param: dtype}
    emit(root, default, "")
    units = [WrapUnit(u.fqn, u.param_dtype, _unit_map(u, members[u.fqn])) for u in units]
    _check_uniform_casts(units, master)
    units.sort(key=lambda u: -u.depth)  # stable: deepest first, siblings in module order
    return PrecisionPlan(units, node_dtype, want)


def _unit_map(unit: WrapUnit, locals_: dict[str, dict[str, str]]) -> dict[str, str]:
    """Overrides by wrap-local name; a name two parameters share must mean one dtype."""
    out: dict[str, str] = {}
    for local, params in locals_.items():
        dts = set(params.values())
        if len(dts) > 1:
            raise PrecisionError(
                f"wrap unit {unit.fqn or '<root>'!r}: parameters {sorted(params)} share the wrap-local name "
                f"{local!r} but want {sorted(dts)}; split them with a module rule"
            )
        (dt,) = dts
        if dt != unit.param_dtype:
            out[local] = dt
    return out


def _check_uniform_casts(units: list[WrapUnit], master: str | None) -> None:
    # FSDP2's all-gather copy-in casts every down-cast parameter of a group to one dtype.
    for u in units:
        casts = {d for d in [u.param_dtype, *u.param_dtype_map.values()] if d != master}
        if master is not None and u.param_dtype_map and len(casts) > 1:
            raise PrecisionError(
                f"wrap unit {u.fqn or '<root>'!r} would gather parameters in {sorted(casts)} besides the "
                f"{master} master; FSDP2 casts a group to one dtype: add a module rule to split it"
            )


def compile_policy(model: nn.Module, policy: PrecisionPolicy) -> PrecisionPlan:
    return compile_precision(model, effective_rules(model, policy), policy.gather, master=policy.master)


# ---------------------------------------------------------------------------- boundary inputs


def resolve_input_dtype(value: str | None, forward_dtype: str) -> torch.dtype | None:
    """`input_dtype_policy` value -> target dtype; None is passthrough."""
    if value not in INPUT_DTYPE_VALUES:
        raise PrecisionError(f"input_dtype_policy value {value!r}; allowed: default, fp32, bf16, fp16, None")
    if value is None:
        return None
    return to_dtype(forward_dtype if value == "default" else value)


def cast_boundary_inputs(
    kwargs: dict[str, Any], policy: Mapping[str, str | None], forward_dtype: str
) -> dict[str, Any]:
    """Cast the float model inputs named in `policy`; integer ids and unnamed inputs pass through."""
    out = dict(kwargs)
    for name, value in policy.items():
        target = resolve_input_dtype(value, forward_dtype)
        t = out.get(name)
        if target is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.to(target)
    return out


def apply_input_dtype_policy(
    model: nn.Module, policy: Mapping[str, str | None], forward_dtype: str
) -> torch.utils.hooks.RemovableHandle | None:
    """Install the model-boundary cast as a root forward pre-hook; autocast owns the interior."""
    if not policy:
        return None
    for value in policy.values():
        resolve_input_dtype(value, forward_dtype)

    def hook(_mod, args, kwargs):
        return args, cast_boundary_inputs(kwargs, policy, forward_dtype)

    return model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


# ---------------------------------------------------------------------------- alignment diagnostics


def _flat(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).double()
    if isinstance(x, list | tuple) and x and all(isinstance(t, torch.Tensor) for t in x):
        # one tensor per sample (the trainer's case): one cat and one cast, not three ops a sample
        with torch.no_grad():
            return torch.cat([t.reshape(-1) for t in x]).double()
    if isinstance(x, list | tuple) and any(isinstance(t, torch.Tensor | list | tuple) for t in x):
        return torch.cat([_flat(t) for t in x])
    return torch.as_tensor(list(x), dtype=torch.float64).reshape(-1)


def alignment_metrics(train_log_probs: Any, rollout_log_probs: Any, masks: Any) -> dict[str, float]:
    """Trainer-vs-rollout log-prob gap over loss-masked tokens (one tensor, or one list per sample).

    With `--debug-skip-optimizer-step` the weights are frozen, so any gap is forward-path difference.
    No masked tokens gives zeros.
    """
    train, rollout, mask = _flat(train_log_probs), _flat(rollout_log_probs), _flat(masks)
    if not (train.numel() == rollout.numel() == mask.numel()):
        raise PrecisionError(
            f"alignment_metrics: {train.numel()} train log-probs, {rollout.numel()} rollout log-probs and "
            f"{mask.numel()} mask entries must be equal (one per response token)"
        )
    keep = mask > 0
    if not bool(keep.any()):
        return {
            "train/log_prob_mean_abs_diff": 0.0,
            "train/log_prob_max_abs_diff": 0.0,
            "train/ratio_abs_minus_1": 0.0,
        }
    delta = (train - rollout)[keep]
    return {
        "train/log_prob_mean_abs_diff": float(delta.abs().mean()),
        "train/log_prob_max_abs_diff": float(delta.abs().max()),
        "train/ratio_abs_minus_1": float((torch.exp(delta) - 1).abs().mean()),
    }
