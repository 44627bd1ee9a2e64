"""What the policy trainer (`TrainerActor`) puts in its checkpoints and takes back on resume, in
training/checkpoint.py's layout: each rank's model shard, optimizer and RNG files, rank 0's
trainer_state.json after them (schedule, step, Python RNG, the loop's extra state).

Miles' checkpoint flags:
  --no-save-optim   no optimizer tensors and no scheduler state (trainer_state says so); resuming such
                    a checkpoint needs --no-load-optim, the schedule then continues at the saved step
  --no-load-optim   resume with a fresh optimizer (AdamW moments from zero), said on stderr; a saved
                    scheduler state is still restored (Miles' FSDP backend does the same)
  --no-load-rng     resume without the saved torch / numpy / Python RNG states (the seeds' instead)
  --async-save      the files are written on a background thread from copies taken at the save point
                    (Checkpointer.save_async; megatron: torch_dist's own async save, its plan at the
                    save point, its metadata when finished); the next save or train call finishes it first

and --ci-test's per-layer weight hashes (training/ci_checks.py): --ci-save-model-hash writes each rank's
model_hash_tp*_pp*_dp*_cp0.json into the iter dir, --ci-check-model-hash compares a loaded model with it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file, save_file

from miles_platform.errors import CheckpointError
from miles_platform.run_types import CITestFailure
from miles_platform.training import ci_checks
from miles_platform.training.checkpoint import (
    TRAINER_STATE,
    Checkpointer,
    iter_dir,
    load_optimizer_tensors,
    python_rng_state,
    rank_file,
    restore_python_rng,
    restore_rng_tensors,
    rng_tensors,
)

if TYPE_CHECKING:
    from miles_platform.training.actor import TrainerActor


def _say(actor: TrainerActor, line: str) -> None:
    if actor.rank == 0:
        print(line, file=sys.stderr, flush=True)


def _trainer_state(actor: TrainerActor, rollout_id: int, extra_state: dict | None) -> dict:
    state = {"rollout_id": rollout_id, "global_step": actor.global_step, "world_size": actor.world_size,
             "train_backend": actor.cfg.train_backend, "python_random": python_rng_state(),
             "optimizer_saved": not actor.cfg.no_save_optim, **(extra_state or {})}  # fmt: skip
    if not actor.cfg.no_save_optim:  # Miles' --no-save-optim skips the scheduler too
        state["scheduler"] = actor.sched.state_dict()
    return state


def _write_state(d: str, state: dict) -> None:
    Path(d, TRAINER_STATE).write_text(json.dumps(state, indent=1, default=str))


def _parallel_ranks(actor: TrainerActor) -> tuple[int, int, int]:
    """(tensor, pipeline, data) parallel rank: a model hash file's name."""
    if actor.cfg.train_backend == "megatron" and actor.world_size > 1:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), actor.dp_rank
    return 0, 0, actor.dp_rank


def _model_hashes(actor: TrainerActor) -> dict[str, str] | None:
    """--ci-save-model-hash / --ci-check-model-hash: this rank's per-layer hashes (else None)."""
    cfg = actor.cfg
    if not (cfg.ci_test and (cfg.ci_save_model_hash or cfg.ci_check_model_hash)):
        return None
    return ci_checks.model_hashes_by_layer(getattr(actor.backend, "chunks", [actor.model]))


def _write_hashes(actor: TrainerActor, d: str, hashes: dict[str, str] | None) -> None:
    if hashes is not None and actor.cfg.ci_save_model_hash:
        Path(ci_checks.model_hash_file(d, _parallel_ranks(actor))).write_text(json.dumps(hashes, indent=2))


def finish_pending(actor: TrainerActor) -> str | None:
    """Complete an --async-save in flight (every rank calls it). Returns its iter dir, or None."""
    job, actor.pending_save = getattr(actor, "pending_save", None), None
    return None if job is None else job.finish()


def save(actor: TrainerActor, rollout_id: int, extra_state: dict | None = None, sync: bool = False) -> str:
    """iter_NNNNNNN written atomically, then latest_checkpointed_iteration.txt. With --async-save
    (and not `sync`: a --save-trigger-sentinel save, the run's last) the writes go on in the
    background and the iter dir returned appears once they are done."""
    cfg = actor.cfg
    actor.row_writer.flush()  # the rows of the rollouts it holds are in before it says so
    finish_pending(actor)  # one save in flight at a time (megatron finalizes the previous one too)
    ckpt = Checkpointer(cfg.save, actor.rank, actor.world_size)
    if cfg.async_save and not sync:
        # megatron: torch_dist's own async save of the weights and the optimizer (its plan now)
        staged = actor.backend.async_checkpoint(None if cfg.no_save_optim else actor.opt)
        opt = None
        if staged is not None:
            write_model = staged.write
        else:
            write_model = actor.backend.snapshot_model()  # the gathers now; copies the steps do not touch
            if not cfg.no_save_optim:
                opt = {k: v.clone() for k, v in actor._optimizer_tensors().items()}
        rng, state = rng_tensors(), _trainer_state(actor, rollout_id, extra_state)
        hashes = _model_hashes(actor)  # the weights at the save point

        def write_copies(d: str) -> None:
            write_model(d)
            _write_hashes(actor, d, hashes)
            if opt is not None:
                save_file(opt, os.path.join(d, rank_file("optimizer", actor.rank)))
            save_file(rng, os.path.join(d, rank_file("rng", actor.rank)))

        actor.pending_save = ckpt.save_async(
            rollout_id, write_copies, lambda d: _write_state(d, state),
            prepare=staged and staged.prepare, finalize=staged and staged.finalize,
        )  # fmt: skip
        return iter_dir(cfg.save, rollout_id)

    def write_rank(d: str) -> None:
        actor.backend.save_model(d)
        _write_hashes(actor, d, _model_hashes(actor))
        # megatron: resharded like the weights (backend.save_optimizer writes its own files)
        if not cfg.no_save_optim and not actor.backend.save_optimizer(actor.opt, d):
            save_file(actor._optimizer_tensors(), os.path.join(d, rank_file("optimizer", actor.rank)))
        save_file(rng_tensors(), os.path.join(d, rank_file("rng", actor.rank)))
        if actor.critic is not None:
            actor.critic.save(d, actor.rank, with_optimizer=not cfg.no_save_optim)

    return ckpt.save(
        rollout_id, write_rank, lambda d: _write_state(d, _trainer_state(actor, rollout_id, extra_state))
    )


def load(actor: TrainerActor) -> dict | None:
    """Resume from --load (or --save) if a checkpoint exists. Returns trainer_state or None."""
    cfg = actor.cfg
    with Checkpointer(cfg.load or cfg.save, actor.rank, actor.world_size).open_latest() as d:
        if d is None and cfg.ci_test and cfg.ci_check_model_hash:
            raise CITestFailure(f"--ci-check-model-hash: no checkpoint in {cfg.load or cfg.save} to check")
        return None if d is None else _load_checkpoint(actor, d)


def _load_checkpoint(actor: TrainerActor, d: str) -> dict:
    cfg = actor.cfg
    state = json.loads(Path(d, TRAINER_STATE).read_text())
    resharded = state.get("world_size", 1) != actor.world_size
    if resharded and (not actor.backend.reshards_checkpoints or actor.critic is not None):
        raise ValueError(
            f"{d}: saved with world size {state['world_size']}, resuming with {actor.world_size}"
        )
    saved_optim = state.get("optimizer_saved", True)
    if not saved_optim and not cfg.no_load_optim:
        raise CheckpointError(
            f"{d}: saved with --no-save-optim, so it holds no optimizer state; resume with --no-load-optim "
            "to start the optimizer fresh (AdamW moments from zero) from these weights"
        )
    actor.backend.load_model(d)
    if actor.critic is not None:
        actor.critic.load(d, actor.rank, with_optimizer=not cfg.no_load_optim)
    if cfg.no_load_optim:
        _say(
            actor,
            f"[resume] --no-load-optim: {d}: weights restored, the optimizer starts fresh (AdamW moments from zero)",
        )
    elif not actor.backend.load_optimizer(actor.opt, d):  # megatron: resharded like the weights
        tensors = load_file(os.path.join(d, rank_file("optimizer", actor.rank)))
        load_optimizer_tensors(actor.opt, actor.backend.named_parameters(), tensors)
    if cfg.ci_test and cfg.ci_check_model_hash:  # the weights as loaded, before any step
        ci_checks.check_model_hashes(
            ci_checks.model_hash_file(d, _parallel_ranks(actor)), _model_hashes(actor)
        )
    actor.global_step = state["global_step"]
    if "scheduler" in state:
        actor.sched.load_state_dict(state["scheduler"])
    else:  # --no-save-optim: the schedule at the saved step
        actor.sched.set_step(actor.global_step)
    if cfg.no_load_rng:
        _say(actor, f"[resume] --no-load-rng: {d}: RNG states not restored (the seeds' instead)")
        return state
    rng_file = os.path.join(d, rank_file("rng", actor.rank))
    if os.path.exists(rng_file) or not resharded:  # another layout: this rank may have no saved RNG
        restore_rng_tensors(load_file(rng_file))
    restore_python_rng(state["python_random"])
    return state
