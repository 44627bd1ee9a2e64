"""`--offload-train`: a trainer rank parks its model(s) and optimizer state in host memory while the
engines generate, and takes them back before it trains (Miles' actor offload / onload).

What moves: the policy, the reference, an in-trainer OPD teacher and the PPO critic (`module.to`,
which keeps every Parameter object, so the optimizers still hold them; FSDP2 re-registers its
sharded parameters in `FSDPModule._apply`), and every optimizer state tensor but AdamW's step
counts, which live on the host anyway. Gradients are dropped first (a step starts by zeroing them).
On the CPU the moves are copies to where the tensors already are; the fake device of the tests
(tests/device_check.py) proves that every tensor goes out and comes back bit for bit.
Not moved: megatron DDP's contiguous gradient buffer (world size > 1), zeroed and left in place.

With megatron's distributed optimizer (--use-distributed-optimizer) the policy's parameters are views
into DDP's contiguous parameter buffer, and the optimizer's shards views into those (fp32) or fp32
copies it steps and writes back through the buffer: `module.to` would give the parameters new
storage and detach both. There every storage of the policy, its DDP buffers and its optimizer (state
and main shards) is parked in place instead (`park`): copied to the host, then resized to 0 bytes
on the device, and on onload resized back and refilled, so every view stays a view (what Miles gets
from torch_memory_saver's pause / resume, which keeps the device addresses).
"""

from __future__ import annotations

import torch

from miles_platform.cluster.devices import empty_cache

HOST = torch.device("cpu")


def trainer_modules(actor) -> list[torch.nn.Module]:
    """Every module a trainer rank holds on its device."""
    mods = [actor.backend.module]
    lora = getattr(actor.backend, "lora", None)
    if isinstance(lora, torch.nn.Module):  # megatron LoRA: the adapter factors beside the model
        mods.append(lora)
    for extra in (actor.ref, actor.teacher):
        if extra is not None:
            mods.append(extra.module)
    if actor.critic is not None:
        mods.append(actor.critic)
    return mods


def trainer_optimizers(actor) -> list[torch.optim.Optimizer]:
    return [actor.opt] + ([actor.critic.opt] if actor.critic is not None else [])


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":  # AdamW counts steps on the host (not capturable)
                st[k] = v.to(device)


def _parks_in_place(actor) -> bool:
    """megatron's distributed optimizer: the policy's tensors are views into DDP's buffers."""
    return getattr(actor.backend, "ddp", None) is not None and bool(actor.cfg.use_distributed_optimizer)


def _policy_storages(actor) -> list:
    """The distinct device storages of the policy, its DDP buffers and its optimizer."""
    ts = [*actor.backend.module.parameters(), *actor.backend.module.buffers()]
    for ddp in actor.backend.ddp:
        for buf in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
            ts += [x for x in (buf.param_data, buf.grad_data) if x is not None]
    for g in actor.opt.param_groups:  # the main shards (views of the parameters or fp32 copies)
        ts += list(g["params"])
    for st in actor.opt.state.values():
        ts += [v for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    out: dict = {}
    for t in ts:
        s = t.untyped_storage()
        if t.device.type == actor.device.type and s.nbytes():
            out.setdefault(s.data_ptr(), s)
    return list(out.values())


def park(storages: list) -> list:
    """Each storage's bytes copied to the host, the storage resized to 0 (freed, its views kept)."""
    parked = []
    for s in storages:
        raw = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
        parked.append((s, raw.to(HOST, copy=True)))
        s.resize_(0)
    return parked


def unpark(parked: list) -> None:
    for s, host in parked:
        s.resize_(host.numel())
        torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(host)


def offload(actor) -> None:
    if actor.offloaded:
        return
    for opt in trainer_optimizers(actor):
        opt.zero_grad(set_to_none=True)
    actor.backend.zero_grad()
    in_place = _parks_in_place(actor)
    with torch.no_grad():
        if in_place:
            actor._parked = park(_policy_storages(actor))
        for m in trainer_modules(actor):
            if not (in_place and m is actor.backend.module):
                m.to(HOST)
        for opt in trainer_optimizers(actor):
            if not (in_place and opt is actor.opt):
                move_optimizer_state(opt, HOST)
    empty_cache(actor.device)
    actor.offloaded = True


def onload(actor) -> None:
    if not actor.offloaded:
        return
    in_place = _parks_in_place(actor)
    with torch.no_grad():
        if in_place:
            unpark(actor.__dict__.pop("_parked"))
        for m in trainer_modules(actor):
            if in_place and m is actor.backend.module:
                continue
            if actor.cfg.train_backend == "megatron" and m is not actor.critic:
                from miles_platform.training.megatron_backend import to_device

                to_device(m, actor.device)
            else:
                m.to(actor.device)
        for opt in trainer_optimizers(actor):
            if not (in_place and opt is actor.opt):
                move_optimizer_state(opt, actor.device)
    actor.offloaded = False
