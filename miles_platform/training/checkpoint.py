"""The trainers' checkpointer (the policy trainer, its critic, the diffusion trainer), Miles' layout:
`<save>/iter_<rollout_id:07d>/` and `<save>/latest_checkpointed_iteration.txt` naming the newest
complete one. `<save>` may be an object-store URI: each rank stages its files locally and uploads
them, the marker file last, then the pointer (one object).

A save is atomic: every rank writes its files into one staging dir (`.iter_<id>.tmp-<hex>`, a name
`run_lifecycle.remove_dead_writers_tmp` removes after a crash), rank 0 writes the marker (the
trainer's state file) after every rank's files, renames the dir into place and replaces the pointer
last. A trainer says what goes in (`write_rank`, `write_marker`); the file formats are its own.
Also here: optimizer tensors by parameter name and the RNG states a resume restores.

The layout helpers are torch-free (the driver reads the pointer before Ray starts)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from miles_platform.errors import CheckpointError
from miles_platform.store import remote
from miles_platform.store.atomic import fsync_tree, replace_dir, write_atomic

if TYPE_CHECKING:
    import torch

LATEST = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"  # the policy trainer's marker: written after every rank's files


def iter_dir(save: str, rollout_id: int) -> str:
    return os.path.join(save, f"iter_{rollout_id:07d}")  # "/"-joined: a URI stays one too


def read_latest(save: str | None) -> int | None:
    if not save:
        return None
    if remote.is_remote(save):
        p, raw = remote.join(save, LATEST), remote.read_bytes(remote.join(save, LATEST))
        if raw is None:
            return None
        text = raw.decode(errors="replace").strip()
    else:
        p = Path(save) / LATEST
        if not p.exists():
            return None
        text = p.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{p}: expected an iteration number, got {text!r}")
    return int(text)


def prune_checkpoints(save: str, newest: int, retain_interval: int) -> list[str]:
    """megatron's --save-retain-interval: once `newest` is saved, delete every other iter dir under
    `save` whose rollout id is not a multiple of `retain_interval` (the newest always stays; the
    pointer already names it). Returns the deleted dirs."""
    gone = []
    for name in remote.listdir(save) if remote.is_remote(save) else os.listdir(save):
        name = name.rstrip("/").rsplit("/", 1)[-1]
        if not (name.startswith("iter_") and name[5:].isdigit()):
            continue
        it = int(name[5:])
        if it != newest and it % retain_interval:
            path = iter_dir(save, it)
            if remote.is_remote(save):
                remote.remove(path)
            else:
                shutil.rmtree(path)
            gone.append(path)
    return gone


def rank_file(stem: str, rank: int) -> str:
    """A rank's own file in an iter dir (`optimizer_rank000.safetensors`); `open_latest` downloads
    only this rank's of them."""
    return f"{stem}_rank{rank:03d}.safetensors"


class Checkpointer:
    """One trainer rank's view of a checkpoint root (`--save` to write, `--load or --save` to read).
    With `world_size` > 1 every rank calls `save` (it holds collectives: a barrier, and the staging
    name is rank 0's)."""

    def __init__(self, root: str | None, rank: int = 0, world_size: int = 1, marker: str = TRAINER_STATE):
        self.root, self.rank, self.world_size, self.marker = root, rank, world_size, marker

    def save(
        self, rollout_id: int, write_rank: Callable[[str], None], write_marker: Callable[[str], None]
    ) -> str:
        """`write_rank(dir)`: this rank's files; `write_marker(dir)`: rank 0's marker file (named
        `self.marker`), once every rank's files are written. Returns the iter dir."""
        final = iter_dir(self.root, rollout_id)
        if remote.is_remote(self.root):
            with remote.staging_dir() as tmp:
                self._write(tmp, write_rank, write_marker)
                remote.upload_dir(tmp, final, exclude=[self.marker])
                self._barrier()
                if self.rank == 0:  # the iter dir's marker once every rank's files are up, then the pointer
                    remote.upload_dir(tmp, final, only=[self.marker])
                    remote.write_bytes(remote.join(self.root, LATEST), str(rollout_id))
            return final
        tmp = os.path.join(self.root, f".iter_{rollout_id:07d}.tmp-{uuid.uuid4().hex[:6]}")
        if self.world_size > 1:
            tmp = self._broadcast_str(tmp)
        self._write(tmp, write_rank, write_marker)
        if self.rank == 0:
            fsync_tree(tmp)
            replace_dir(tmp, final)
            write_atomic(os.path.join(self.root, LATEST), str(rollout_id))  # the pointer, last
        self._barrier()
        return final

    def save_async(
        self,
        rollout_id: int,
        write_rank: Callable[[str], None],
        write_marker: Callable[[str], None],
        prepare: Callable[[str], None] | None = None,
        finalize: Callable[[str], None] | None = None,
    ) -> AsyncSave:
        """`save` with the file writes on a background thread (--async-save; a local root). The
        writers must only write files (their tensors already copied). `prepare(dir)` runs first, in
        the caller's thread on every rank (collectives allowed: megatron's save plan); `finalize(dir)`
        in `AsyncSave.finish`, the same way, once this rank's files are written (megatron's
        metadata). Alone and without `finalize`, the thread also writes the marker, renames the dir
        and moves the pointer; otherwise `AsyncSave.finish` does (every rank, at the next save or
        train call). Until then the pointer names the previous checkpoint, so a kill -9 mid-save
        leaves that one to resume from."""
        final = iter_dir(self.root, rollout_id)
        tmp = os.path.join(self.root, f".iter_{rollout_id:07d}.tmp-{uuid.uuid4().hex[:6]}")
        if self.world_size > 1:
            tmp = self._broadcast_str(tmp)
        job = AsyncSave(self, rollout_id, tmp, final, write_marker, finalize)
        os.makedirs(tmp, exist_ok=True)
        if prepare is not None:
            prepare(tmp)

        def work() -> None:
            try:
                write_rank(tmp)
                if self.world_size == 1 and finalize is None:
                    job.publish()
            except BaseException as e:  # re-raised by finish() in the trainer's thread
                job.error = e

        job.thread = threading.Thread(target=work, name=f"async-save-{rollout_id}")
        job.thread.start()
        return job

    def _write(
        self, tmp: str, write_rank: Callable[[str], None], write_marker: Callable[[str], None]
    ) -> None:
        os.makedirs(tmp, exist_ok=True)
        write_rank(tmp)
        self._barrier()
        if self.rank == 0:
            write_marker(tmp)

    @contextlib.contextmanager
    def open_latest(self) -> Iterator[str | None]:
        """The newest complete iter dir as a local dir (an object-store one: this rank's files and
        the shared ones, downloaded), or None when the root has no checkpoint."""
        it = read_latest(self.root)
        if it is None:
            yield None
            return
        mine = f"_rank{self.rank:03d}."
        with remote.local_dir(
            iter_dir(self.root, it), want=lambda rel: "_rank" not in rel or mine in rel
        ) as d:
            yield d

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _broadcast_str(self, s: str) -> str:
        import torch.distributed as dist

        obj = [s]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]


class AsyncSave:
    """A checkpoint being written in the background (`Checkpointer.save_async`)."""

    def __init__(
        self, ckpt: Checkpointer, rollout_id: int, tmp: str, final: str, write_marker, finalize=None
    ):
        self.ckpt, self.rollout_id, self.tmp, self.final = ckpt, rollout_id, tmp, final
        self.write_marker, self.finalize, self.thread, self.error = write_marker, finalize, None, None

    def publish(self) -> None:
        """Rank 0: the marker after every rank's files, the rename, the pointer last."""
        if self.ckpt.rank == 0:
            self.write_marker(self.tmp)
            fsync_tree(self.tmp)
            replace_dir(self.tmp, self.final)
            write_atomic(os.path.join(self.ckpt.root, LATEST), str(self.rollout_id))

    def finish(self) -> str:
        """Wait for this rank's files; with several ranks or a `finalize`, every rank calls it (a
        barrier), finalizes, and rank 0 publishes. Returns the iter dir."""
        self.thread.join()
        if self.error is not None:
            raise CheckpointError(f"--async-save of {self.final} failed: {self.error!r}") from self.error
        if self.finalize is not None:
            self.finalize(self.tmp)
        if self.ckpt.world_size > 1 or self.finalize is not None:
            self.ckpt._barrier()
            self.publish()
            self.ckpt._barrier()
        return self.final


# ---------------------------------------------------------------------- optimizer tensors
def optimizer_tensors(
    opt,
    named_parameters: Iterable,
    *,
    sep: str = "::",
    keys: tuple[str, ...] | None = None,
    full: bool = False,
) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state as `<param name><sep><key>` (`keys`: only those).
    A sharded (DTensor) state is saved as this rank's shard, or gathered whole with `full`."""
    import torch

    names = {id(p): n for n, p in named_parameters}
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if not torch.is_tensor(v) or (keys is not None and k not in keys):
                continue
            if full and hasattr(v, "full_tensor"):
                v = v.full_tensor()
            elif hasattr(v, "to_local"):
                v = v.to_local()
            out[f"{names[id(p)]}{sep}{k}"] = v.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(
    opt, named_parameters: Iterable, tensors: dict[str, torch.Tensor], *, sep: str = "::", full: bool = False
) -> None:
    """`optimizer_tensors`' output back into the optimizer's state (`full`: saved gathered, so a
    sharded parameter's state is scattered to its placement)."""
    by_name = dict(named_parameters)
    for key, v in tensors.items():
        name, k = key.rsplit(sep, 1)
        p = by_name[name]
        v = v.to(p.dtype) if full else v
        st = opt.state.setdefault(p, {})
        cur = st.get(k)
        if cur is not None and hasattr(cur, "to_local") and not full:
            cur.to_local().copy_(v)
        elif hasattr(p, "to_local") and k != "step":
            from torch.distributed.tensor import DTensor, distribute_tensor

            if full:
                st[k] = distribute_tensor(v, p.device_mesh, p.placements)
            else:
                st[k] = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements)
        else:  # AdamW keeps its step count on the host (not capturable), the moments beside p
            st[k] = v.clone() if k == "step" else v.to(p.device, copy=True)


# ---------------------------------------------------------------------- RNG
def rng_tensors() -> dict[str, torch.Tensor]:
    """torch's and numpy's generator states, as a rank's `rng` file holds them."""
    import numpy as np
    import torch

    s = np.random.get_state()
    state = [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]
    return {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(np.frombuffer(json.dumps(state).encode(), dtype=np.uint8).copy()),
    }


def restore_rng_tensors(rng: dict[str, torch.Tensor]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(rng["torch"])
    s = json.loads(bytes(rng["numpy"].numpy()).decode())
    np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), s[2], s[3], s[4]))


def python_rng_state() -> list:
    """Python's `random` state, JSON-able (a trainer state file holds it)."""
    v, internal, gauss = random.getstate()
    return [v, list(internal), gauss]


def restore_python_rng(state: list) -> None:
    v, internal, gauss = state
    random.setstate((v, tuple(internal), gauss))


def check_finite_weights(params, model: torch.nn.Module, hf_checkpoint: str) -> None:
    """A base checkpoint with NaN / inf weights trains nothing (every step is skipped as non-finite,
    then the run stops): refuse it at once, naming the tensor (each rank checks its own shard)."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point() and not bool(torch.isfinite(local.detach()).all()):
            bad = int((~torch.isfinite(local.detach())).sum())
            raise CheckpointError(
                f"--hf-checkpoint {hf_checkpoint}: {names.get(id(p), 'a parameter')} has {bad} NaN / inf "
                "value(s); a model that is not finite cannot be trained"
            )
