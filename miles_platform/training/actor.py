"""The trainer: one instance per rank (a Ray actor in the loop), backend-independent.

Owns what every backend shares: old/ref log-prob recomputation, the loss hub, micro-batching
and gradient accumulation, AdamW + LR schedule, grad clipping, what goes into its checkpoints
(written by training/checkpoint.py in Miles' layout), and the HF-named
weights that engines load. The model itself comes from a ModelBackend (fsdp | megatron).

Devices: the rank computes on one device (`self.device`, cluster/devices.py: the GPU Ray gave it, else
the CPU). Batches are built as Python lists, staged on the CPU and moved there in one copy per tensor;
every tensor of the train step (models, optimizer state, ids, masks, advantages, the loss hub's) lives
on it, and only metrics and exports come back to the host. tests/device_check.py fails a step that
mixes a CPU tensor into the device's computation.
"""

from __future__ import annotations

import contextlib
import random
import resource
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from miles_platform.cluster.cpu_pinning import pin_trainer_rank, trainer_threads
from miles_platform.cluster.devices import (
    config_on_device,
    group_backend,
    peak_memory_mb,
    rank_device,
    use_device,
)
from miles_platform.cluster.ports import gloo_on_loopback, tcp_store
from miles_platform.config import RunConfig
from miles_platform.startup import import_in_background
from miles_platform.store import remote
from miles_platform.training import actor_checkpoint, ci_checks
from miles_platform.training import loss as loss_hub
from miles_platform.training.actor_weights import ActorWeights
from miles_platform.training.backend import ScoreRequest, Scores
from miles_platform.training.backends import get_backend_class
from miles_platform.training.checkpoint import (
    check_finite_weights,
    optimizer_tensors,
)
from miles_platform.training.hooks import TrainerHooks
from miles_platform.training.opd import OPDPenalty, build_teacher
from miles_platform.training.profiler import (
    TrainProfiler,
    TrainWait,
    finish_micro_batches,
    profile_micro_batches,
)
from miles_platform.training.rollout_metrics import rollout_data_metrics
from miles_platform.training.schedule import LRScheduler, schedule_of
from miles_platform.training.shared_prefix import pack_shared_prefixes
from miles_platform.training.train_batch import TrainBatch
from miles_platform.training.train_samples import SampleRows, TrainSamplesTarget
from miles_platform.weights.transports import encode_state

__all__ = ["TrainBatch", "TrainerActor"]


def _rank_log(line: str) -> None:
    """A rank's fault-hook line: its stderr (the Ray worker log), flushed before the action runs."""
    import sys

    print(line, file=sys.stderr, flush=True)


class TrainerActor(ActorWeights):
    """Trainer rank. In the loop it is wrapped with `ray.remote`; tests may use it directly."""

    def __init__(
        self, cfg: RunConfig, rank: int = 0, world_size: int = 1, dist_init: str | None = None,
        secret_env: dict | None = None, device: str | torch.device | None = None,
    ):  # fmt: skip
        """`device`: the rank's device; None: the one Ray assigned (cluster/devices.rank_device)."""
        remote.apply_secret_env(secret_env)  # the object store's credentials (never in the runtime env)
        pin_trainer_rank(rank)  # --pin-trainer-cpus: this rank's own cores (the run's plan, in the env)
        # pandas, which pyarrow imports for the first train_samples rows: while the rank waits for
        # its first rollout, not in the fork server's preload (forkserver.PRELOAD says why)
        import_in_background("pandas", name="warm-up-pandas")
        torch.set_num_threads(int(trainer_threads()))  # the driver's validated MILES_TRAIN_THREADS
        self.device = rank_device(device)
        use_device(self.device)
        cfg = config_on_device(cfg, self.device)  # --train-forward-dtype / --rollout-dtype resolved
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.offloaded = False  # --offload-train: model and optimizer parked on the host
        self._moe: set = set()  # the RoutingReplay of each MoE model this actor forwards (policy, reference)
        if world_size > 1 and not dist.is_initialized():
            host, _, port = (dist_init or "").removeprefix("tcp://").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"TrainerActor: world_size {world_size} needs dist_init tcp://HOST:PORT, got {dist_init!r}"
                )
            host = host.strip("[]")  # tcp://[::1]:port
            gloo_on_loopback(host)
            minutes = cfg.distributed_timeout_minutes
            store = tcp_store(host, int(port), world_size, rank == 0, timeout_s=60.0 * minutes)
            dist.init_process_group(
                group_backend(self.device), store=store, rank=rank, world_size=world_size,
                timeout=timedelta(minutes=minutes),
            )  # fmt: skip
        if cfg.deterministic_mode:  # Miles' --deterministic-mode (cuBLAS' workspace: run_services' env)
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)
        np.random.seed(cfg.seed + rank)
        self.backend = get_backend_class(cfg.train_backend)(cfg, rank, world_size, self.device)
        self.model = self.backend.build(cfg.hf_checkpoint)
        check_finite_weights(self.backend.parameters(), self.model, cfg.hf_checkpoint)
        self.dp_rank, self.dp_size, self.dp_group = self.backend.data_parallel()
        self.ref = self._build_ref() if cfg.uses_reference_model else None
        self.teacher = build_teacher(cfg, rank, world_size, self.device) if cfg.uses_trainer_teacher else None
        self.critic = None
        if cfg.uses_critic:
            from miles_platform.training.critic import Critic

            self.critic = Critic(cfg, cfg.hf_checkpoint, world_size, self.device)
        params = [p for p in self.backend.parameters() if p.requires_grad]
        self.opt = self.backend.build_optimizer()  # megatron's distributed optimizer, else torch's
        if self.opt is None and cfg.optimizer == "adam":
            self.opt = torch.optim.AdamW(
                params,
                lr=cfg.lr,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            )
        elif self.opt is None:
            self.opt = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        total = (cfg.num_rollout or 1) * (cfg.num_steps_per_rollout or 1)
        # --allow-config-change: a resume takes the command line's schedule (its changes are recorded)
        override = cfg.override_lr_scheduler or (
            cfg.allow_config_change and not cfg.use_checkpoint_lr_scheduler
        )
        self.sched = LRScheduler(self.opt, schedule_of(cfg, total), cfg.use_checkpoint_lr_scheduler, override)
        self.global_step = 0
        self._masks: tuple = (None, {})  # (batch, {sample: loss mask on the device}): _mask
        self.loss_fn = loss_hub.get_loss_function(cfg)
        self.train_hooks = TrainerHooks(cfg)  # --rollout-data-postprocess-path, megatron's step hook
        self._weight_groups: dict = {}  # group_name -> (process group, backend), broadcast transport
        from miles_platform.fault_hooks import FaultHooks, parse_fault_hooks

        # --ci-fault-hooks' rank hooks, fired in this process (kill_process kills this rank)
        self.hooks = FaultHooks(parse_fault_hooks(cfg.ci_fault_hooks), _rank_log, rank=rank)
        self.prof = TrainProfiler(cfg, rank)  # --use-pytorch-profiler: stepped once per train call
        self.prof.start()
        self.wait = TrainWait()  # perf/train_wait_time: from here until the first train call
        # the loop's train_samples rows, made and written beside the next step: ~4 ms a 128-sample
        # step of the demo off it (2026-12-07), a part file a second (store/tables.BufferedParts);
        # a save and `drain_rows` flush it
        from miles_platform.store.paths import StoragePaths
        from miles_platform.store.tables import BufferedParts

        self.row_writer = BufferedParts(StoragePaths(cfg.storage_root), name="train-samples")
        # the samples of a prompt share its forward where the backend can (training/shared_prefix.py);
        # False: every sample its own padded row (a benchmark's or a test's comparison)
        self.share_prefixes = True

    # ------------------------------------------------------------------ setup
    def _build_ref(self):
        ref = get_backend_class(self.cfg.train_backend)(self.cfg, self.rank, self.world_size, self.device)
        ref.build(
            self.cfg.ref_load
            if self.cfg.ref_load and self.cfg.train_backend == "fsdp"
            else self.cfg.hf_checkpoint,
            trainable=False,
        )
        if self.cfg.ref_load and self.cfg.train_backend == "megatron":
            ref.load_model(self.cfg.ref_load)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def ready(self) -> bool:
        return True

    def drain_rows(self) -> None:
        """The train_samples rows of the last `train` call are on disk (the loop's, at the run's end)."""
        self.row_writer.flush()

    # ------------------------------------------------------------------ log-probs
    def _tensor(self, data, dtype=torch.float32) -> torch.Tensor:
        """A tensor of Python data on the rank's device (built on the host, one copy)."""
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _tensors(self, rows, idx, dtype=torch.float32) -> dict[int, torch.Tensor]:
        """{i: rows[i] as a tensor on the device} for the samples `idx`: one host tensor and one copy
        for all of them, split into views (read-only; a per-sample `torch.tensor` each cost more than
        the tiny models' step did)."""
        flat = torch.tensor([x for i in idx for x in rows[i]], dtype=dtype).to(self.device)
        return dict(zip(idx, flat.split([len(rows[i]) for i in idx]), strict=True))

    def _mask(self, batch: TrainBatch, i: int) -> torch.Tensor:
        """Sample i's loss mask on the device, built for the whole batch at its first use
        (read-only: shared by every consumer of the step)."""
        if self._masks[0] is not batch:
            self._masks = (batch, self._tensors(batch.loss_masks, range(len(batch))))
        return self._masks[1][i]

    def _pack(self, batch: TrainBatch, idx: list[int]):
        """[B, width] right-padded token ids and their positions, on the device."""
        seqs = [batch.tokens[i] for i in idx]
        lens = torch.tensor([len(s) for s in seqs])
        width = int(lens.max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        ids[torch.arange(width) < lens[:, None]] = torch.tensor(
            [t for s in seqs for t in s], dtype=torch.long
        )
        pos = torch.arange(width, device=self.device).unsqueeze(0).expand(len(seqs), -1).contiguous()
        return ids.to(self.device), pos

    def _score_request(self, backend, batch: TrainBatch, idx: list[int], with_entropy: bool = False,
                       candidates: list[torch.Tensor] | None = None) -> ScoreRequest:  # fmt: skip
        """One padded micro-batch forward of samples `idx` and what it scores: the engines' contract
        (Miles'), log softmax(z / T) with the rollout temperature, over the recorded sampling support
        when top-k / top-p truncated it (sampling-support replay). `candidates` (per sample [n, K]
        token ids, -1 unused; a loss with `needs_candidate_log_probs`) are placed at each sample's
        response positions."""
        ids, pos = self._pack(batch, idx)
        width = ids.shape[1]
        index = None
        if candidates is not None:  # [B, width - 1, K]: each sample's ids at its response positions
            k = candidates[0].shape[-1]
            index = torch.full((len(idx), width - 1, k), -1, dtype=torch.long, device=self.device)
            for r, i in enumerate(idx):
                total, resp = len(batch.tokens[i]), batch.response_lengths[i]
                index[r, total - resp - 1 : total - 1] = candidates[r]

        @contextlib.contextmanager
        def around_forward():
            with self._routing(backend, batch, idx, width), self._aux_loss(backend, batch, idx, width):
                yield

        req = ScoreRequest(
            ids, pos, self.cfg.rollout_temperature, self._support_index(batch, idx, width - 1),
            with_entropy, index, around_forward,
        )  # fmt: skip
        if batch.images is not None:  # vision-language samples: the backend runs their images
            req.images, req.lengths = [batch.images[i] for i in idx], [len(batch.tokens[i]) for i in idx]
        elif backend.shares_prefixes and self.share_prefixes:  # one forward of each prompt
            seqs = [batch.tokens[i] for i in idx]
            prompts = [len(s) - batch.response_lengths[i] for s, i in zip(seqs, idx, strict=True)]
            req.packed = pack_shared_prefixes(seqs, prompts, width, self.device)
        return req

    @staticmethod
    def _per_sample(batch: TrainBatch, idx: list[int], scores: Scores):
        """Each sample's response window of a micro-batch's scores (position j scores token j + 1):
        (log-probs, entropies, candidate log-probs) lists; the last two empty when not scored. One
        gather of every window and a split into views: two autograd nodes for the micro-batch (a
        slice per sample cost the backward ~60 us a sample)."""
        width = scores.log_probs.shape[1]
        lens = [batch.response_lengths[i] for i in idx]
        starts = torch.tensor(
            [r * width + len(batch.tokens[i]) - n - 1 for r, (i, n) in enumerate(zip(idx, lens))]
        )
        counts = torch.tensor(lens)
        # every window's flat positions: start of its window + 0..n-1
        shift = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
        flat = (torch.arange(int(counts.sum())) + shift).to(scores.log_probs.device)

        def windows(x: torch.Tensor) -> list[torch.Tensor]:
            return list(x.reshape(-1, *x.shape[2:])[flat].split(lens))

        ents = windows(scores.entropy) if scores.entropy is not None else []
        cands = windows(scores.candidates) if scores.candidates is not None else []
        return windows(scores.log_probs), ents, cands

    def _response_log_probs(self, backend, batch: TrainBatch, idx: list[int], with_entropy: bool = False,
                            candidates: list[torch.Tensor] | None = None):  # fmt: skip
        """Per-sample log-probs of response tokens (fp32), from one padded forward (see
        `_score_request`); with `candidates` a third list, per sample the [n, K] log-probs of those
        ids from the same forward, with grad."""
        req = self._score_request(backend, batch, idx, with_entropy, candidates)
        out, ents, cands = self._per_sample(batch, idx, backend.score(req))
        return (out, ents) if candidates is None else (out, ents, cands)

    def _moe_metrics(self) -> dict[str, float]:
        """MoE: expert load balance of the step's forwards (max / mean tokens per expert, 1 = even)
        and, under R3, the routes the trainer would have chosen differently from the rollout."""
        if not self._moe:
            return {}
        out = {"train/moe_load_balance": float(np.mean([rr.load_balance() for rr in self._moe]))}
        if self.cfg.use_rollout_routing_replay:
            flips, routed = sum(rr.flips for rr in self._moe), sum(rr.routed for rr in self._moe)
            out["train/moe_route_flips"] = float(flips)
            out["train/moe_route_flip_frac"] = flips / max(routed, 1)
        return out

    def _routing(self, backend, batch: TrainBatch, idx: list[int], width: int):
        """MoE: the forward's router hooks; with --use-rollout-routing-replay the routers take the
        rollout's experts for every token the engine routed (R3), counting the routes that flip."""
        from miles_platform.models.moe import MegatronRoutingReplay, RoutingReplay

        rr = RoutingReplay.of(backend.module) or MegatronRoutingReplay.of(backend.module)
        if rr is None:
            return contextlib.nullcontext()
        self._moe.add(rr)
        if not self.cfg.use_rollout_routing_replay:
            return contextlib.nullcontext()
        routes = torch.full(
            (len(idx), width, rr.num_layers, rr.top_k), -1, dtype=torch.long
        )  # staged on the host
        for r, i in enumerate(idx):
            got = (batch.routed_experts or [None] * len(batch))[i]
            n = len(batch.tokens[i]) - 1
            if got is None or len(got) != n:
                raise ValueError(
                    f"--use-rollout-routing-replay: sample {i} has {'no' if got is None else len(got)} "
                    f"routed-expert rows for its {n + 1} tokens (the engine returns tokens - 1)"
                )
            routes[r, :n] = torch.as_tensor(got, dtype=torch.long)
        return rr.replay(routes.to(self.device))  # [B, T, layers, top_k]: each kind flattens its own way

    def _aux_loss(self, backend, batch: TrainBatch, idx: list[int], width: int):
        """--moe-aux-loss-coeff / --moe-z-loss-coeff: the policy's training forward collects its
        load-balancing loss and router z-loss over the real (unpadded) tokens into `self.moe_aux`
        and `self.moe_z` (each the mean over layers)."""
        from miles_platform.models.moe import MegatronRoutingReplay, RoutingReplay

        self.moe_aux = self.moe_z = None
        wanted = self.cfg.moe_aux_loss_coeff or self.cfg.moe_z_loss_coeff
        rr = (
            (RoutingReplay.of(backend.module) or MegatronRoutingReplay.of(backend.module)) if wanted else None
        )
        if rr is None or backend is not self.backend or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        lens = self._tensor([len(batch.tokens[i]) for i in idx], torch.long)
        mask = torch.arange(width, device=self.device)[None, :] < lens[:, None]  # [B, T]

        @contextlib.contextmanager
        def collect():
            with rr.aux_loss(mask) as terms:
                yield
            self.moe_aux, self.moe_z = torch.stack(terms).mean(), torch.stack(rr.z_terms).mean()

        return collect()

    def _support_index(self, batch: TrainBatch, idx: list[int], width: int) -> torch.Tensor | None:
        """[B, width, K] token ids of each response position's recorded support (-1 elsewhere)."""
        sups = batch.rollout_sampling_supports
        if sups is None or all(sups[i] is None for i in idx):
            return None
        k = max((len(t) for i in idx if sups[i] for t in sups[i]), default=1)
        out = torch.full((len(idx), width, k), -1, dtype=torch.long)
        for r, i in enumerate(idx):
            if sups[i] is None:
                continue
            total, resp = len(batch.tokens[i]), batch.response_lengths[i]
            if len(sups[i]) != resp:
                raise ValueError(f"sample {i}: {len(sups[i])} sampling supports for {resp} response tokens")
            for j, t in enumerate(sups[i]):
                out[r, total - resp - 1 + j, : len(t)] = torch.tensor(t, dtype=torch.long)
        return out.to(self.device)  # staged on the host, one copy

    def _micro_batches(self, batch: TrainBatch, idx: list[int]) -> list[list[int]]:
        if self.cfg.use_dynamic_batch_size:
            # a rank holds 1 / CP of a micro-batch's tokens under context parallelism (Miles' budget)
            budget = self.cfg.max_tokens_per_gpu * int(getattr(self.cfg, "context_parallel_size", 1) or 1)
            mbs, cur, cur_tokens = [], [], 0
            for i in idx:
                n = len(batch.tokens[i])
                if cur and cur_tokens + n > budget:
                    mbs.append(cur)
                    cur, cur_tokens = [], 0
                cur.append(i)
                cur_tokens += n
            mbs += [cur] if cur else []
            if int(getattr(self.cfg, "expert_model_parallel_size", 1) or 1) > 1 and self.dp_size > 1:
                # the expert ranks exchange tokens in every micro-batch: all run the most any packs
                mbs = split_micro_batches(mbs, int(self._all_reduce_max(len(mbs))))
            return mbs
        m = self.cfg.micro_batch_size
        return [idx[j : j + m] for j in range(0, len(idx), m)]

    @torch.no_grad()
    def _all_log_probs(
        self, backend, batch: TrainBatch, idx: list[int], ents: dict | None = None
    ) -> dict[int, torch.Tensor]:
        """Each sample's response log-probs; `ents` (a dict): filled with its token entropies too."""
        mbs = self._micro_batches(batch, idx)
        out = {}

        def consume(k, scores):
            lps, es, _ = self._per_sample(batch, mbs[k], scores)
            out.update(zip(mbs[k], lps, strict=True))
            if ents is not None:
                ents.update(zip(mbs[k], es, strict=True))

        reqs = [self._score_request(backend, batch, mb, ents is not None) for mb in mbs]
        prof = profile_micro_batches(self.cfg, self.rank, "train_log_probs", reqs)
        backend.run_micro_batches(reqs, consume, True)
        finish_micro_batches(prof)
        if ents is not None:
            ents.update(backend.from_last_stage(ents))
        return backend.from_last_stage(out)

    def _rollout_entropy_on(self) -> bool:
        """rollout/entropy, the trainer's token entropy before the step: Miles' fsdp backend always
        computes it with the log-probs, its megatron backend with --use-rollout-entropy."""
        return self.cfg.train_backend == "fsdp" or self.cfg.use_rollout_entropy

    # ------------------------------------------------------------------ train
    def _my_indices(self, step: int) -> list[int]:
        """This data-parallel rank's samples of optimizer step `step` (every dp_size-th)."""
        gbs = self.cfg.global_batch_size
        return list(range(step * gbs + self.dp_rank, (step + 1) * gbs, self.dp_size))

    def train(
        self,
        rollout_id: int,
        batch: TrainBatch,
        samples: TrainSamplesTarget | None = None,
        with_weights: bool = False,
    ) -> dict[str, float] | tuple[dict[str, float], dict | None]:
        """num_steps_per_rollout optimizer steps over one rollout's samples. Returns metrics. `samples`:
        record the train_samples rows (the loop's; training/train_samples.py). `with_weights`: returns
        (metrics, the trained policy under HF names: `get_hf_weights` as `encode_state` bytes, which
        `decode_state` reads back; rank 0's, None on the others),
        so a loop that queued the next rollout's train behind this one still gets this version's
        weights (train-async's pipeline, loop.py)."""
        cfg = self.cfg
        t0 = self.wait.begin()
        if not isinstance(batch, TrainBatch):  # a handle from the object store (ray | mooncake)
            from miles_platform.cluster.object_store import get_rollout_data

            batch = TrainBatch(**get_rollout_data(batch))
        self.onload()  # --offload-train: back on the device for the step
        actor_checkpoint.finish_pending(self)  # --async-save: the previous save's files are in
        self.hooks.rollout_id = rollout_id
        self.model.train()
        self._rows = SampleRows.start(cfg, batch, rollout_id, samples, self.rank, self.backend)
        for rr in self._moe:  # MoE metrics are per train call
            rr.reset()
        steps = cfg.num_steps_per_rollout
        mine = [i for s in range(steps) for i in self._my_indices(s)]
        fused = self._old_log_probs_from_training_forward()
        rollout_lp = self._tensors(batch.rollout_log_probs, mine)
        ents: dict | None = {} if self._rollout_entropy_on() else None  # rollout/entropy
        self._fused_ents = ents if fused else None  # filled by the training forward itself
        # `scored`: the trainer's log-probs before the step (fused: filled by the training forward
        # itself, detached, micro-batch by micro-batch); `old`: the ratio's old policy (the rollout's
        # with --use-rollout-logprobs, when the trainer pass runs only for --get-mismatch-metrics)
        if cfg.use_rollout_logprobs:
            scored = (
                self._all_log_probs(self.backend, batch, mine, ents)
                if cfg.get_mismatch_metrics
                else rollout_lp
            )
            old = dict(rollout_lp)
        else:
            scored = old = {} if fused else self._all_log_probs(self.backend, batch, mine, ents)
        ref = self._all_log_probs(self.ref, batch, mine) if self.ref is not None else None
        values = self._critic_values(batch, mine) if self.critic is not None else None
        adv, returns = self._advantages(batch, mine, old, ref, values)
        metrics: dict[str, list[float]] = {}

        def add(k, v):
            metrics.setdefault(k, []).append(float(v))

        opd = None
        if cfg.use_opd:  # the teacher's signal; applied once the student's old log-probs exist
            teacher = self._all_log_probs(self.teacher, batch, mine) if self.teacher is not None else None
            opd = OPDPenalty(cfg, batch, teacher, add, self.device)
            if not fused:
                opd.apply(mine, adv, old)
        if cfg.normalize_advantages:  # after OPD, as Miles; never fused with OPD (see above)
            self._whiten(batch, mine, adv)

        self.train_hooks.postprocess_rollout(batch, mine, scored, ref, rollout_lp, adv)
        self._masks = (None, {})  # the hook may have replaced loss masks: built again from the batch
        if not fused:
            self._alignment_metrics(batch, mine, scored, rollout_lp, add)
        for s in range(steps):
            self.step_id = s  # the optimizer step within this rollout (--ci-*-grad-norm's {step_id})
            self.train_hooks.before_train_step(rollout_id, s, getattr(self.backend, "chunks", [self.model]),
                                               self.opt, self.sched)  # fmt: skip
            self._train_step(batch, self._my_indices(s), scored, ref, rollout_lp, adv, add, fused, opd)
            if self.critic is not None:
                self._critic_step(batch, self._my_indices(s), values, returns, add)
        if self._rows is not None:
            self._rows.flush(self.row_writer if samples is not None and samples.background else None)
        if fused:
            old.update(self.backend.from_last_stage(old))  # pipeline parallel: scored on the last stage
            if ents is not None:
                ents.update(self.backend.from_last_stage(ents))
            self._alignment_metrics(batch, mine, old, rollout_lp, add)
        metrics = self.backend.from_last_stage(metrics)  # the loss hub's metrics: the last stage's
        out = {k: float(np.mean(v)) for k, v in metrics.items()}
        trainer_lp = old if fused else (scored if scored is not rollout_lp else None)
        out.update(rollout_data_metrics(
            mine, {i: self._mask(batch, i) for i in mine}, log_probs=trainer_lp, ref_log_probs=ref,
            rollout_log_probs=rollout_lp, advantages=adv, returns=returns,
            values=values, entropy=ents,
        ))  # fmt: skip
        out["train/nonfinite_steps"] = float(sum(metrics.get("train/nonfinite_steps", [])))
        if "train/loss_scale_skipped_steps" in metrics:  # --fp16: a count too
            out["train/loss_scale_skipped_steps"] = float(sum(metrics["train/loss_scale_skipped_steps"]))
        out["train/lr"] = self.sched.get_last_lr()[0]
        out.update(self._moe_metrics())
        out["perf/actor_train_time"] = time.time() - t0
        out.update(self.wait.end())  # perf/train_wait_time, perf/train_time, ...
        self.prof.step()  # --use-pytorch-profiler: one profiler step per rollout (Miles')
        # Miles': tokens (prompt + response) this rank trained on per second of train()
        out["perf/actor_train_tok_per_s"] = (
            sum(len(batch.tokens[i]) for i in mine) / out["perf/actor_train_time"]
        )
        # memory: the process's peak RSS (Linux reports KiB) and the optimizer state actually held
        # (LoRA: the adapter's only)
        out["perf/actor_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        peak = peak_memory_mb(self.device)
        if peak is not None:
            out["perf/actor_peak_device_mem_mb"] = peak
        out["perf/actor_optimizer_state_bytes"] = float(
            sum(
                t.numel() * t.element_size()
                for st in self.opt.state.values()
                for t in st.values()
                if torch.is_tensor(t)
            )  # fmt: skip
        )
        out["train/step"] = self.global_step
        if self.world_size > 1:
            out = self._reduce_metrics(out)
        if not with_weights:
            return out
        t = time.time()
        weights = self.get_hf_weights()  # every rank: the gather is collective
        out["perf/get_weights_time"] = time.time() - t
        # as raw bytes: Ray pickles a tensor at ~3x the CPU of its bytes (weights/transports encode_state)
        return out, (encode_state(weights) if self.rank == 0 else None)

    def _old_log_probs_from_training_forward(self) -> bool:
        """One optimizer step per rollout: the policy before the step is the one the training
        forward runs, so its detached log-probs are the old log-probs (as TRL and verl do when
        ppo_epochs == 1) and the separate no-grad pass is skipped. Kept where it is needed: several
        steps, rollout log-probs as old, advantages that read old log-probs (a KL-shaped reward), and
        the first step under --ci-test, whose step-0 checks compare two independent passes."""
        c = self.cfg
        return (
            c.num_steps_per_rollout == 1
            and not c.use_rollout_logprobs
            and (c.kl_coef == 0 or c.advantage_estimator in ("grpo", "gspo"))
            and not c.debug_skip_optimizer_step  # frozen weights: the gap between passes is the point
            and not (c.use_opd and c.normalize_advantages)  # whitening needs every OPD-shaped advantage
            and not (c.ci_test and self.global_step == 0)
            and not c.rollout_data_postprocess_path  # the hook sees the old log-probs before any step
        )

    def _alignment_metrics(self, batch, mine, old, rollout_lp, add) -> None:
        """Trainer-vs-engine log-prob agreement (train/train_rollout_logprob_abs_diff and friends)."""
        have = [i for i in mine if len(batch.rollout_log_probs[i])]
        if not have or old is rollout_lp:  # --use-rollout-logprobs without a trainer pass
            return
        from miles_platform.training.precision import alignment_metrics

        m = alignment_metrics(
            [old[i] for i in have],
            [rollout_lp[i] for i in have],
            [self._mask(batch, i) for i in have],
        )
        for k, v in m.items():
            add(k, v)
        add("train/train_rollout_logprob_abs_diff", m["train/log_prob_mean_abs_diff"])

    def _advantages(self, batch, mine, old, ref, values=None):
        """The estimator's advantages and returns of this rank's samples (before OPD and whitening)."""
        cfg = self.cfg
        if cfg.loss_type == "sft_loss":
            zeros = torch.zeros(sum(batch.response_lengths[i] for i in mine), device=self.device)
            return dict(zip(mine, zeros.split([batch.response_lengths[i] for i in mine]), strict=True)), None
        group_based = cfg.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline")
        idx = list(range(len(batch))) if group_based else mine  # a group's statistics need all of it
        rewards = self._tensor([batch.rewards[i] for i in idx])
        zeros = lambda i: torch.zeros(batch.response_lengths[i], device=self.device)  # noqa: E731
        lps = refs = None
        if cfg.advantage_estimator not in ("grpo", "gspo"):  # the only estimators that read no log-prob
            lps = [old[i] if i in old else zeros(i) for i in idx]
            if ref is not None:
                refs = [ref[i] if i in ref else zeros(i) for i in idx]
        masks = [self._mask(batch, i) for i in idx]
        vals = [values[i] for i in idx] if values is not None else None
        advs, rets = loss_hub.compute_advantages_and_returns(
            cfg, rewards, lps, refs, vals, masks, normalize=not batch.rewards_normalized
        )
        keep = set(mine)
        pick = lambda xs: {i: x for i, x in zip(idx, xs, strict=True) if i in keep}  # noqa: E731
        return pick(advs), pick(rets)

    def _whiten(self, batch, mine, adv) -> None:
        """--normalize-advantages: every rank whitens its share with the whole batch's statistics
        (the ranks' shares partition the rollout)."""
        masks = [self._mask(batch, i) for i in mine]
        dp_sum = self._all_reduce_tensor if self.dp_size > 1 else None
        whitened = loss_hub.normalize_advantages([adv[i] for i in mine], masks, dp_sum)
        adv.update(zip(mine, whitened, strict=True))

    # ------------------------------------------------------------------ critic (ppo)
    def _critic_forward(self, batch, mb):
        ids, pos = self._pack(batch, mb)
        spans = [(len(batch.tokens[i]), batch.response_lengths[i]) for i in mb]
        return self.critic.values(ids, pos, spans)

    @torch.no_grad()
    def _critic_values(self, batch, idx) -> dict[int, torch.Tensor]:
        out = {}
        for mb in self._micro_batches(batch, idx):
            out.update(zip(mb, self._critic_forward(batch, mb), strict=True))
        return out

    def _critic_step(self, batch, idx, old_values, returns, add):
        tok_global = self._all_reduce_sum(self._token_count(batch, idx))
        for mb in self._micro_batches(batch, idx):
            v = self._critic_forward(batch, mb)
            masks = [self._mask(batch, i) for i in mb]
            rets = [returns[i] for i in mb]
            loss, m = loss_hub.value_loss(self.cfg, v, [old_values[i] for i in mb], rets, masks)
            (loss * self._mb_scale(batch, mb, len(idx), tok_global)).backward()
            for k, val in m.items():
                add(f"train/{k}", val)
        grad_norm = self.critic.step()
        if self.cfg.ci_test and self.rank == 0:
            ci_checks.check_grad_norm(
                self.cfg, float(grad_norm), self.hooks.rollout_id, self.step_id, "critic"
            )
        add("train/critic_grad_norm", grad_norm)

    @staticmethod
    def _token_count(batch, idx) -> float:
        """Loss tokens of `idx`, a fully masked sample counting as one (Miles' normalizer)."""
        return float(sum(max(sum(batch.loss_masks[i]), 1) for i in idx))

    def _mb_scale(self, batch, mb, n_local: int, tok_global: float) -> float:
        """A micro-batch mean's weight in the global-batch reduction (ranks' grads are averaged)."""
        if self.cfg.calculate_per_token_loss:
            return self._token_count(batch, mb) * self.dp_size / max(tok_global, 1.0)
        return len(mb) / n_local

    def _train_step(self, batch, idx, old, ref, rollout_lp, adv, add, fused: bool = False, opd=None):
        cfg = self.cfg
        mbs = self._micro_batches(batch, idx)
        n_local = len(idx)
        tok_global = self._all_reduce_sum(self._token_count(batch, idx))
        self.opt.zero_grad(set_to_none=True)
        self.backend.zero_grad()
        # the loss gets the entropy for its bonus, --observe-training-entropy or --ci-test's range;
        # the fused forward also scores rollout/entropy (the policy before the step)
        loss_ent = (
            cfg.entropy_coef != 0 or cfg.observe_training_entropy or (cfg.ci_test and self.global_step == 0)
        )
        capture = self._fused_ents if fused else None
        need_ent = loss_ent or capture is not None
        recorded = [None] * len(mbs)
        if getattr(self.loss_fn, "needs_candidate_log_probs", False):  # score centering
            from miles_platform.training.score_centering import rollout_candidates

            top = cfg.rollout_top_logprobs_num
            recorded = [[rollout_candidates(batch, i, top, self.device) for i in mb] for mb in mbs]
        reqs = [
            self._score_request(self.backend, batch, mb, need_ent, [c for c, _ in rec] if rec else None)
            for mb, rec in zip(mbs, recorded, strict=True)
        ]
        for r in reqs:  # observed only (rollout/entropy, --observe-training-entropy): no graph for it
            r.entropy_grad = cfg.entropy_coef != 0

        def consume(k: int, scores: Scores) -> torch.Tensor:
            """Micro-batch k's weighted loss from its scores (the last pipeline stage's forward)."""
            mb = mbs[k]
            lps, ents, cands = self._per_sample(batch, mb, scores)
            if fused:
                old.update(zip(mb, (lp.detach() for lp in lps), strict=True))
                if capture is not None:
                    capture.update(zip(mb, (e.detach() for e in ents), strict=True))
                if opd is not None:
                    opd.apply(mb, adv, old)
            mb_batch = {
                "advantages": [adv[i] for i in mb],
                "old_log_probs": [old[i] for i in mb],
                "rollout_log_probs": [rollout_lp[i] for i in mb],
                "ref_log_probs": [ref[i] for i in mb] if ref is not None else None,
                "loss_masks": [self._mask(batch, i) for i in mb],
                "response_lengths": [batch.response_lengths[i] for i in mb],
                "total_lengths": [len(batch.tokens[i]) for i in mb],
            }
            if recorded[k]:  # the rollout's candidates (ids, log q) and the trainer's log p at them
                mb_batch["rollout_topk_token_ids"] = [c for c, _ in recorded[k]]
                mb_batch["rollout_topk_log_probs"] = [q for _, q in recorded[k]]
                mb_batch["candidate_log_probs"] = cands
            loss, m = self.loss_fn(cfg, mb_batch, lps, ents if loss_ent else None)
            if self._rows is not None:
                self._rows.add(mb, k, self.global_step, mb_batch, lps)
            if self.moe_aux is not None:  # --moe-aux-loss-coeff / --moe-z-loss-coeff
                loss = loss + cfg.moe_aux_loss_coeff * self.moe_aux + cfg.moe_z_loss_coeff * self.moe_z
                m = {**m, "moe_aux_loss": float(self.moe_aux), "moe_z_loss": float(self.moe_z)}
            for key, v in m.items():
                add(key if "/" in key else f"train/{key}", v)
            if self.step_id == 0 and k == 0:  # the rollout's first step (--ci-test's KL checker, Miles')
                add("train/step0_ppo_kl", m.get("ppo_kl", 0.0))
                add("train/step0_pg_clipfrac", m.get("pg_clipfrac", 0.0))
            if self.global_step == 0 and cfg.ci_test:  # every micro-batch of step 0
                add("train/step0_kl_loss", m.get("kl_loss", 0.0))
                if "entropy_loss" in m:
                    add("train/step0_entropy", m["entropy_loss"])
            return loss * self._mb_scale(batch, mb, n_local, tok_global)

        prof = profile_micro_batches(cfg, self.rank, "train_actor", reqs)
        self.backend.run_micro_batches(reqs, consume)
        finish_micro_batches(prof)
        self.hooks.fire("trainer_step_before_allreduce")
        self.backend.finish_grad_sync()  # .grad = the average over data-parallel ranks
        grad_norm = self.backend.clip_grad_norm(cfg.clip_grad)
        finite = bool(torch.isfinite(grad_norm))  # the same on every rank: the norm is global
        scaled = self.backend.loss_scale_metrics()  # --fp16: an overflow skips the step, the scale backs off
        if cfg.ci_test and self.rank == 0:  # --ci-save-grad-norm / --ci-load-grad-norm
            ci_checks.check_grad_norm(cfg, float(grad_norm), self.hooks.rollout_id, self.step_id)
        add("train/grad_norm", grad_norm if finite else 0.0)
        # a NaN / inf loss or gradient: the step is skipped (an fp16 overflow is not a divergence)
        add("train/nonfinite_steps", not finite and not scaled.get("train/loss_scale_skipped_steps"))
        for k, v in scaled.items():
            add(k, v)
        if not finite:
            self.opt.zero_grad(set_to_none=True)
            self.backend.zero_grad()
        elif not cfg.debug_skip_optimizer_step:
            self.opt.step()
            self.backend.optimizer_stepped()
        self.sched.step()
        self.global_step += 1

    def _all_reduce_sum(self, x: float) -> float:
        """Sum over the data-parallel ranks (model-parallel peers hold the same samples)."""
        if self.dp_size == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return float(t.item())

    def _all_reduce_max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return float(t.item())

    def _all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.dp_group)
        return t

    def _reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        keys = sorted(m)
        t = torch.tensor([m[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    # ------------------------------------------------------------------ colocation
    def offload(self) -> None:
        """--offload-train: model(s) and optimizer state to host memory (training/offload.py)."""
        from miles_platform.training import offload

        offload.offload(self)

    def onload(self) -> None:
        """Back on the rank's device (`train` and `compute_log_probs` call it themselves)."""
        from miles_platform.training import offload

        offload.onload(self)

    def compute_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        self.onload()
        idx = list(range(len(batch)))
        lp = self._all_log_probs(self.backend, batch, idx)
        return [lp[i].tolist() for i in idx]

    # ------------------------------------------------------------------ checkpoints
    def save(self, rollout_id: int, extra_state: dict | None = None, sync: bool = False) -> str:
        """iter_NNNNNNN written atomically, then latest_checkpointed_iteration.txt
        (training/actor_checkpoint.py; `sync`: not in the background under --async-save)."""
        return actor_checkpoint.save(self, rollout_id, extra_state, sync)

    def finish_save(self) -> str | None:
        """Complete an --async-save in flight (every rank)."""
        return actor_checkpoint.finish_pending(self)

    def load(self) -> dict | None:
        """Resume from --load (or --save) if a checkpoint exists. Returns trainer_state or None."""
        return actor_checkpoint.load(self)

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        return optimizer_tensors(self.opt, self.backend.named_parameters())


def split_micro_batches(mbs: list[list[int]], n: int) -> list[list[int]]:
    """`mbs` split into `n` micro-batches, in order: the largest is halved until there are `n`
    (every data-parallel rank holds as many samples, so the one that packed `n` has at least `n`,
    and so does every other)."""
    mbs = [list(mb) for mb in mbs]
    while len(mbs) < n:
        k = max(range(len(mbs)), key=lambda j: len(mbs[j]))
        if len(mbs[k]) < 2:
            raise ValueError(f"{sum(map(len, mbs))} samples cannot make {n} micro-batches")
        half = len(mbs[k]) // 2
        mbs[k : k + 1] = [mbs[k][:half], mbs[k][half:]]
    return mbs
