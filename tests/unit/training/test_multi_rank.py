"""Data parallelism: 2 gloo ranks train exactly like 1 rank on the same global batch.

Each case trains a TrainerActor for 3 optimizer steps (global batch 4: 2 samples per rank on 2
ranks, 4 on 1 rank) in spawned processes, the 1-rank and 2-rank runs side by side, and compares
the final weights: identical across the 2 ranks and equal to the 1-rank run to fp32 tolerance.
Miles' SFT on chat data also runs a megatron rank beside them (the backends agree).
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from loop_helpers import spawn_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

ATOL = 1e-5
STEPS = 3


def _cfg(ckpt: str, **kw):
    from miles_platform.config import RunConfig

    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                micro_batch_size=1, lr=1e-3, num_rollout=STEPS)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _batch(seed: int):
    from loop_helpers import random_train_batch

    return random_train_batch(seed)


def _worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict, batches=None) -> None:
    """Train STEPS random batches (or `batches`, one per step) and save this rank's final tensors."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from miles_platform.training.actor import TrainerActor

    path = Path(out, f"rank{rank}")
    try:
        steps = len(batches) if batches is not None else STEPS
        actor = TrainerActor(
            _cfg(ckpt, **{"num_rollout": steps, **overrides}), rank, world, f"tcp://127.0.0.1:{port}"
        )
        for r in range(steps):
            actor.train(r, batches[r] if batches is not None else _batch(r))
        tensors = {f"policy/{k}": v.contiguous() for k, v in actor.get_hf_weights().items()}
        if actor.critic is not None:
            tensors.update(
                {f"critic/{k}": v.detach().contiguous() for k, v in actor.critic.state_dict().items()}
            )
        save_file(tensors, f"{path}.safetensors")
    except Exception:
        Path(f"{path}.error").write_text(traceback.format_exc())
    finally:
        if overrides.get("train_backend") == "megatron":
            from miles_platform.training import megatron_shims

            megatron_shims.destroy_process_group()
        elif dist.is_initialized():
            dist.destroy_process_group()


def _train_runs(ckpt: str, tmp_path: Path, runs: dict, batches=None) -> dict:
    """{name: [final tensors of each rank]} of `runs` {name: (world size, config overrides)}, run
    concurrently, each in its own spawned ranks."""
    started = {}
    for name, (world, overrides) in runs.items():
        out = tmp_path / f"run-{name}"
        out.mkdir()
        args = (world, free_port(), ckpt, str(out), overrides, batches)
        started[name] = (out, world, spawn_ranks(_worker, args, world, join=False))
    result = {}
    for name, (out, world, ctx) in started.items():
        while not ctx.join():
            pass
        errors = [p.read_text() for p in sorted(out.glob("*.error"))]
        assert not errors, errors[0]
        result[name] = [load_file(out / f"rank{r}.safetensors") for r in range(world)]
    return result


def _train(ckpt: str, tmp_path: Path, batches=None, **overrides) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{world size: [final tensors of each rank]} for world sizes 1 and 2, run concurrently."""
    return _train_runs(ckpt, tmp_path, {1: (1, overrides), 2: (2, overrides)}, batches)


def _assert_data_parallel_equals_single(res, prefix: str) -> None:
    (single,), (r0, r1) = res[1], res[2]
    names = [k for k in single if k.startswith(prefix)]
    assert names and sorted(names) == sorted(k for k in r0 if k.startswith(prefix))
    for k in names:
        same = torch.equal(r0[k], r1[k])
        assert same, f"{k}: ranks diverged (max diff {(r0[k] - r1[k]).abs().max():.3g})"
        diff = (r0[k] - single[k]).abs().max().item()
        assert diff <= ATOL, f"{k}: 2 ranks vs 1 rank differ by {diff:.3g}"


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_two_ranks_train_like_one_rank(tiny_hf_checkpoint, tmp_path, backend):
    res = _train(tiny_hf_checkpoint, tmp_path, train_backend=backend)
    _assert_data_parallel_equals_single(res, "policy/")
    # the steps moved the weights, so agreement is not the trivial kind
    init = load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))
    moved = [k for k in init if not torch.equal(init[k], res[1][0][f"policy/{k}"])]
    assert len(moved) >= len(init) // 2


def test_ppo_critic_two_ranks_train_like_one_rank(tiny_hf_checkpoint, tmp_path):
    """Critic grads are averaged over ranks and the advantage whitening uses global statistics:
    the policy (whose advantages depend on both) and the critic match the 1-rank run."""
    res = _train(tiny_hf_checkpoint, tmp_path, advantage_estimator="ppo", critic_lr=1e-2)
    _assert_data_parallel_equals_single(res, "critic/")
    _assert_data_parallel_equals_single(res, "policy/")


def _sft_chat_batches(ckpt: str, tmp_path: Path, steps: int) -> list:
    """`steps` rollouts of Miles' SFT rollout function over multi-turn chat data, as TrainBatches."""
    from loop_helpers import sft_argv, write_chat_data

    from miles_platform.config import parse_run_config
    from miles_platform.data.source import RolloutDataSource
    from miles_platform.rollout.sft_rollout import generate_rollout
    from miles_platform.training.actor import TrainBatch

    cfg = parse_run_config(sft_argv(ckpt, write_chat_data(tmp_path)))
    src = RolloutDataSource.from_config(cfg)
    return [TrainBatch.from_samples([g[0] for g in generate_rollout(cfg, r, src)]) for r in range(steps)]


def test_sft_on_chat_data_two_ranks_and_megatron_train_like_one_fsdp_rank(tiny_hf_checkpoint, tmp_path):
    """Miles' SFT (sft_loss, token mean over the global batch: --calculate-per-token-loss) on chat
    samples of unequal lengths and masks: 2 fsdp ranks and 1 megatron rank end where 1 fsdp rank does."""
    batches = _sft_chat_batches(tiny_hf_checkpoint, tmp_path, 2)
    lens = [sum(m) for m in batches[0].loss_masks]
    assert len(set(lens)) > 1 and len(set(batches[0].response_lengths)) > 1  # ranks hold unequal token counts
    sft = dict(loss_type="sft_loss", calculate_per_token_loss=True, rollout_batch_size=4, n_samples_per_prompt=1,
               global_batch_size=4, micro_batch_size=1, lr=1e-2)  # fmt: skip
    runs = {"fsdp1": (1, sft), "fsdp2": (2, sft), "megatron1": (1, {**sft, "train_backend": "megatron"})}
    res = _train_runs(tiny_hf_checkpoint, tmp_path, runs, batches)
    _assert_data_parallel_equals_single({1: res["fsdp1"], 2: res["fsdp2"]}, "policy/")
    (fsdp,), (mg,) = res["fsdp1"], res["megatron1"]
    init = load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))
    assert sorted(fsdp) == sorted(mg) == sorted(f"policy/{k}" for k in init)
    for k, v in mg.items():  # float32 reassociation apart (as the prompt/response SFT comparison)
        assert (v - fsdp[k]).abs().max() < 1e-4, k
    moved = [k for k in init if (fsdp[f"policy/{k}"] - init[k]).abs().max() > 1e-3]
    assert len(moved) >= len(init) // 2  # the steps trained: agreement is not the trivial kind
