"""`--offload-train`: a trainer rank parks its model(s) and optimizer state in host memory while the
engines generate, and takes them back before it trains (Miles' actor offload / onload).

What moves: the policy, the reference, an in-trainer OPD teacher and the PPO critic (`module.to`,
which keeps every Parameter object, so the optimizers still hold them; FSDP2 re-registers its
sharded parameters in `FSDPModule._apply`), and every optimizer state tensor but AdamW's step
counts, which live on the host anyway. Gradients are dropped first (a step starts by zeroing them).
On the CPU the moves are copies to where the tensors already are; the fake device of the tests
(tests/device_check.py) proves that every tensor goes out and comes back bit for bit.
Not moved: megatron DDP's contiguous gradient buffer (world size > 1), zeroed and left in place.
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


def offload(actor) -> None:
    if actor.offloaded:
        return
    for opt in trainer_optimizers(actor):
        opt.zero_grad(set_to_none=True)
    actor.backend.zero_grad()
    with torch.no_grad():
        for m in trainer_modules(actor):
            m.to(HOST)
        for opt in trainer_optimizers(actor):
            move_optimizer_state(opt, HOST)
    empty_cache(actor.device)
    actor.offloaded = True


def onload(actor) -> None:
    if not actor.offloaded:
        return
    with torch.no_grad():
        for m in trainer_modules(actor):
            if actor.cfg.train_backend == "megatron" and m is not actor.critic:
                from miles_platform.training.megatron_backend import to_device

                to_device(m, actor.device)
            else:
                m.to(actor.device)
        for opt in trainer_optimizers(actor):
            move_optimizer_state(opt, actor.device)
    actor.offloaded = False
