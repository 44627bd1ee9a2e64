"""On-policy distillation, sglang mode (`--use-opd --opd-type sglang`, docs/opd.md): teachers score
the student's rollouts, the trainer subtracts the reverse KL from the advantages.

After a rollout's samples are final, every sample goes to one teacher, chosen by
`sample.metadata[--opd-teacher-key]` in the `--opd-teacher-urls` map (reserved name `default` is
the fallback; without it an unknown or missing name is an error, never a silent wrong teacher);
without a map the one teacher is `--rm-url` or the engine the run started from
`--opd-teacher-hf-checkpoint`. Each teacher gets ONE batched prefill-only `/generate` (SGLang's
list form: input_ids = prompt + response, max_new_tokens 0, return_logprob, logprob_start_len), so
a rollout costs a request per teacher, not per sample.

  --opd-log-prob-top-k 0   sample.teacher_log_probs = the teacher's log-prob of each response token
  --opd-log-prob-top-k k   sample.opd_reverse_kl = the top-k estimate (rollout/opd_topk.py) from the
                           student's rollout top-k, the teacher's top-k (top_logprobs_num) and
                           cross-scoring (token_ids_logprob; the student side goes to the student engine)

Teachers must share the student's tokenizer: scoring sends token ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from miles_platform.config.opd import DEFAULT_TEACHER
from miles_platform.data.sample import Sample
from miles_platform.errors import MilesError
from miles_platform.rollout import opd_topk


class TeacherRoutingError(MilesError, ValueError):
    """A sample names no configured teacher and there is no `default` one."""


def route(samples: Sequence[Sample], urls: dict[str, str], key: str) -> dict[str, list[int]]:
    """{url: indices of the samples it scores}, by sample.metadata[key]."""
    out: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        name = (s.metadata or {}).get(key)
        if name in urls:
            url = urls[name]
        elif DEFAULT_TEACHER in urls:
            url = urls[DEFAULT_TEACHER]
        else:
            what = f"has no metadata key {key!r}" if name is None else f"names teacher {name!r}"
            raise TeacherRoutingError(
                f"sample {s.index} (prompt {s.metadata.get('prompt_id')!r}) {what}, which is none of "
                f"--opd-teacher-urls {sorted(urls)}; add a `default=URL` entry or tag the prompt "
                f"(--opd-teacher-key {key})"
            )
        out.setdefault(url, []).append(i)
    return out


def score_payload(samples: Sequence[Sample], temperature: float, top_k: int = 0,
                  token_ids: list[list[int]] | None = None) -> dict:  # fmt: skip
    """One batched prefill-only scoring request for `samples` (SGLang's `/generate` fields). The
    temperature is the rollout's: the embedded engine scores log_softmax(z / T) as the student was
    sampled (SGLang's input log-probs are at T = 1; they agree at the usual T = 1)."""
    body = {
        "input_ids": [s.tokens for s in samples],
        "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        # from the last prompt token on: the response's entries are the last R whatever the
        # server's convention for the first scored position (SGLang: None only at position 0)
        "logprob_start_len": [max(len(s.prompt_tokens) - 1, 0) for s in samples],
    }
    if top_k > 0:
        body["top_logprobs_num"] = top_k
    if token_ids is not None:
        body["token_ids_logprob"] = token_ids
    return body


def response_tail(out: dict, field: str, sample: Sample, url: str) -> list:
    """The response span of one `meta_info` field: its last response_length entries."""
    values = (out.get("meta_info") or {}).get(field)
    n = sample.response_length
    if values is None or len(values) < n:
        got = "no" if values is None else f"{len(values)} entries of"
        raise RuntimeError(
            f"teacher {url}: {got} meta_info.{field} for sample {sample.index} ({n} response tokens); "
            "the server must answer prefill-only scoring (SGLang, or miles-platform serve-engine)"
        )
    return list(values[len(values) - n :]) if n else []


class TeacherScorer:
    """Scores a rollout's samples with their teachers; sets teacher_log_probs or opd_reverse_kl."""

    def __init__(self, cfg, urls: dict[str, str], student_url: str, client, student_lora=None):
        """`client`: the run's EngineClient (its event loop and connection pool); `student_lora`: the
        LoRA adapter (name or AdapterName) the student's rollouts were served with (its scoring uses it too)."""
        self.cfg, self.urls, self.student_url, self.client = cfg, urls, student_url, client
        self._student_lora = student_lora
        self.top_k, self.strategy = cfg.opd_log_prob_top_k, cfg.opd_top_k_strategy

    def score(self, samples: list[Sample]) -> dict[str, float]:
        t0 = time.time()
        todo = [s for s in samples if s.response_length and not s.remove_sample]
        for s in samples:  # nothing to distill in an empty or removed response
            if not s.response_length or s.remove_sample:
                s.rollout_topk_token_ids = s.rollout_topk_log_probs = None  # OPD's only, not shard data
        if todo:
            self.client.submit(self._score(todo)).result()
        metrics = {"perf/opd_teacher_time": time.time() - t0}
        lps = [
            lp for s in todo if s.teacher_log_probs for lp, m in zip(s.teacher_log_probs, s.loss_mask) if m
        ]
        if lps:
            metrics["opd/teacher_log_probs"] = sum(lps) / len(lps)
        return metrics

    async def _score(self, samples: list[Sample]) -> None:
        groups = route(samples, self.urls, self.cfg.opd_teacher_key)
        one = self._sampled_token if self.top_k == 0 else self._top_k
        await asyncio.gather(*(one(url, [samples[i] for i in idx]) for url, idx in groups.items()))

    async def _post(self, url: str, body: dict) -> list[dict]:
        from miles_platform.rollout.client import post_generate

        out = await post_generate(url, body, self.cfg.api_key)
        return out if isinstance(out, list) else [out]

    async def _sampled_token(self, url: str, samples: list[Sample]) -> None:
        outs = await self._post(url, score_payload(samples, self.cfg.rollout_temperature))
        for s, out in zip(samples, outs, strict=True):
            s.teacher_log_probs = [float(e[0]) for e in response_tail(out, "input_token_logprobs", s, url)]

    async def _top_k(self, url: str, samples: list[Sample]) -> None:
        strat, k = self.strategy, self.top_k
        student_top = [self._student_top(s) for s in samples]
        ids = None
        if strat in opd_topk.TEACHER_ON_STUDENT_IDS:
            ids = [sorted({t for m in tops for t in m}) for tops in student_top]
        teacher_k = k if strat in opd_topk.NEEDS_TEACHER_TOP else 0
        outs = await self._post(url, score_payload(samples, self.cfg.rollout_temperature, teacher_k, ids))
        maps = lambda out, f, s, u: [opd_topk.entries_to_map(e) for e in response_tail(out, f, s, u)]  # noqa: E731
        empty = [[{} for _ in range(s.response_length)] for s in samples]
        t_top = [maps(o, "input_top_logprobs", s, url) for o, s in zip(outs, samples)] if teacher_k else empty
        t_on_s = (
            [maps(o, "input_token_ids_logprobs", s, url) for o, s in zip(outs, samples)] if ids else empty
        )
        s_on_t = empty
        if strat in opd_topk.STUDENT_ON_TEACHER_IDS:
            want = [sorted({t for m in tops for t in m}) for tops in t_top]
            body = score_payload(samples, self.cfg.rollout_temperature, token_ids=want)
            from miles_platform.rollout.base_types import resolve_lora

            lora = resolve_lora(self._student_lora)
            if lora is not None:
                body["lora_path"] = lora
            souts = await self._post(self.student_url, body)
            s_on_t = [
                maps(o, "input_token_ids_logprobs", s, self.student_url) for o, s in zip(souts, samples)
            ]
        for i, s in enumerate(samples):
            s.opd_reverse_kl = opd_topk.topk_reverse_kl(
                strat, self.cfg.opd_reward_weight_mode, student_top[i], t_top[i], t_on_s[i], s_on_t[i]
            )

    def _student_top(self, s: Sample) -> list[dict[int, float]]:
        """The student's rollout top-k per response token (`Sample.rollout_topk_*`, recorded from
        meta_info.output_top_logprobs), dropped once read: it is not shard data under OPD."""
        ids, lps = s.rollout_topk_token_ids, s.rollout_topk_log_probs
        s.rollout_topk_token_ids = s.rollout_topk_log_probs = None
        if self.strategy not in opd_topk.NEEDS_STUDENT_TOP:
            return [{} for _ in range(s.response_length)]
        if ids is None or lps is None or len(ids) != s.response_length:
            raise RuntimeError(
                f"--opd-top-k-strategy {self.strategy}: sample {s.index} carries no rollout top-k for each "
                "of its response tokens (the default generate asks the engine for top_logprobs_num; a "
                "custom generate function does not): use --opd-top-k-strategy only-teacher"
            )
        return [
            {int(t): float(lp) for t, lp in zip(a, b, strict=True) if t >= 0}
            for a, b in zip(ids, lps, strict=True)
        ]


def teacher_sources(cfg, urls: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """The teachers a run distills from, for lineage: (checkpoint dir, "checkpoint", content hash)
    when the teacher's weights are on this host (--opd-teacher-load, --opd-teacher-hf-checkpoint, or
    the model_path a teacher engine reports), else (its URL, "teacher_engine", None)."""
    import os

    local = cfg.opd_teacher_load if cfg.opd_type == "megatron" else cfg.opd_teacher_hf_checkpoint
    if local:
        return [_checkpoint_source(local)]
    from miles_platform.rollout.client import get

    out = []
    for url in dict.fromkeys(urls.values()):
        try:
            path = get(url.rstrip("/").removesuffix("/generate"), "/get_model_info", cfg.api_key, timeout=10)
            path = path.get("model_path") if isinstance(path, dict) else None
        except Exception:  # an unreachable teacher fails its first scoring request, loudly
            path = None
        local = isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json"))
        out.append(_checkpoint_source(path) if local else (url, "teacher_engine", None))
    return out


def _checkpoint_source(path: str) -> tuple[str, str, str | None]:
    import os

    from miles_platform.models.checkpoint import content_hash

    path = os.path.abspath(path)
    hf = os.path.isfile(os.path.join(path, "config.json"))
    return path, "checkpoint", content_hash(path) if hf else None
