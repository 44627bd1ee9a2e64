"""Data parallelism: 2 gloo ranks train exactly like 1 rank on the same global batch.

Each case trains a TrainerActor for 3 optimizer steps (global batch 4: 2 samples per rank on 2
ranks, 4 on 1 rank) in spawned processes, the 1-rank and 2-rank runs side by side, and compares
the final weights: identical across the 2 ranks and equal to the 1-rank run to fp32 tolerance.
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


def _worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from miles_platform.training.actor import TrainerActor

    path = Path(out, f"rank{rank}")
    try:
        actor = TrainerActor(_cfg(ckpt, **overrides), rank, world, f"tcp://127.0.0.1:{port}")
        for r in range(STEPS):
            actor.train(r, _batch(r))
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


def _train(ckpt: str, tmp_path: Path, **overrides) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{world size: [final tensors of each rank]} for world sizes 1 and 2, run concurrently."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}"
        out.mkdir()
        args = (world, free_port(), ckpt, str(out), overrides)
        runs[world] = (out, spawn_ranks(_worker, args, world, join=False))
    result = {}
    for world, (out, ctx) in runs.items():
        while not ctx.join():
            pass
        errors = [p.read_text() for p in sorted(out.glob("*.error"))]
        assert not errors, errors[0]
        result[world] = [load_file(out / f"rank{r}.safetensors") for r in range(world)]
    return result


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
