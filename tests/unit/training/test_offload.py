"""--offload-train and the colocated weight hand-off: a trainer rank parks every tensor in host
memory and takes it back bit for bit (on the fake device of tests/device_check.py, so the moves are
real), and an engine takes a trainer's weights through shared memory."""

from __future__ import annotations

import pytest
import torch
from device_check import fake_device, host_values, on_device
from loop_helpers import random_train_batch

from miles_platform.config import RunConfig
from miles_platform.training.actor import TrainerActor
from miles_platform.training.offload import trainer_modules, trainer_optimizers


def _cfg(ckpt, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                lr=1e-3, num_rollout=4, micro_batch_size=2, advantage_estimator="ppo", use_kl_loss=True,
                kl_loss_coef=0.1)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _tensors(actor) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor the rank holds, by a stable name."""
    out = {}
    for i, m in enumerate(trainer_modules(actor)):
        for n, t in [*m.named_parameters(), *m.named_buffers()]:
            out[f"m{i}.{n}"] = t
    for j, opt in enumerate(trainer_optimizers(actor)):
        names = {id(p): n for i, m in enumerate(trainer_modules(actor)) for n, p in m.named_parameters()}
        for p, st in opt.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"opt{j}.{names[id(p)]}.{k}"] = v
    return out


def _snapshot(actor) -> dict[str, torch.Tensor]:
    return {k: host_values(v.detach()).clone() for k, v in _tensors(actor).items()}


# megatron LoRA: the adapter factors sit beside the model (training/megatron_lora.py) and move too
LORA = dict(lora_rank=4, lora_alpha=8, advantage_estimator="grpo")


@pytest.mark.parametrize("backend", ["fsdp", "megatron", "megatron_lora"])
def test_offload_and_onload_move_every_tensor_and_change_nothing(backend, tiny_hf_checkpoint):
    lora = backend.endswith("_lora")
    cfg = _cfg(tiny_hf_checkpoint, train_backend=backend.removesuffix("_lora"), **(LORA if lora else {}))
    with fake_device() as dev:
        a, b = TrainerActor(cfg, device=dev), TrainerActor(cfg, device=dev)
        a.train(0, random_train_batch(0))
        b.train(0, random_train_batch(0))
        before = _snapshot(a)
        a.offload()
        parked = _tensors(a)
        assert sorted(parked) == sorted(before)
        on_dev = [k for k, t in parked.items() if on_device(t)]
        assert not on_dev, f"still on the device after offload: {on_dev[:5]}"
        assert all(p.grad is None for m in trainer_modules(a) for p in m.parameters())
        a.offload()  # idempotent
        a.onload()
        back = _tensors(a)
        off_dev = [k for k, t in back.items() if not on_device(t) and not k.endswith(".step")]
        assert not off_dev, f"not back on the device: {off_dev[:5]}"
        after = _snapshot(a)
        assert all(torch.equal(before[k], after[k]) for k in before)
        # the cycle changes nothing the next step sees: it trains exactly as the rank that stayed
        ma, mb = a.train(1, random_train_batch(1)), b.train(1, random_train_batch(1))
        assert {k: v for k, v in ma.items() if not k.startswith("perf/")} == {
            k: v for k, v in mb.items() if not k.startswith("perf/")
        }
        wa, wb = _snapshot(a), _snapshot(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wb)


def test_an_offloaded_rank_trains_after_onloading_itself(tiny_hf_checkpoint):
    """`train` and `compute_log_probs` bring an offloaded rank back first (no caller has to)."""
    with fake_device() as dev:
        a = TrainerActor(_cfg(tiny_hf_checkpoint), device=dev)
        a.offload()
        a.compute_log_probs(random_train_batch(0))
        assert not a.offloaded and all(on_device(p) for p in a.backend.module.parameters())
        a.offload()
        a.train(0, random_train_batch(0))
        assert not a.offloaded


def test_stage_and_open_staged_round_trip_every_dtype():
    from multiprocessing import shared_memory

    from miles_platform.weights.shared_tensors import open_staged, stage

    g = torch.Generator().manual_seed(0)
    named = {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 9, (2, 2), generator=g),
        "empty": torch.zeros(0, 4),
        "d": torch.randn(4, generator=g).to(torch.float16),
    }
    staged = stage(named)
    with open_staged(staged.descriptor) as got:
        assert list(got) == list(named)
        for k in named:
            assert got[k].dtype == named[k].dtype and torch.equal(got[k], named[k]), k
    name = staged.descriptor["segment"]
    staged.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_an_engine_takes_a_trainers_weights_through_shared_memory(tiny_hf_checkpoint):
    """/update_weights_from_tensor (SGLang's path) with the staged descriptor: the engine serves
    exactly the trainer's weights at the new version; a pickled SGLang payload is refused."""
    import httpx

    from miles_platform.rollout.engine_server import start_engine_server
    from miles_platform.weights.checksum import checksum

    actor = TrainerActor(
        _cfg(tiny_hf_checkpoint, advantage_estimator="grpo", use_kl_loss=False), device="cpu"
    )
    actor.train(0, random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]))
    srv = start_engine_server(tiny_hf_checkpoint, num_threads=1)
    try:
        desc = actor.stage_weights()
        r = httpx.post(
            f"{srv.url}/update_weights_from_tensor", json={"named_tensors": desc, "weight_version": 3}
        )
        assert r.status_code == 200 and r.json()["weight_version"] == 3, r.text
        actor.unstage_weights()
        want = actor.get_hf_weights()
        served = httpx.post(f"{srv.url}/weights_checksum", json={"names": sorted(want)}).json()
        assert all(served[k]["xxh3_128"] == checksum(want[k]) for k in want)
        bad = httpx.post(f"{srv.url}/update_weights_from_tensor", json={"serialized_named_tensors": ["x"]})
        assert bad.status_code == 400 and "pickled" in bad.json()["message"]
        gone = httpx.post(f"{srv.url}/update_weights_from_tensor", json={"named_tensors": desc})
        assert gone.status_code == 400 and "no shared-memory segment" in gone.json()["message"]
        assert srv.core.weight_version == 3
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "flags",
    [{}, dict(bf16=True), dict(bf16=True, optimizer_cpu_offload=True, use_precision_aware_optimizer=True)],
    ids=["fp32", "bf16", "trio"],
)
def test_the_distributed_optimizer_parks_in_place_and_steps_as_the_rank_that_stayed(
    tiny_hf_checkpoint, flags
):
    """--use-distributed-optimizer with --offload-train: the parameters are views into megatron DDP's
    buffer and the optimizer's shards views or copies stepped through it; every storage is parked in
    place (0 bytes on the device while offloaded) and refilled, so the next step (with the Adam
    state of the first) is the step of a rank that never offloaded. DP2: test_megatron_layouts.py."""
    from miles_platform.training.offload import _policy_storages

    cfg = _cfg(tiny_hf_checkpoint, train_backend="megatron", use_distributed_optimizer=True, optimizer="adam",
               offload_train=True, advantage_estimator="grpo", **flags)  # fmt: skip
    a, b = TrainerActor(cfg), TrainerActor(cfg)
    a.train(0, random_train_batch(0))
    b.train(0, random_train_batch(0))
    held = _policy_storages(a)
    a.offload()
    assert len(held) > 10 and all(s.nbytes() == 0 for s in held)
    assert all(p.untyped_storage().nbytes() == 0 for p in a.backend.module.parameters())
    a.onload()
    ma, mb = a.train(1, random_train_batch(1)), b.train(1, random_train_batch(1))
    assert {k: v for k, v in ma.items() if not k.startswith("perf/")} == {
        k: v for k, v in mb.items() if not k.startswith("perf/")
    }
    wa, wb = a.backend.module.state_dict(), b.backend.module.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wb if torch.is_tensor(wb[k]))
