"""The `train_samples` table: one row per trained sample, what the loss saw per response token.

    advantage, log_probs (the training forward's), rollout_log_probs, ratio, clipped, ref_kl, loss_mask
    + rollout_id, index (join with `rollouts`), version, step, micro_batch, rank

The values come from the tensors of each micro-batch's loss call, no extra forward: the loss's
inputs as it got them, and ratio / clip flags / reference KL recomputed from them on detached
tensors with the loss hub's own functions (`compute_policy_loss`, `compute_approx_kl`), so they are
the values the loss used. One host copy per micro-batch. Every rank keeps the rows of its own
samples and appends them at the end of `train` as one part file (store/tables.append_rows: atomic),
so the rows of every data-parallel rank land; under tensor / pipeline / context parallelism one
rank of each data-parallel group writes (`ModelBackend.writes_sample_rows`).

Which samples get a row (`--save-train-samples`): every rank decides the same set from the whole
rollout it holds (batch positions, no communication). `--save-debug-train-data` writes each rank's
rows of every sample to its own Parquet file as well.

A resume abandons the rows of rollouts past its checkpoint like metrics (store/run_events.py
KEYED_BY): the catalog's `status` column says `abandoned` for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from miles_platform.config import RunConfig
from miles_platform.config.outputs import TRAIN_SAMPLES_AUTO_BYTES, train_samples_keep
from miles_platform.training import loss as loss_hub

if TYPE_CHECKING:
    from miles_platform.store.tables import BufferedParts

# per-token columns (clipped is a float here, a bool in the row)
TOKEN_COLUMNS = ("advantage", "log_probs", "rollout_log_probs", "ratio", "clipped", "ref_kl", "loss_mask")
# --save-train-samples auto's estimate of a row's Parquet bytes: 8 per value of the 7 per-token
# columns, plus the fixed columns (an upper bound: Parquet compresses)
BYTES_PER_TOKEN, BYTES_PER_ROW = 8 * len(TOKEN_COLUMNS), 128


@dataclass(frozen=True)
class TrainSamplesTarget:
    """What the loop hands `TrainerActor.train` to record the rollout's rows: the policy version its
    optimizer steps make (None: the run makes no versions, e.g. --debug-train-only). `background`:
    the rows are made and written on the trainer's row writer thread (`TrainerActor.row_writer`),
    not before `train` returns."""

    version: int | None
    background: bool = False


def kept_positions(setting: str | int, batch, group_size: int) -> range:
    """Batch positions whose rows the table keeps (the same on every rank): all, none, the first N,
    or auto: the first whole groups of `group_size` whose estimated bytes stay under the budget,
    at least one group."""
    keep, n = train_samples_keep(setting), len(batch)
    if keep == "all":
        return range(n)
    if keep == "none":
        return range(0)
    if keep != "auto":
        return range(min(keep, n))
    total, end = 0, 0
    for start in range(0, n, max(group_size, 1)):
        group = range(start, min(start + max(group_size, 1), n))
        total += sum(BYTES_PER_ROW + BYTES_PER_TOKEN * batch.response_lengths[i] for i in group)
        if end and total > TRAIN_SAMPLES_AUTO_BYTES:
            break
        end = group.stop
    return range(end)


@torch.no_grad()
def token_columns(cfg: RunConfig, mb_batch: dict[str, Any], log_probs: list[torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor | None], list[bool]]:  # fmt: skip
    """Per column of TOKEN_COLUMNS, one 1-D tensor over the samples' response tokens laid end to end
    (None: the column does not apply), and per sample whether `rollout_log_probs` covers its
    tokens: the loss's inputs and what it computed from them. Each op once over the micro-batch's
    tokens (an op per sample, ~20 us each, made it 3 ms a 128-sample step)."""
    sizes = [m.numel() for m in mb_batch["loss_masks"]]
    masks = torch.cat(mb_batch["loss_masks"]).float()
    lps = torch.cat(log_probs).float()
    adv = torch.cat(mb_batch["advantages"]).float()
    has_rollout = [r.numel() == n for r, n in zip(mb_batch["rollout_log_probs"], sizes, strict=True)]
    rollout = torch.cat([r if ok else masks.new_zeros(n) for r, n, ok
                         in zip(mb_batch["rollout_log_probs"], sizes, has_rollout, strict=True)]).float()  # fmt: skip
    cols: dict[str, torch.Tensor | None] = {"advantage": adv, "log_probs": lps, "loss_mask": masks, "ratio": None,
                                            "clipped": None, "ref_kl": None, "rollout_log_probs": rollout}  # fmt: skip
    if cfg.loss_type == "policy_loss":  # the PPO clip of policy_loss_function, on the same inputs
        split = lambda t: list(torch.split(t, sizes))  # noqa: E731
        old = split(rollout) if cfg.use_rollout_logprobs else mb_batch["old_log_probs"]
        _, clipped, ppo_kl = loss_hub.compute_policy_loss(
            split(lps), old, split(adv), split(masks), cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c,
            sequence_level=cfg.advantage_estimator == "gspo",
        )  # fmt: skip
        cols["ratio"] = loss_hub.safe_log_ratio(-torch.cat(ppo_kl)).exp()
        cols["clipped"] = torch.cat(clipped)
    ref = mb_batch.get("ref_log_probs")
    if ref is not None:
        cols["ref_kl"] = _ref_kl(cfg, lps, torch.cat(list(ref)), masks)
    return cols, has_rollout


def _ref_kl(cfg: RunConfig, lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi || ref) per token as add_regularizers estimates it (without --use-unbiased-kl's weight)."""
    at = loss_hub.at_active
    kl = loss_hub.compute_approx_kl(at(lp, mask), at(ref.detach().float(), mask), cfg.kl_loss_type)
    return at(kl, mask, finite=True)


def micro_batch_rows(cfg: RunConfig, mb_batch: dict[str, Any], log_probs: list[torch.Tensor],
                     keys: list[dict[str, Any] | None]) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of a micro-batch's samples whose `keys` (rollout_id, index, version, step, ...) are
    given (None: no row). Every per-token value crosses to the host in one copy."""
    want = [j for j, k in enumerate(keys) if k is not None]
    if not want:
        return []
    return _rows([keys[j] for j in want], *_host_columns(cfg, mb_batch, log_probs, want))


def _host_columns(cfg: RunConfig, mb_batch: dict[str, Any], log_probs: list[torch.Tensor], want: list[int]):
    """The tensor half of the rows of the micro-batch's samples `want` (positions in it): (tokens per
    sample, a host [len(TOKEN_COLUMNS), tokens] tensor of the columns laid end to end, the columns
    that do not apply, per sample whether `rollout_log_probs` covers its tokens)."""
    pick = {name: [mb_batch[name][j] for j in want] for name in ("advantages", "old_log_probs", "rollout_log_probs", "loss_masks")}  # fmt: skip
    ref = mb_batch.get("ref_log_probs")
    pick["ref_log_probs"] = [ref[j] for j in want] if ref is not None else None
    cols, has_rollout = token_columns(cfg, pick, [log_probs[j] for j in want])
    sizes = [m.numel() for m in pick["loss_masks"]]
    zeros = torch.zeros_like(cols["loss_mask"])
    flat = torch.stack([zeros if cols[c] is None else cols[c] for c in TOKEN_COLUMNS]).cpu()
    return sizes, flat, {c for c in TOKEN_COLUMNS if cols[c] is None}, has_rollout


def _rows(keys: list[dict[str, Any]], sizes: list[int], flat: torch.Tensor, absent: set[str],
          has_rollout: list[bool]) -> list[dict[str, Any]]:  # fmt: skip
    """The Python half (any thread): one row dict per sample of `_host_columns`' values."""
    values = flat.tolist()
    rows, at = [], 0
    for r, key in enumerate(keys):
        row = dict(key)
        for c, column in zip(TOKEN_COLUMNS, values, strict=True):
            v = (
                None
                if c in absent or (c == "rollout_log_probs" and not has_rollout[r])
                else column[at : at + sizes[r]]
            )
            if v is not None and c == "clipped":
                v = [x > 0 for x in v]
            elif v is not None and c == "loss_mask":
                v = [int(x) for x in v]
            row[c] = v
        rows.append(row)
        at += sizes[r]
    return rows


class SampleRows:
    """One `train` call's rows on one rank: `add` per micro-batch, `flush` at the end."""

    def __init__(self, cfg: RunConfig, batch, rollout_id: int, target: TrainSamplesTarget | None, rank: int):
        self.cfg, self.rollout_id, self.target, self.rank = cfg, rollout_id, target, rank
        self.indices = batch.sample_indices or list(range(len(batch)))
        table = (
            kept_positions(cfg.save_train_samples, batch, cfg.n_samples_per_prompt) if target else range(0)
        )
        self.table = set(table)
        self.dump = bool(cfg.save_debug_train_data)  # every sample of the rank
        self.pending: list = []  # per micro-batch: (its rows' keys, `_host_columns`)
        self.kept: list[bool] = []  # each row's: in the table (else only in the debug file)

    @classmethod
    def start(cls, cfg: RunConfig, batch, rollout_id: int, target: TrainSamplesTarget | None, rank: int,
              backend) -> SampleRows | None:  # fmt: skip
        """None when this rank records nothing: no target and no dump, nothing kept, or another rank
        of its data-parallel group writes (`backend.writes_sample_rows()`)."""
        if (target is None and not cfg.save_debug_train_data) or not backend.writes_sample_rows():
            return None
        rows = cls(cfg, batch, rollout_id, target, rank)
        return rows if rows.table or rows.dump else None

    def add(self, mb: list[int], micro_batch: int, step: int, mb_batch: dict[str, Any], log_probs) -> None:
        """The micro-batch's rows: their values on the host now, the row dicts at `flush` (on the
        writer's thread when it has one)."""
        version = self.target.version if self.target else None
        want = [j for j, i in enumerate(mb) if self.dump or i in self.table]
        if not want:
            return
        keys = [{"rollout_id": self.rollout_id, "index": self.indices[mb[j]], "version": version, "step": step,
                 "micro_batch": micro_batch, "rank": self.rank} for j in want]  # fmt: skip
        self.pending.append((keys, _host_columns(self.cfg, mb_batch, log_probs, want)))
        self.kept += [mb[j] in self.table for j in want]

    def flush(self, writer: BufferedParts | None = None) -> None:
        """The kept rows to the table (one part file), every row to the debug file: now, or on
        `writer`'s thread."""
        from miles_platform.store.paths import StoragePaths
        from miles_platform.store.tables import append_rows

        pending, kept, dump = self.pending, self.kept, self.dump
        self.pending, self.kept = [], []

        def write(append) -> None:
            rows = [row for keys, cols in pending for row in _rows(keys, *cols)]
            table = [r for r, k in zip(rows, kept, strict=True) if k]
            if table:
                append("train_samples", self.cfg.run_name, table)
            if dump:
                self._write_dump(rows)

        if writer is None:
            write(partial(append_rows, StoragePaths(self.cfg.storage_root)))
        elif pending:
            writer.call(lambda: write(writer.append))

    def _write_dump(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        from miles_platform.store.remote import is_remote
        from miles_platform.store.schemas import TABLE_SCHEMAS
        from miles_platform.store.shards import write_parquet_atomic

        path = self.cfg.save_debug_train_data.format(rollout_id=self.rollout_id, rank=self.rank)
        if not is_remote(path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        now = datetime.now(UTC)
        rows = [{**r, "run": self.cfg.run_name, "created_at": now} for r in rows]
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=TABLE_SCHEMAS["train_samples"]), path)
