"""One device per rank: the trainer's whole step runs on the rank's device, proved without a GPU.

Each case builds a TrainerActor on the fake device of tests/device_check.py (a non-CPU device whose
tensors carry real values) and trains one rollout: any tensor of the step built on the CPU and mixed
into the device's computation (a batch, a mask, an advantage, a loss-hub constant, a stray model
buffer) raises DeviceMismatch, as it would on CUDA. The same step on the CPU must give the same
numbers (fp32 rounding: the fake device runs SDPA's math path), so the check ran the real step.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from device_check import fake_device, host_values, on_device
from loop_helpers import random_train_batch

from miles_platform.config import RunConfig
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from miles_platform.training.actor import TrainBatch, TrainerActor
from miles_platform.training.train_samples import TrainSamplesTarget

TOL = 1e-5


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", "qwen3_moe")


def _cfg(ckpt, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                lr=1e-3, num_rollout=4, micro_batch_size=2)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _extras(batch: TrainBatch, seed: int, *, supports=False, candidates=0, routes=None) -> TrainBatch:
    """Sampling supports (each a sorted id set holding the drawn token), K candidates per response
    token, or R3 routes `[tokens - 1][layers][top_k]` (routes=(layers, top_k, experts))."""
    g = torch.Generator().manual_seed(seed)
    n = len(batch)
    if supports:
        batch.rollout_sampling_supports = [
            [sorted({t, *torch.randint(3, 60, (4,), generator=g).tolist()}) for t in toks[-r:]]
            for toks, r in zip(batch.tokens, batch.response_lengths, strict=True)
        ]
    if candidates:
        batch.rollout_topk_token_ids = [
            [torch.randperm(60, generator=g)[:candidates].tolist() for _ in range(r)]
            for r in batch.response_lengths
        ]
        batch.rollout_topk_log_probs = [
            [(-torch.rand(candidates, generator=g) * 5).tolist() for _ in range(r)]
            for r in batch.response_lengths
        ]
    if routes:
        layers, k, experts = routes
        batch.routed_experts = [
            [
                [torch.randperm(experts, generator=g)[:k].tolist() for _ in range(layers)]
                for _ in range(len(t) - 1)
            ]
            for t in batch.tokens
        ]
    assert len(batch) == n
    return batch


CASES = {
    "fsdp-grpo": ({}, {}),
    "megatron-grpo": ({"train_backend": "megatron"}, {}),
    "fsdp-ppo-critic-kl": (
        {
            "advantage_estimator": "ppo",
            "use_kl_loss": True,
            "kl_loss_coef": 0.1,
            "kl_coef": 0.05,
            "entropy_coef": 0.01,
            "normalize_advantages": True,
        },
        {},
    ),  # fmt: skip
    "megatron-reinforce-ref-tis": (
        {
            "train_backend": "megatron",
            "advantage_estimator": "reinforce_plus_plus",
            "kl_coef": 0.05,
            "use_tis": True,
            "get_mismatch_metrics": True,
            "num_steps_per_rollout": 2,
            "global_batch_size": 2,
            "normalize_advantages": True,
        },
        {},
    ),  # fmt: skip
    "fsdp-lora": ({"lora_rank": 4}, {}),
    "megatron-lora": ({"train_backend": "megatron", "lora_rank": 4}, {}),
    "fsdp-opd-in-trainer-teacher": ({"use_opd": True, "opd_type": "megatron"}, {}),
    "megatron-opd-in-trainer-teacher": (
        {"train_backend": "megatron", "use_opd": True, "opd_type": "megatron"},
        {},
    ),
    "fsdp-sampling-support-replay": ({"rollout_top_k": 8}, {"supports": True}),
    "fsdp-score-centering": (
        {
            "loss_type": "score_centering",
            "rollout_top_logprobs_num": 4,
            "use_rollout_logprobs": True,
            "score_centering_is": "tis",
        },
        {"candidates": 4},
    ),  # fmt: skip
    "fsdp-sft": ({"loss_type": "sft_loss"}, {}),
}


def _train(cfg: RunConfig, batch: TrainBatch, device, samples=None) -> tuple[dict, dict, list]:
    actor = TrainerActor(cfg, device=device)
    m = actor.train(0, batch, samples)
    lps = actor.compute_log_probs(batch)
    weights = {k: host_values(v).clone() for k, v in actor.get_hf_weights().items()}
    return m, weights, lps


def _check_same(fake: tuple, cpu: tuple) -> None:
    (m1, w1, lp1), (m2, w2, lp2) = fake, cpu
    for k, v in m2.items():
        if k.startswith("perf/") or not math.isfinite(v):
            continue
        assert m1[k] == pytest.approx(v, rel=TOL, abs=TOL), k
    assert sorted(w1) == sorted(w2)
    for k in w2:
        assert torch.allclose(w1[k], w2[k], rtol=TOL, atol=TOL), k
    for a, b in zip(lp1, lp2, strict=True):
        assert a == pytest.approx(b, rel=TOL, abs=TOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_step_runs_on_the_ranks_device(case, tiny_hf_checkpoint, tmp_path):
    flags, extras = CASES[case]
    if flags.get("use_opd"):
        flags = {**flags, "opd_teacher_load": tiny_hf_checkpoint}
    make = lambda: _extras(random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]), 1, **extras)  # noqa: E731
    # the train_samples rows too (training/train_samples.py builds them from the loss's tensors)
    roots = {where: str(tmp_path / where) for where in ("device", "cpu")}
    target = TrainSamplesTarget(version=1)
    with fake_device() as dev:
        got = _train(_cfg(tiny_hf_checkpoint, storage_root=roots["device"], **flags), make(), dev, target)
    _check_same(
        got, _train(_cfg(tiny_hf_checkpoint, storage_root=roots["cpu"], **flags), make(), "cpu", target)
    )
    rows = {w: read_rows(StoragePaths(r), "train_samples") for w, r in roots.items()}
    assert rows["device"] and len(rows["device"]) == len(rows["cpu"])
    for a, b in zip(rows["device"], rows["cpu"], strict=True):
        assert a["index"] == b["index"] and a["loss_mask"] == b["loss_mask"]
        for c in ("advantage", "log_probs"):
            assert a[c] == pytest.approx(b[c], abs=1e-6), c


def test_moe_routing_replay_and_aux_loss_run_on_the_ranks_device(moe_ckpt):
    cfg = _cfg(moe_ckpt, use_rollout_routing_replay=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    make = lambda: _extras(random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]), 1, routes=(2, 2, 4))  # noqa: E731
    with fake_device() as dev:
        got = _train(cfg, make(), dev)
    _check_same(got, _train(cfg, make(), "cpu"))
    assert got[0]["train/moe_route_flips"] >= 0 and "train/moe_aux_loss" in got[0]


def test_every_trainer_tensor_lives_on_the_device(tiny_hf_checkpoint):
    """Model, reference, critic, gradients and optimizer state are on the device after a step."""
    cfg = _cfg(tiny_hf_checkpoint, advantage_estimator="ppo", use_kl_loss=True, kl_loss_coef=0.1)
    with fake_device() as dev:
        actor = TrainerActor(cfg, device=dev)
        actor.train(0, random_train_batch(0))
        assert actor.device == dev and actor.backend.device == dev and actor.ref.device == dev
        modules = {"policy": actor.backend.module, "ref": actor.ref.module, "critic": actor.critic}
        for name, mod in modules.items():
            for n, t in [*mod.named_parameters(), *mod.named_buffers()]:
                assert on_device(t), f"{name} {n} on {t.device}"
        for opt in (actor.opt, actor.critic.opt):
            for st in opt.state.values():
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "step":  # AdamW counts steps on the host
                        assert on_device(v), k


def test_a_cpu_tensor_in_the_step_is_caught(tiny_hf_checkpoint, monkeypatch):
    """The check itself: a mask built on the CPU (what the trainer did before it had a device)
    fails the step on the fake device with an error naming the op."""
    from device_check import DeviceMismatch

    monkeypatch.setattr(
        TrainerActor, "_mask", lambda self, b, i: torch.tensor(b.loss_masks[i], dtype=torch.float32)
    )
    with fake_device() as dev, pytest.raises(DeviceMismatch, match="meets tensors on the rank's device"):
        TrainerActor(_cfg(tiny_hf_checkpoint), device=dev).train(0, random_train_batch(0))


@pytest.mark.parametrize(
    "family", ["qwen3_5", "deepseek_v3", "minimax_m2", "deepseek_v32", "deepseek_v3_halves-lora"]
)
def test_megatron_bridge_layers_run_on_the_ranks_device(family, tiny_hf_checkpoint, tmp_path):
    """The megatron layers the bridges add: Qwen3.5's GatedDeltaNet (the CPU's torch stand-in for fla),
    gated attention, zero-centered and gated output norms; DeepSeek-V3's MLA (duplicated down projections,
    yarn-free rope, latent norms) and sigmoid group-limited router with its expert bias; MiniMax-M2's
    whole-projection q/k norms; DeepSeek-V3.2's DSA (the frozen indexer's scores, top-k and sparse mask). R3
    for the routed ones. DeepSeek-V3 with LoRA (no R3: refused with it) in HF's half-split rope layout:
    the adapters on MLA's projections (their rows in the bridge's rope order: an index tensor) and the
    experts, the fresh factors, the adapter export."""
    from test_megatron_layouts import bridge_checkpoint  # the bridge tests' tiny models (same directory)

    from miles_platform.models.moe import routed_shape

    family, lora = family.removesuffix("-lora"), family.endswith("-lora")
    ckpt = bridge_checkpoint(family, tiny_hf_checkpoint, tmp_path / "hf")
    moe = family != "qwen3_5" and not lora  # R3 with LoRA is refused (config/moe.py)
    flags = dict(train_backend="megatron", **(dict(use_rollout_routing_replay=True) if moe else {}))
    if lora:
        flags.update(lora_rank=4, target_modules="all-linear")
    routes = (*routed_shape(ckpt), 4) if moe else None
    make = lambda: _extras(random_train_batch(0, rewards=[1.0, 0.0, 0.0, 1.0]), 1, routes=routes)  # noqa: E731
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    with fake_device() as dev:
        got = _train(_cfg(ckpt, **flags), make(), dev)
    # megatron keeps the aux losses' backward scale on its class, made on the first run's device (one per process)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    _check_same(got, _train(_cfg(ckpt, **flags), make(), "cpu"))


@pytest.mark.parametrize("variant", ["deepseek_v3_half_split_rope", "deepseek_v32_indexer"])
def test_the_bridges_row_permutations_run_on_the_tensors_device(variant):
    """DeepSeek-V3's rope rows for HF's half-split layout and DeepSeek-V3.2's indexer rows are permuted by
    an index tensor built on the CPU: the mapping of a state on the rank's device (the trainer's HF
    export, weight sync) moves it there (it met the device as a CPU index before: DeviceMismatch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_deepseek_v3_bridge import _state, deepseek_config, sharp_model

    from miles_platform.models.bridge import get_bridge

    family = "deepseek_v32" if variant.startswith("deepseek_v32") else "deepseek_v3"
    extra = {} if family == "deepseek_v32" else {"rope_interleave": False}
    cfg = deepseek_config(family=family, **extra)
    sd, bridge = _state(cfg, sharp_model(cfg)), get_bridge(cfg)
    with fake_device() as dev:
        on_dev = {k: v.to(dev) for k, v in sd.items()}
        back = bridge.megatron_to_hf(bridge.hf_to_megatron(on_dev, cfg), cfg)
        assert all(back[k].device == dev for k in back)
    assert all(torch.equal(host_values(back[k]), sd[k]) for k in sd)
