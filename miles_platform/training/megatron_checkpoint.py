"""The megatron backend's optimizer state as a torch_dist checkpoint that any layout reads.

The model's weights are megatron-core sharded tensors with global keys (`save_torch_dist`); the
optimizer's per-parameter state (AdamW's exp_avg and exp_avg_sq) has each parameter's shape, so
it is saved as sharded tensors built from the parameter's own (megatron's
`make_sharded_optimizer_tensor`, keys `optimizer.state.<k>.<model key>`), and under --bf16 the fp32
main parameters too (`optimizer.main_param.<model key>`). dist_checkpointing reshards all of it on
load like the weights, so a run saved at TP2 resumes at TP1, PP2 at TP2, and so on, to the same
next step. The step count and the state's keys are common (non-sharded) state.

Written into `<iter dir>/optimizer/`, beside the model's torch_dist files, which stay what
`--ref-load` and `miles-platform convert` read.
"""

from __future__ import annotations

import os
from typing import Any

import torch

OPTIMIZER_DIR = "optimizer"


def _sharded_params(chunks) -> dict[int, Any]:
    """id(model parameter) -> its ShardedTensor (or factory) in the chunks' sharded state dicts."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    out = {}
    for c in chunks:
        sharded, _ = extract_sharded_tensors_and_factories(c.sharded_state_dict())
        for ten in nested_values(sharded):
            out[id(ten.data)] = ten
    return out


def _template(chunks, named_params, model_param_of, state_of, keys: list[str], main: bool, own=None) -> dict:
    """{param name: {state key: sharded tensor}} for the optimizer's parameters (`own`: each main
    parameter as a copy)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_param = _sharded_params(chunks)
    out: dict[str, dict] = {}
    for name, p in named_params:
        sh = by_param.get(id(model_param_of(p)))
        if sh is None:
            raise RuntimeError(f"optimizer checkpoint: parameter {name} has no sharded model tensor")
        entry = {k: make_sharded_optimizer_tensor(sh, state_of(p, k), f"optimizer.state.{k}") for k in keys}
        if main:
            data = p.data if own is None else own(p.data)
            entry["main_param"] = make_sharded_optimizer_tensor(sh, data, "optimizer.main_param")
        out[name] = entry
    return out


def _trained(named_params, model_param_of) -> list:
    """The parameters with optimizer state: a frozen one (DeepSeek-V3.2's DSA indexer,
    --moe-router-freeze-gate's routers) never steps, so it has none (its weights are the model's)."""
    return [(n, p) for n, p in named_params if model_param_of(p).requires_grad]


def _tensor_keys(opt: torch.optim.Optimizer) -> list[str]:
    """The per-parameter tensor state of an optimizer that has stepped (AdamW: exp_avg, exp_avg_sq)."""
    for st in opt.state.values():
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _step(opt: torch.optim.Optimizer) -> float | None:
    for st in opt.state.values():
        v = st.get("step")
        return float(v) if v is not None else None
    return None


def save_optimizer(
    chunks, named_params, model_param_of, opt, ckpt_dir: str, save_strategy, main: bool, scaler=None
) -> None:
    """Collective: the optimizer state (and fp32 main params, --fp16's grad scaler) into
    `<ckpt_dir>/optimizer/`."""
    from megatron.core import dist_checkpointing

    state = optimizer_state(chunks, named_params, model_param_of, opt, main, scaler=scaler)
    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path, sharded_strategy=save_strategy)


def optimizer_state(chunks, named_params, model_param_of, opt, main: bool, own=None, scaler=None) -> dict:
    """What `save_optimizer` writes: the sharded state (over copies, made by `own`, when given);
    --fp16's grad scaler (scale, growth and hysteresis trackers) as common state."""
    from miles_platform.training.megatron_precision import scaler_state

    keys = _tensor_keys(opt)
    of = (lambda p, k: opt.state[p][k]) if own is None else (lambda p, k: own(opt.state[p][k]))
    sharded = _template(chunks, _trained(named_params, model_param_of), model_param_of, of, keys, main, own)
    out = {"params": sharded, "tensor_keys": keys, "step": _step(opt), "main": main}
    if scaler is not None:
        out["grad_scaler"] = scaler_state(scaler)
    return out


def load_optimizer(chunks, named_params, model_param_of, opt, ckpt_dir: str, main: bool, scaler=None) -> bool:
    """Collective: resharding load of `save_optimizer`'s state into `opt` (and the main params, the
    grad scaler). False when the checkpoint has none (saved by an older build)."""
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    if not os.path.isdir(path):
        return False
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("distributed_optimizer"):  # megatron_distopt.MARKER
        from miles_platform.errors import CheckpointError

        raise CheckpointError(
            f"{path}: saved with --use-distributed-optimizer (megatron's sharded optimizer state); resume with "
            "the flag, or --no-load-optim"
        )
    keys, step = common["tensor_keys"], common["step"]
    main = main and common["main"]  # fp32 main params saved by a --bf16 / --fp16 run, read by one
    if scaler is not None and "grad_scaler" in common:  # saved by an --fp16 run
        from miles_platform.training.megatron_precision import load_scaler_state

        load_scaler_state(scaler, common["grad_scaler"])
    named_params = _trained(named_params, model_param_of)
    template = _template(chunks, named_params, model_param_of, lambda p, k: torch.empty_like(p), keys, main)
    loaded = dist_checkpointing.load({"params": template}, path)["params"]
    with torch.no_grad():
        for name, p in named_params:
            got = loaded[name]
            if main and "main_param" in got:
                p.copy_(got["main_param"])
            if keys:
                st = opt.state.setdefault(p, {})
                for k in keys:
                    st[k] = got[k].to(p.dtype).clone()
                st["step"] = torch.tensor(float(step))
    return True


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values at the save point, in host memory (the training steps do not touch it)."""
    return t.detach().to("cpu", copy=True)


def copied(sharded_state: dict) -> dict:
    """The sharded state dict with every sharded tensor (and factory) over a host copy of its data."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for v in nested_values(sharded_state):
        if torch.is_tensor(getattr(v, "data", None)):
            v.data = host_copy(v.data)
    return sharded_state


class AsyncTorchDist:
    """--async-save on megatron: dist_checkpointing's own asynchronous save (`async_sharded_save`),
    its parts placed in Checkpointer.save_async's phases. `prepare` (every rank, at the save point):
    the weights' and the optimizer state's sharded state dicts over host copies, the save plan and
    the access check (collectives), the common state; `write` (a background thread): this rank's
    tensor files (megatron's writer); `finalize` (every rank, at the next save or train call): the
    global metadata (a collective), after which the torch_dist dirs are complete. A kill -9 before
    it leaves an unpublished temp dir and the pointer on the previous checkpoint."""

    def __init__(self, model_state, opt_state, strategy):
        """`model_state()` / `opt_state()` (None: no optimizer saved): the sharded state dicts to
        write, over copies; `strategy()`: the torch_dist save strategy."""
        self.parts = [("", model_state)] + ([(OPTIMIZER_DIR, opt_state)] if opt_state is not None else [])
        self.strategy, self.requests = strategy, []

    def prepare(self, d: str) -> None:
        from megatron.core import dist_checkpointing

        for sub, state in self.parts:
            path = os.path.join(d, sub) if sub else d
            os.makedirs(path, exist_ok=True)
            req = dist_checkpointing.save(
                state(), path, sharded_strategy=self.strategy(), async_sharded_save=True
            )
            self.requests.append(req)

    def write(self, d: str) -> None:
        for r in self.requests:  # tensors already in host memory: no preload
            if r.async_fn is not None:
                r.async_fn(*r.async_fn_args, **r.async_fn_kwargs)

    def finalize(self, d: str) -> None:
        for r in self.requests:
            for fn in r.finalize_fns:
                fn()
