"""Megatron checkpoints reshard: a run saved at one layout resumes at another to the same next step.

Run A trains rollout 0 at layout X, saves (torch_dist weights + the optimizer's state as sharded
tensors, training/megatron_checkpoint.py), and trains rollout 1. Run B starts at layout Y from A's
checkpoint and trains rollout 1: its loss, grad norm and updated weights equal A's (A saved
with --async-save at TP 2: torch_dist's async save, finished by the next train call). Under --bf16 the
fp32 main parameters come back too (resumed from the bf16 weights alone, the step would differ). Both runs also
score a reference model from --ref-load, a torch_dist conversion of the checkpoint written at TP 2,
so the KL term of rollout 1 checks that --ref-load reads at any layout.

AdamW with eps 1e-6: at the default 1e-8 a gradient element near zero turns the 1e-9 rounding
difference of two layouts into a ~1e-5 weight difference (test_megatron_layouts.py's docstring).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from loop_helpers import random_train_batch, run_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

TOL = 1e-5
METRICS = ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm")
LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    # --async-save: torch_dist's async save, planned at the save point, finalized by the next train call
    "tp2_async_save": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, async_save=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "tp2_bf16": (2, dict(tensor_model_parallel_size=2, bf16=True, accumulate_allreduce_grads_in_fp32=True)),
    "cp2": (2, dict(context_parallel_size=2)),
    # megatron-core's DistributedOptimizer: its own sharded state (fully reshardable: saved over DP2,
    # read at DP1). (TP2 --bf16 with it, saved and resumed, gives the same step too: run by hand, left
    # out of make test for its CPU cost)
    "dp2_distopt": (2, dict(use_distributed_optimizer=True)),
    "tp2_distopt": (2, dict(tensor_model_parallel_size=2, use_distributed_optimizer=True)),
}


def _cfg(ckpt: str, save: str, ref: str, world: int, **kw):
    from miles_platform.config import RunConfig

    return RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                     global_batch_size=4, micro_batch_size=1, lr=1e-3, adam_eps=1e-6, num_rollout=2,
                     use_kl_loss=True, kl_loss_coef=0.5, ref_load=ref, save=save, actor_num_gpus_per_node=world,
                     **kw).validate()  # fmt: skip


def _worker(
    rank: int, world: int, port: int, ckpt: str, ref: str, save: str, out: str, resume: bool, kw: dict
):
    torch.set_num_threads(1)
    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor

    try:
        actor = TrainerActor(_cfg(ckpt, save, ref, world, **kw), rank, world, f"tcp://127.0.0.1:{port}")
        if resume:
            assert actor.load()["rollout_id"] == 0
        else:
            actor.train(0, random_train_batch(0))
            actor.save(0)
        metrics = actor.train(1, random_train_batch(1))
        weights = actor.get_hf_weights()
        if weights:
            save_file(weights, f"{out}/rank{rank}.safetensors")
            Path(f"{out}/rank{rank}.json").write_text(json.dumps(metrics))
    except Exception:
        Path(f"{out}/rank{rank}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


def _run(layout: str, ckpt: str, ref: str, save: Path, out: Path, resume: bool):
    world, kw = LAYOUTS[layout]
    args = (world, free_port(), ckpt, ref, str(save), str(out), resume, kw)
    run_ranks(_worker, args, world, out)
    return json.loads((out / "rank0.json").read_text()), load_file(out / "rank0.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_checkpoint, tmp_path_factory):
    from miles_platform.models.tiny import save_layout_checkpoint
    from miles_platform.training import megatron_shims
    from miles_platform.weights.conversion import hf_to_torch_dist

    root = tmp_path_factory.mktemp("resume")
    ckpt = save_layout_checkpoint(tiny_hf_checkpoint, root / "l4")
    # an earlier test of this pytest worker may have left its one-rank megatron group behind (a
    # TrainerActor built in-process); the conversion needs a process without one
    megatron_shims.destroy_process_group()
    hf_to_torch_dist(ckpt, root / "ref_tp2", tensor_model_parallel_size=2)
    return ckpt, str(root / "ref_tp2")


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ("tp2_async_save", "tp1"),
        ("pp2", "tp2"),
        ("tp2_bf16", "tp2_bf16"),
        ("tp1", "cp2"),
        ("dp2_distopt", "tp2_distopt"),
    ],
)
def test_checkpoint_saved_at_one_layout_resumes_at_another(checkpoints, tmp_path, saved, resumed):
    ckpt, ref = checkpoints
    save = tmp_path / "ckpt"
    want = _run(saved, ckpt, ref, save, tmp_path / "a", resume=False)
    assert (save / "iter_0000000" / "optimizer" / ".metadata").exists()  # the sharded optimizer state
    got = _run(resumed, ckpt, ref, save, tmp_path / "b", resume=True)
    assert abs(want[0]["train/kl_loss"]) > 1e-3  # the policy left the reference: --ref-load is read
    for key in METRICS:
        assert abs(got[0][key] - want[0][key]) <= TOL, (
            f"{key}: {got[0][key]} vs {want[0][key]} before the save"
        )
    for k, v in want[1].items():
        diff = (got[1][k] - v).abs().max().item()
        assert diff <= TOL, f"{k}: resumed step differs by {diff:.3g}"
