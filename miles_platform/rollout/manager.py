"""RolloutManager: prompts -> router -> engines -> rewards -> filters -> one rollout's Samples.

Runs in the driver. Generation goes over HTTP (SGLang's `/generate`) to the router, so the
embedded CPU engine and real SGLang servers are one code path. Dynamic sampling draws
`--over-sampling-batch-size` prompts per round until `--rollout-batch-size` groups survive
the filter.

Generation of a round: one batched `/generate` for all its samples (the default), or with
--custom-generate-function-path the function once per sample, concurrently (at most
--rollout-max-concurrency in flight) on the engine client's event loop. --rollout-function-path
replaces `generate` as a whole.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import numpy as np

from miles_platform.cluster.ray_cluster import rollout_num_devices
from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample, Status
from miles_platform.data.source import RolloutDataSource
from miles_platform.errors import UserFunctionError
from miles_platform.plugins import (
    AGENTIC,
    GENERATE_FLAG,
    MILES_BUILTINS,
    ROLLOUT_FLAG,
    load_generate_function,
    load_hook,
    load_rollout_function,
)
from miles_platform.rollout import candidates, filter_hub, generate_hub, rm_hub
from miles_platform.rollout import client as engine_client
from miles_platform.rollout.base_types import (
    AdapterName,
    GenerateFnInput,
    GenerateFnOutput,
    GenerateState,
    RolloutFnTrainOutput,
)
from miles_platform.rollout.data_buffer import record_of
from miles_platform.rollout.generate_hub.endpoint import append_output, finish_status, truncate
from miles_platform.rollout.partial_rollout import PartialRollout


class RolloutManager:
    """Miles' rollout manager, in the driver: draws prompt groups from the data source, sends
    them to the engines (one batched SGLang `/generate` per round, or a custom / multi-turn
    generate function per sample), scores rewards, applies the dynamic and buffer filters and
    over-sampling (--partial-rollout: rollout/partial_rollout.py), and returns one rollout's `Sample`s
    with their metrics. Holds one HTTP connection pool for the run."""

    def __init__(self, cfg: RunConfig, tokenizer, data_source: RolloutDataSource, url: str):
        """`url`: the router, or the engine itself when there is only one (no hop that adds nothing)."""
        self.cfg, self.tok, self.data_source, self.url = cfg, tokenizer, data_source, url.rstrip("/")
        self.rewards = cfg.reward_settings()
        # a LoRA run's requests are served with its adapter, by the name of the version the engines
        # serve (switched by each update); --lora-train-only: the frozen base
        self.adapter = AdapterName(cfg.run_name) if cfg.syncs_lora_adapter else None
        from miles_platform.rollout.health import client_retries

        self.client = engine_client.EngineClient(
            self.url,
            cfg.api_key,
            cfg.rollout_max_concurrency,
            lora_path=self.adapter,
            max_retries=client_retries(cfg),
        )
        self._retries_seen = 0  # EngineClient.retries at the last rollout's metrics
        self.rollout_devices = rollout_num_devices(cfg)  # perf/tokens_per_gpu_per_sec (0: external engines)
        self.stop_token_ids = sorted({*cfg.rollout_stop_token_ids, tokenizer.eos_token_id})
        # finished groups not trained on yet (over-sampling surplus; in fully async mode, the data
        # buffer); --buffer-filter-path picks from it, oldest first by default (Miles' pop_first)
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = filter_hub.load_buffer_filter(cfg)
        # --partial-rollout: the aborted groups continued in the next rollout (rollout/partial_rollout.py)
        self.partial = PartialRollout(self) if cfg.partial_rollout else None
        self.all_samples_process = load_hook(cfg, "rollout_all_samples_process_path")
        self.replay = cfg.sampling_support_replay()
        # user code (generate / rollout functions) sees Miles-style args and the run's engine
        self.args = generate_hub.function_args(cfg, self.url)
        # --use-rollout-routing-replay: (MoE layers, top_k) of the model, to decode routed_experts
        self.moe_shape = None
        if cfg.use_rollout_routing_replay:
            from miles_platform.models.moe import routed_shape  # torch + transformers: only for R3

            self.moe_shape = routed_shape(cfg.hf_checkpoint)
        self.vocab_size = _vocab_size(cfg.hf_checkpoint)  # token ids a sample may carry into training
        self.state = GenerateState(
            self.args,
            tokenizer,
            self.url,
            cfg.api_key,
            self.replay,
            self.sampling_params(),
            self.adapter,
            moe_shape=self.moe_shape,
            rollout_top_logprobs_num=cfg.rollout_top_logprobs_num,
        )
        self._vision = None  # models.vlm.PromptVision: image prompts' pad expansion, loaded at first use
        # --use-session-server: the TITO session server, on loopback in this process (rollout/sessions.py)
        self.sessions = self._start_sessions() if cfg.use_session_server else None
        path = cfg.custom_generate_function_path
        self.generate_fn = load_generate_function(path) if path else None
        self.agentic = MILES_BUILTINS.get(path, path) == AGENTIC
        path = cfg.rollout_function_path
        self.rollout_fn = load_rollout_function(path).bind(self.args, data_source) if path else None
        self._slots: asyncio.Semaphore | None = None  # per-sample generations in flight (client loop)
        # --use-opd --opd-type sglang: the run's TeacherScorer (set by RunServices), scores `finalize`d samples
        self.opd = None
        self._opd_metrics: dict[str, float] = {}
        # the engine's candidates per token (rollout/candidates.py): score centering's K (the top K,
        # or under replay the support: sampling_logprobs_mode), else top-k OPD's student top-k
        sc = candidates.request_fields(cfg.rollout_top_logprobs_num, self.replay)
        self.top_logprobs_num = sc.get("top_logprobs_num", student_top_k(cfg))
        self.logprobs_mode = sc.get("sampling_logprobs_mode")
        self.topk = cfg.rollout_top_logprobs_num or self.top_logprobs_num
        # the run's and the in-loop eval's graders load now (a run started them once Ray was up), not
        # inside a step that needs them. Waited for here, not at the first grading: an await there
        # reordered which over-sampled groups finish first (tests/unit/rollout/test_partial_rollout.py)
        rm_hub.warm_up_rewards(*rm_hub.run_graders(cfg))

    def close(self) -> None:
        self.client.close()
        if self.sessions is not None:
            self.sessions.stop()

    def _start_sessions(self):
        from miles_platform.models.checkpoint import context_length
        from miles_platform.rollout.sessions import DEFAULT_MAX_SESSIONS, start_session_server

        c = self.cfg
        live = (c.over_sampling_batch_size or c.rollout_batch_size or 1) * c.n_samples_per_prompt
        srv = start_session_server(
            self.cfg, self.tok, self.url, self.replay, self.adapter, moe_shape=self.moe_shape,
            context_length=_checkpoint_field(c.hf_checkpoint, context_length) or 1 << 20,
            max_sessions=max(DEFAULT_MAX_SESSIONS, 4 * live), vision=self._prompt_vision() if _is_vlm(c) else None,
        )  # fmt: skip
        a = self.args  # Miles' names; the agentic wrapper reads session_server_url
        a.session_server_ip, a.session_server_port, a.session_server_ports = srv.host, srv.port, [srv.port]
        a.session_server_url = f"http://{'127.0.0.1' if srv.host == '0.0.0.0' else srv.host}:{srv.port}"
        return srv

    def sampling_params(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "temperature": c.rollout_temperature,
            "top_p": c.rollout_top_p,
            "top_k": c.rollout_top_k,
            "max_new_tokens": c.rollout_max_response_len,
            "stop": list(c.rollout_stop),
            "stop_token_ids": self.stop_token_ids,
        }

    # ------------------------------------------------------------------ public
    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Samples of one rollout, in group order (n consecutive samples per prompt)."""
        if self.rollout_fn is not None:
            return self._generate_with_rollout_fn(rollout_id)
        c, t0 = self.cfg, time.time()
        want = c.rollout_batch_size
        per_round = c.over_sampling_batch_size or want
        kept = self.take_from_buffer(rollout_id, want)
        generated = list(
            kept
        )  # every group of the rollout, dropped ones too (--rollout-all-samples-process-path)
        drops: dict[str, int] = {}
        rounds = 0
        if self.partial is not None:  # --partial-rollout: groups taken as they finish, the rest aborted
            kept, generated, drops = self.partial.collect(rollout_id, kept)
        while len(kept) < want:
            rounds += 1
            if rounds > 50:
                raise RuntimeError(
                    f"dynamic sampling kept {len(kept)}/{want} groups after 50 rounds; "
                    "the filter rejects almost everything (is the reward constant?)"
                )
            records = self._within_prompt_len(self.data_source.get_samples(per_round), drops)
            groups = self._generate_groups(rollout_id, records, rounds)
            flat = [s for g in groups for s in g]
            for k, s in enumerate(flat):  # provisional ids (rewards such as `random` key on them)
                s.rollout_id, s.index = rollout_id, (rounds - 1) * len(flat) + k
            self._score(flat)
            generated += groups
            survivors, d = filter_hub.apply_dynamic_filter(c, groups)
            for k, v in d.items():
                drops[k] = drops.get(k, 0) + v
            kept += survivors
        self.buffer += kept[want:]
        samples = self.finalize(rollout_id, kept[:want], generated)
        metrics = self._metrics(samples, drops, time.time() - t0)
        return samples, metrics

    def _score(self, samples: list[Sample]) -> None:
        """The run's reward for every sample a generate function left unscored (an agent's reward stays)."""
        preset = {id(s) for s in samples if s.reward is not None} if self.generate_fn is not None else set()
        if preset and self.rewards.group_rm:  # the group RM scores whole groups: it cannot keep some
            raise ConfigError(
                "--group-rm scores every sample of a group, but the generate function (or agent) set "
                f"the reward of {len(preset)} samples itself: drop --group-rm or the function's reward"
            )
        rm_hub.compute_rewards(self.rewards, [s for s in samples if id(s) not in preset])
        for s in samples:
            if id(s) in preset:
                s.raw_reward = s.scalar_reward(self.rewards.reward_key)

    def unfinished_records(self) -> list[PromptRecord]:
        """The prompts of buffered groups (generated, not trained): a checkpoint puts them back."""
        return [record_of(g) for g in self.buffer]

    def take_from_buffer(self, rollout_id: int, num: int) -> list[list[Sample]]:
        """Up to `num` groups from the buffer, chosen by --buffer-filter-path (which pops them)."""
        if not self.buffer or num <= 0:
            return []
        return list(self.buffer_filter(self.cfg, rollout_id, self.buffer, num))[:num]

    def _within_prompt_len(self, records: list[PromptRecord], drops: dict[str, int]) -> list[PromptRecord]:
        """--rollout-max-prompt-len: drop longer prompts (counted as rollout/dynamic_filter/drop_prompt_too_long)."""
        limit = self.cfg.rollout_max_prompt_len
        if not limit:
            return records
        kept = [r for r in records if self.prompt_len(r) <= limit]
        if len(kept) < len(records):
            drops["prompt_too_long"] = drops.get("prompt_too_long", 0) + len(records) - len(kept)
        return kept

    def finalize(
        self, rollout_id: int, groups: list[list[Sample]], generated: list[list[Sample]] | None = None
    ) -> list[Sample]:
        """Run the per-sample filter, then --rollout-all-samples-process-path over every group
        `generated` (as Miles: the ones dynamic sampling dropped too), number the samples in group
        order, mask removed and failed ones."""
        filter_hub.apply_rollout_sample_filter(self.cfg, groups)
        if self.all_samples_process is not None:
            self.all_samples_process(self.args, generated or groups, self.data_source)
        samples: list[Sample] = []
        for gi, group in enumerate(groups):
            for s in group:
                s.rollout_id, s.group_index, s.index = rollout_id, gi, len(samples)
                if s.status == Status.FAILED.value:  # a broken tool is no signal about the policy
                    s.remove_sample = True
                if s.remove_sample:
                    s.loss_mask = [0] * len(s.response_tokens)
                samples.append(s)
        if self.opd is not None:  # the teachers score what is trained, after every filter
            self._opd_metrics = self.opd.score(samples)
        for s in samples:  # one NaN reward or log-prob must not reach the weights: out of the loss
            if (bad := s.nonfinite_field()) is not None:
                s.remove_sample, s.loss_mask = True, [0] * len(s.response_tokens)
                s.metadata["nonfinite"] = bad
            self._fail_out_of_vocab(s)
        return samples

    def _fail_out_of_vocab(self, s: Sample) -> None:
        """A token id the model has no embedding for (a generate function's bug) fails its sample
        only: removed from the loss, the ids recorded in metadata.oov_token_ids and replaced by EOS
        so the trainer's forward can run the batch (it raised IndexError for the whole run)."""
        v = self.vocab_size
        if v is None or all(0 <= t < v for t in (*s.prompt_tokens, *s.response_tokens)):
            return
        eos = self.tok.eos_token_id
        bad = sorted({t for t in (*s.prompt_tokens, *s.response_tokens) if not 0 <= t < v})
        s.prompt_tokens = [t if 0 <= t < v else eos for t in s.prompt_tokens]
        s.response_tokens = [t if 0 <= t < v else eos for t in s.response_tokens]
        s.status, s.remove_sample, s.loss_mask = Status.FAILED.value, True, [0] * len(s.response_tokens)
        s.metadata["oov_token_ids"] = bad[:16]

    # ------------------------------------------------------------------ generation
    def _generate_groups(self, rollout_id: int, records: list[PromptRecord], rnd: int) -> list[list[Sample]]:
        """One batched `/generate` for every sample of the round (SGLang's list form)."""
        c, n = self.cfg, self.cfg.n_samples_per_prompt
        prompts = [self._prompt_ids(rec) for rec in records]
        seeds = [
            [hash((c.seed, rollout_id, rnd, gi, k)) % (2**31) for k in range(n)] for gi in range(len(records))
        ]
        return self.generate_groups(records, prompts, seeds)

    def prompt_len(self, rec: PromptRecord) -> int:
        """The prompt's token count as generated and trained: image pads expanded (Miles counts the
        processor's input_ids), what --rollout-max-prompt-len compares."""
        return len(self._prompt_ids(rec))

    def _prompt_ids(self, rec: PromptRecord) -> list[int]:
        """The prompt's token ids; with images, each image's pad expanded (models/vlm.py), as trained."""
        ids = self.tok.encode(rec.prompt, add_special_tokens=False)
        if not rec.images:
            return ids
        return self._prompt_vision().expand(ids, rec.images)

    def _prompt_vision(self):
        """The checkpoint's PromptVision (image processor + config), loaded once."""
        if self._vision is None:
            from miles_platform.models.vlm import PromptVision

            self._vision = PromptVision(self.cfg.hf_checkpoint)
        return self._vision

    def _images(self, records, seeds) -> list | None:
        """image_data of a batched request: one entry per sample (None: no prompt has images)."""
        if not any(rec.images for rec in records):
            return None
        return [rec.images or None for rec, ss in zip(records, seeds, strict=True) for _ in ss]

    def generate_groups(
        self, records: list[PromptRecord], prompts: list[list[int]], seeds: list[list[int]]
    ) -> list[list[Sample]]:
        """Group gi = len(seeds[gi]) samples of records[gi], all in one batched request."""
        if not records:
            return []
        if self.generate_fn is not None:
            return self.client.submit(self._per_sample(records, prompts, seeds)).result()
        outs = self.client.generate(
            *self._batch(prompts, seeds),
            return_sampling_mask=self.replay,
            top_logprobs_num=self.top_logprobs_num,
            return_routed_experts=self.moe_shape is not None,
            sampling_logprobs_mode=self.logprobs_mode,
            image_data=self._images(records, seeds),
        )
        return self._groups_from(records, prompts, seeds, outs, routes=self.moe_shape is not None)

    async def agenerate_groups(self, records, prompts, seeds) -> list[list[Sample]]:
        """`generate_groups` for code running on its own event loop (the fully async worker)."""
        if not records:
            return []
        if self.generate_fn is not None:
            return await asyncio.wrap_future(self.client.submit(self._per_sample(records, prompts, seeds)))
        outs = await self.client.agenerate(
            *self._batch(prompts, seeds),
            return_sampling_mask=self.replay,
            top_logprobs_num=self.top_logprobs_num,
            return_routed_experts=self.moe_shape is not None,
            sampling_logprobs_mode=self.logprobs_mode,
            image_data=self._images(records, seeds),
        )
        return self._groups_from(records, prompts, seeds, outs, routes=self.moe_shape is not None)

    @property
    def streams(self) -> bool:
        """Whether `agenerate_groups_streamed` can serve: the run's own embedded engines (they send
        each prompt's result as it finishes) and no --custom-generate-function-path."""
        return self.generate_fn is None and self.cfg.embedded_engines_only

    async def agenerate_groups_streamed(self, records, prompts, seeds, on_sample) -> None:
        """Groups gi = len(seeds[gi]) samples of records[gi] as one batched, streamed request (each
        group's samples prefilled together): `on_sample(gi, k, sample)` on this loop as sample k of
        group gi (of `seeds[gi][k]`) finishes."""
        where = [(gi, k) for gi, ss in enumerate(seeds) for k in range(len(ss))]
        routes = self.moe_shape is not None

        def got(i: int, out: dict) -> None:
            gi, k = where[i]
            on_sample(gi, k, self._to_sample(records[gi], prompts[gi], out, 0, routes))  # a group of its own

        await self.client.astream(
            *self._batch(prompts, seeds), got,
            return_sampling_mask=self.replay, top_logprobs_num=self.top_logprobs_num,
            return_routed_experts=routes, sampling_logprobs_mode=self.logprobs_mode,
            image_data=self._images(records, seeds),
        )  # fmt: skip

    async def _per_sample(
        self, records, prompts, seeds, evaluation: bool = False, params: dict | None = None
    ) -> list[list[Sample]]:
        """--custom-generate-function-path once per sample, concurrently, on the client's loop."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.cfg.rollout_max_concurrency)
        base = params or self.sampling_params()
        timeout = self.cfg.custom_generate_function_timeout or None

        async def one(rec: PromptRecord, prompt_ids: list[int], gi: int, seed: int) -> Sample:
            sample = self._new_sample(rec, prompt_ids, gi)
            inp = GenerateFnInput(self.state, sample, {**base, "sampling_seed": seed}, evaluation)
            async with self._slots:
                try:
                    out = await asyncio.wait_for(self.generate_fn(inp), timeout)
                except TimeoutError:  # a hung function fails its own sample, not the run
                    return self._timed_out(sample, timeout)
                except Exception as e:
                    raise UserFunctionError(
                        f"{GENERATE_FLAG} {self.cfg.custom_generate_function_path} raised on prompt "
                        f"{rec.id!r}: {type(e).__name__}: {e}"
                    ) from e
            # agentic: max_new_tokens is per chat request; the session is bounded by --max-seq-len
            budget = None if self.agentic else int(base.get("max_new_tokens", 0))
            return self._generated(out, budget, evaluation)

        try:  # the first failure cancels the rest
            async with asyncio.TaskGroup() as tg:
                tasks = [[tg.create_task(one(rec, p, gi, s)) for s in ss]
                         for gi, (rec, p, ss) in enumerate(zip(records, prompts, seeds, strict=True))]  # fmt: skip
        except ExceptionGroup as eg:
            if self.agentic:  # the episodes still running were cancelled: the agent's teardown hook
                from miles_platform.rollout.generate_hub.agentic_tool_call import call_abort_hook

                await call_abort_hook(self.args)
            raise eg.exceptions[0] from None
        return [[t.result() for t in group] for group in tasks]

    def _timed_out(self, sample: Sample, timeout: float) -> Sample:
        """The sample of a generate call cancelled after `timeout` s: failed, out of the loss, one
        EOS as its response so the batch keeps its shape (counted in rollout/failed)."""
        eos = self.tok.eos_token_id
        sample.response, sample.response_tokens = "", [eos]
        sample.rollout_log_probs, sample.loss_mask = [0.0], [0]
        sample.status, sample.remove_sample = Status.FAILED.value, True
        sample.metadata["generate_error"] = (
            f"{GENERATE_FLAG} {self.cfg.custom_generate_function_path} did not return within "
            f"{timeout:g} s (--custom-generate-function-timeout): cancelled, its sample failed"
        )
        return sample

    def _generated(self, out: Any, budget: int | None, evaluation: bool = False) -> Sample:
        """The one Sample a generate function made, checked (with its routes under R3, when
        training), within the response budget."""
        path = self.cfg.custom_generate_function_path
        samples = out.samples if isinstance(out, GenerateFnOutput) else out
        if isinstance(samples, list):
            if len(samples) != 1:
                raise ConfigError(
                    f"{GENERATE_FLAG} {path!r} returned {len(samples)} samples for one: a generate function "
                    "must give exactly one Sample here (the batch invariant counts samples per prompt)"
                )
            samples = samples[0]
        s = generate_hub.check_sample(samples, GENERATE_FLAG, path)
        if budget is not None:
            truncate(s, budget, self.tok)
        if self.moe_shape is not None and not evaluation:
            generate_hub.check_routes(s, GENERATE_FLAG, path, self.moe_shape)
        return s

    def _batch(self, prompts, seeds) -> tuple[list[list[int]], list[dict]]:
        base = self.sampling_params()
        ids = [p for p, ss in zip(prompts, seeds, strict=True) for _ in ss]
        return ids, [{**base, "sampling_seed": s} for ss in seeds for s in ss]

    def _groups_from(
        self, records, prompts, seeds, outs: list[dict], routes: bool = False
    ) -> list[list[Sample]]:
        if len(outs) != sum(map(len, seeds)):
            raise RuntimeError(f"/generate answered {len(outs)} results for {sum(map(len, seeds))} prompts")
        groups, it = [], iter(outs)
        for gi, (rec, p, ss) in enumerate(zip(records, prompts, seeds, strict=True)):
            groups.append([self._to_sample(rec, p, next(it), gi, routes) for _ in ss])
        return groups

    def _to_sample(
        self, rec: PromptRecord, prompt_ids: list[int], out: dict, gi: int, routes=False
    ) -> Sample:
        s = self._new_sample(rec, prompt_ids, gi)
        finish = append_output(s, out, self.replay, self.moe_shape if routes else None, self.topk)
        s.status = finish_status(finish)
        return s

    def _new_sample(self, rec: PromptRecord, prompt_ids: list[int], gi: int) -> Sample:
        """A sample of `rec` before generation: prompt set, response empty."""
        return Sample(
            run=self.cfg.run_name,
            group_index=gi,
            prompt=rec.prompt,
            prompt_tokens=list(prompt_ids),
            label=rec.label,
            metadata={**rec.metadata, "prompt_id": rec.id},
            image_data=list(rec.images) or None,
        )

    # ------------------------------------------------------------------ --rollout-function-path
    def _generate_with_rollout_fn(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """The user's rollout: its groups are checked, unscored samples get the run's reward, and the
        per-sample filter and numbering apply as for the default rollout."""
        c, t0, path = self.cfg, time.time(), self.cfg.rollout_function_path
        out = self.rollout_fn(rollout_id)
        if inspect.isawaitable(out):
            out = self.client.submit(_awaited(out)).result()
        extra = {}
        if isinstance(out, RolloutFnTrainOutput):
            out, extra = out.samples, dict(out.metrics or {})
        n, want = c.n_samples_per_prompt, c.rollout_batch_size
        shape = (
            [len(g) if isinstance(g, list) else type(g).__name__ for g in out]
            if isinstance(out, list)
            else None
        )
        if shape != [n] * want:
            raise ConfigError(
                f"{ROLLOUT_FLAG} {path!r} returned {shape or type(out).__name__} (group sizes): expected "
                f"--rollout-batch-size={want} groups of --n-samples-per-prompt={n} Samples "
                "(list[list[Sample]] or RolloutFnTrainOutput)"
            )
        groups = [[generate_hub.check_sample(s, ROLLOUT_FLAG, path, self.moe_shape) for s in g] for g in out]
        for k, s in enumerate(s for g in groups for s in g):  # provisional ids (as the default rollout)
            s.rollout_id, s.index = rollout_id, k
        unscored = [s for g in groups for s in g if s.reward is None]
        if unscored:
            if not (c.rm_type or c.custom_rm_path):
                raise ConfigError(
                    f"{ROLLOUT_FLAG} {path!r} returned samples without a reward and no --rm-type or "
                    "--custom-rm-path is set: score them in the function or configure a reward"
                )
            rm_hub.compute_rewards(self.rewards, unscored)
        for s in (s for g in groups for s in g if s.raw_reward is None):
            s.raw_reward = s.scalar_reward(c.reward_key)
        samples = self.finalize(rollout_id, groups)
        metrics = self._metrics(samples, {}, time.time() - t0)
        metrics.update({k: float(v) for k, v in extra.items() if isinstance(v, int | float)})
        return samples, metrics

    # ------------------------------------------------------------------ metrics
    def _metrics(self, samples: list[Sample], drops: dict[str, int], seconds: float) -> dict[str, float]:
        rewards = np.array([s.raw_reward if s.raw_reward is not None else 0.0 for s in samples])
        finite = np.isfinite(rewards)
        lens = np.array([s.response_length for s in samples])
        lps = [lp for s in samples for lp in s.rollout_log_probs if np.isfinite(lp)]
        m = {
            "rollout/raw_reward": float(rewards[finite].mean()) if finite.any() else 0.0,
            "rollout/nonfinite_samples": float(sum("nonfinite" in s.metadata for s in samples)),
            "rollout/response_len/mean": float(lens.mean()),
            "rollout/response_len/max": float(lens.max()),
            "rollout/truncated": float(np.mean([s.status == Status.TRUNCATED.value for s in samples])),
            "rollout/failed": float(np.mean([s.status == Status.FAILED.value for s in samples])),
            # the engine's (Miles' name); the trainer replaces it with its loss-masked per-sample mean and
            # adds rollout/log_probs, its own (training/rollout_metrics.py)
            "rollout/rollout_log_probs": float(np.mean(lps)) if lps else 0.0,
            "rollout/num_samples": float(len(samples)),
            "rollout/buffer_size": float(len(self.buffer)),
            "perf/rollout_time": seconds,
        }
        m.update(token_perf(samples, seconds, self.rollout_devices))
        m.update(self._opd_metrics)
        self._opd_metrics = {}
        if self.partial is not None:
            m.update(self.partial.metrics(samples))
        if self.cfg.use_fault_tolerance:  # requests in flight on a dead or hung engine: retried, counted
            retries = self.client.retries
            m["rollout/generate_retries"] = float(retries - self._retries_seen)
            self._retries_seen = retries
        n = self.cfg.n_samples_per_prompt
        if n > 1:
            groups = np.where(finite, rewards, np.nan).reshape(-1, n)
            m["rollout/zero_std_groups"] = float(np.mean(np.nan_to_num(np.nanstd(groups, axis=1)) == 0))
        m.update({k: float(v) for k, v in filter_hub.drop_metrics(drops).items()})
        turns = [s.metadata["turns"] for s in samples if isinstance(s.metadata.get("turns"), int)]
        if turns:  # multi-turn episodes (Miles' multi_turn/ namespace)
            m["multi_turn/turns/mean"] = float(np.mean(turns))
            m["multi_turn/turns/max"] = float(max(turns))
            m["multi_turn/tool_calls/mean"] = float(
                np.mean([s.metadata.get("tool_call_count", 0) for s in samples])
            )
            m["multi_turn/with_tool_call"] = float(
                np.mean([s.metadata.get("tool_call_count", 0) > 0 for s in samples])
            )
            calls = [
                c for s in samples for t in s.turns or () if t["role"] == "tool" for c in t["tool_calls"]
            ]
            if calls:
                m["multi_turn/tool_calls/failed"] = float(np.mean([c["error"] is not None for c in calls]))
        return m


def student_top_k(cfg: RunConfig) -> int:
    """top_logprobs_num of rollout requests: k when top-k OPD reads the student's own top-k."""
    from miles_platform.rollout.opd_topk import NEEDS_STUDENT_TOP

    on = cfg.uses_teacher_engine and cfg.opd_top_k_strategy in NEEDS_STUDENT_TOP
    return cfg.opd_log_prob_top_k if on else 0


def router_generate_fn(manager: RolloutManager):
    """An `evaluate(generate_fn=...)` that generates through the run's engines: one batched request,
    or the run's --custom-generate-function-path per sample with `evaluation=True` (as Miles), whose
    Samples it answers as they are (status, metadata such as multi-turn's tool_call_count). Image
    prompts (`images`: per prompt its data URIs or None) go with their pads expanded, as a rollout's."""
    from miles_platform.rollout.evaluate import eval_image_data, eval_requests

    tok = manager.tok

    def generate_fn(prompts, max_new_tokens, temperature, top_p, top_k, n, seed, images=None):
        ids, sps = eval_requests(tok, prompts, max_new_tokens, temperature, top_p, top_k, n, seed)
        images = list(images or [None] * len(prompts))
        if any(images):  # each image's pad expanded, as the rollout's prompts (the same ids either way)
            ids = [manager._prompt_vision().expand(x, images[i // n]) if images[i // n] else x
                   for i, x in enumerate(ids)]  # fmt: skip
        if manager.generate_fn is not None and prompts:
            records = [PromptRecord(id=f"eval-{i}", prompt=p, label=None, metadata={}, images=list(images[i] or []))
                       for i, p in enumerate(prompts)]  # fmt: skip
            params = {k: v for k, v in sps[0].items() if k != "sampling_seed"}
            seeds = [[sp["sampling_seed"] for sp in sps[i * n : (i + 1) * n]] for i in range(len(prompts))]
            run = manager._per_sample(
                records, ids[::n], seeds, evaluation=True, params={**manager.sampling_params(), **params}
            )
            return manager.client.submit(run).result()  # Samples: evaluate grades them with their status
        image_data = eval_image_data(images, n)
        outs = manager.client.generate(ids, sps, return_logprob=False, image_data=image_data) if ids else []
        texts = [o.get("text", "") for o in outs]
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate_fn


async def _awaited(awaitable):
    return await awaitable


def _vocab_size(hf_checkpoint: str | None) -> int | None:
    """The embedding rows of the checkpoint (config.json's vocab_size, or its text_config's)."""
    from miles_platform.models.checkpoint import embedding_rows

    return _checkpoint_field(hf_checkpoint, embedding_rows)


def _checkpoint_field(hf_checkpoint: str | None, read) -> int | None:
    """`read(config.json)` of the checkpoint; None when there is no readable config."""
    import json
    import os

    try:
        with open(os.path.join(hf_checkpoint or "", "config.json")) as f:
            return read(json.load(f))
    except (OSError, ValueError):
        return None


def token_perf(samples: list[Sample], seconds: float, devices: int) -> dict[str, float]:
    """Miles' generation throughput keys (miles/ray/rollout/metrics.py): response tokens per rollout
    device per second over the rollout's wall time, and the longest sample's tokens per second; the
    `effective_` ones count only trained tokens (the loss mask: a multi-turn tool result is not).
    No per-device key without rollout devices of the run's own (external engines), as Miles."""
    if not samples or seconds <= 0:
        return {}
    out = {}
    for key, lengths in (
        ("", [s.response_length for s in samples]),
        ("effective_", [sum(s.loss_mask) if s.loss_mask else s.response_length for s in samples]),
    ):
        if devices:
            out[f"perf/{key}tokens_per_gpu_per_sec"] = sum(lengths) / seconds / devices
        out[f"perf/longest_{key}sample_tokens_per_sec"] = max(lengths) / seconds
    return out


def _is_vlm(cfg) -> bool:
    """A vision-language checkpoint: image prompts, or images a session's messages or tools bring."""
    from pathlib import Path

    return bool(cfg.image_keys()) or (Path(str(cfg.hf_checkpoint)) / "preprocessor_config.json").exists()
