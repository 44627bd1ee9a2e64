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


def _template(chunks, named_params, model_param_of, state_of, keys: list[str], main: bool) -> dict:
    """{param name: {state key: sharded tensor}} for the optimizer's parameters."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_param = _sharded_params(chunks)
    out: dict[str, dict] = {}
    for name, p in named_params:
        sh = by_param.get(id(model_param_of(p)))
        if sh is None:
            raise RuntimeError(f"optimizer checkpoint: parameter {name} has no sharded model tensor")
        entry = {k: make_sharded_optimizer_tensor(sh, state_of(p, k), f"optimizer.state.{k}") for k in keys}
        if main:
            entry["main_param"] = make_sharded_optimizer_tensor(sh, p.data, "optimizer.main_param")
        out[name] = entry
    return out


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
    chunks, named_params, model_param_of, opt, ckpt_dir: str, save_strategy, main: bool
) -> None:
    """Collective: the optimizer state (and fp32 main params) into `<ckpt_dir>/optimizer/`."""
    from megatron.core import dist_checkpointing

    keys = _tensor_keys(opt)
    named_params = list(named_params)
    sharded = _template(chunks, named_params, model_param_of, lambda p, k: opt.state[p][k], keys, main)
    state = {"params": sharded, "tensor_keys": keys, "step": _step(opt), "main": main}
    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path, sharded_strategy=save_strategy)


def load_optimizer(chunks, named_params, model_param_of, opt, ckpt_dir: str, main: bool) -> bool:
    """Collective: resharding load of `save_optimizer`'s state into `opt` (and the main params).
    False when the checkpoint has none (saved by an older build)."""
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, OPTIMIZER_DIR)
    if not os.path.isdir(path):
        return False
    common = dist_checkpointing.load_common_state_dict(path)
    keys, step = common["tensor_keys"], common["step"]
    main = main and common["main"]  # fp32 main params saved by a --bf16 run, read by one
    named_params = list(named_params)
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
