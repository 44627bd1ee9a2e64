"""The fully async worker and its data buffer against a stand-in SGLang engine on loopback that
counts what is in flight: the concurrency flags bound it, a checkpointed buffer is restored on a
relaunch without generating its groups again, aborted and too stale groups are dropped or retried,
and a custom buffer class is loaded and called."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from loop_helpers import RecordingBuffer

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.dataset import PromptRecord
from miles_platform.data.source import RolloutDataSource
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.preflight import validate_before_start
from miles_platform.rollout.async_worker import AsyncRolloutWorker
from miles_platform.rollout.client import EngineHTTPError, stream_generate
from miles_platform.rollout.engine_server import serve_in_thread
from miles_platform.rollout.manager import RolloutManager

PROMPTS = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=", label=str(2 * i), metadata={}) for i in range(60)]


class StubEngine:
    """SGLang's `/generate` (batch form), answering after `delay` s: counts trajectories in flight,
    records every request (prompt ids, seed, request size), serves `version`, and aborts the first
    request for each prompt in `abort_once`. `stream: true` (the embedded engine's, which the
    worker's `sample` granularity uses): each result as an SSE chunk with its index, the first
    sample of each prompt first, the others held until another request arrives (at most `hold_s`).
    `arrivals`: per request, how many streams had sent every sample when it came: a worker that
    frees a slot per finished sample sends the next group before any group is whole."""

    def __init__(self, tok, delay: float = 0.03, hold_s: float = 2.0):
        self.tok, self.delay, self.version, self.hold_s = tok, delay, 0, hold_s
        self.inflight = self.max_inflight = self.streams_done = 0
        self.requests: list[dict] = []  # {"prompt", "seed", "size", "version"} per trajectory
        self.arrivals: list[int] = []
        self.abort_once: set[str] = set()
        self._arrived = asyncio.Event()
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            body = await request.json()
            ids, sps = body["input_ids"], body["sampling_params"]
            self.inflight += len(ids)
            self.max_inflight = max(self.max_inflight, self.inflight)
            self.arrivals.append(self.streams_done)
            self._arrived.set()
            if body.get("stream"):
                outs = [self._answer(p, sp, len(ids)) for p, sp in zip(ids, sps, strict=True)]  # recorded now
                return StreamingResponse(self._stream(ids, outs), media_type="text/event-stream")
            try:
                await asyncio.sleep(self.delay)
                return [self._answer(p, sp, len(ids)) for p, sp in zip(ids, sps, strict=True)]
            finally:
                self.inflight -= len(ids)

        self.server = serve_in_thread(app, "127.0.0.1", 0, "stub-engine")

    async def _stream(self, ids, outs):
        first = {tuple(p): i for i, p in reversed(list(enumerate(ids)))}.values()  # each prompt's first
        order = sorted(range(len(ids)), key=lambda i: i not in first)
        await asyncio.sleep(self.delay)
        self._arrived.clear()
        for j, i in enumerate(order):
            if j == len(first):  # the rest wait for the next request (or hold_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), self.hold_s)
            self.inflight -= 1
            yield b"data: " + json.dumps({**outs[i], "index": i}).encode() + b"\n\n"
        self.streams_done += 1
        yield b"data: [DONE]\n\n"

    def _answer(self, prompt_ids, sp, size) -> dict:
        prompt = self.tok.decode(prompt_ids)
        seed = sp["sampling_seed"]
        self.requests.append({"prompt": prompt, "seed": seed, "size": size, "version": self.version})
        toks = [(seed + k) % 200 + 3 for k in range(2)]
        finish = "length"
        if prompt in self.abort_once:
            self.abort_once.discard(prompt)
            finish = "abort"
        meta = {"finish_reason": {"type": finish}, "weight_version": str(self.version),
                "output_token_logprobs": [[-0.5, t, None] for t in toks]}  # fmt: skip
        return {"text": "xx", "meta_info": meta}

    def prompts(self) -> set[str]:
        return {r["prompt"] for r in self.requests}

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def tok(tiny_hf_checkpoint):
    return load_tokenizer(tiny_hf_checkpoint)


@pytest.fixture
def engine(tok):
    e = StubEngine(tok)
    yield e
    e.stop()


def _cfg(ckpt, tmp_path, **kw) -> RunConfig:
    base = dict(hf_checkpoint=ckpt, prompt_data=str(tmp_path / "p.jsonl"), rm_type="math", rollout_batch_size=4,
                n_samples_per_prompt=2, rollout_max_response_len=4, storage_root=str(tmp_path / "root"),
                fully_async=True)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _worker(cfg, tok, engine, state=None, source=None):
    m = RolloutManager(cfg, tok, source or RolloutDataSource(PROMPTS), engine.server.url)
    return m, AsyncRolloutWorker(m, state).start()


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _groups(samples, n=2):
    return [tuple(tuple(s.response_tokens) for s in samples[i : i + n]) for i in range(0, len(samples), n)]


@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_in_flight_trajectories_are_bounded_by_async_max_concurrent_samples(
    tiny_hf_checkpoint, tmp_path, tok, engine, granularity
):
    # 5 // n=2 -> 2 groups = 4 trajectories in flight (rollout batch 4 alone would allow 8)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, async_max_concurrent_samples=5,
               rollout_submission_granularity=granularity, async_data_buffer_capacity_factor=4.0)  # fmt: skip
    m, w = _worker(cfg, tok, engine)
    try:
        for rid in range(2):
            samples, _ = w.get_rollout(rid, 0)
            assert len(samples) == 8
    finally:
        w.stop()
        m.close()
    assert engine.max_inflight == 4
    if granularity == "group":  # one batched request per group (n = 2), its slots freed when it returns
        assert {r["size"] for r in engine.requests} == {2}
    else:  # the groups that can go out as one streamed request, a slot freed per finished sample:
        # the next group goes out before any group is whole
        assert engine.requests[0]["size"] == 4 and engine.arrivals[1] == 0
        assert len(engine.arrivals) < len(engine.requests) / 2


def test_the_default_in_flight_cap_is_the_rollout_batch_and_sample_granularity(
    tiny_hf_checkpoint, tmp_path, tok, engine
):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, rollout_batch_size=2, async_data_buffer_capacity_factor=4.0)
    m, w = _worker(cfg, tok, engine)
    try:
        w.get_rollout(0, 0)
        _wait(lambda: len(engine.requests) >= 16)
    finally:
        w.stop()
        m.close()
    assert engine.max_inflight == 4 and engine.requests[0]["size"] == 4
    assert engine.arrivals[1] == 0  # sample granularity: slots freed per finished sample


def test_a_checkpointed_buffer_is_restored_on_relaunch_and_no_group_is_generated_twice(
    tiny_hf_checkpoint, tmp_path, tok, engine
):
    # capacity 1 x 4 groups: after one rollout the worker fills the buffer and blocks
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, async_data_buffer_capacity_factor=1.0)
    src = RolloutDataSource(PROMPTS)
    m, w = _worker(cfg, tok, engine, source=src)
    try:
        first, _ = w.get_rollout(0, 0)
        _wait(lambda: len(w.buffer.state_dict()["entries"]) == 4 and w._finished)
        time.sleep(0.2)  # the worker is blocked on the full buffer
        ds, state = w.checkpoint_state()
    finally:
        w.stop()
        m.close()
    ds, state = json.loads(json.dumps(ds)), json.loads(json.dumps(state))  # as trainer_state.json holds it
    buffered = [e["samples"] for e in sorted(state["buffer"]["entries"], key=lambda e: e["uid"])]
    finished = [e["samples"] for e in state["finished"]]
    assert len(buffered) == 4 and finished
    restored_prompts = {g[0]["prompt"] for g in buffered + finished}
    pending = {r["prompt"] for r in ds.get("pending", [])}  # in flight at the checkpoint: regenerated
    trained = {s.prompt for s in first}
    handed_out = {p.prompt for p in PROMPTS[: ds["offset"]]}
    assert trained | restored_prompts | pending == handed_out
    assert not (trained & restored_prompts) and not (restored_prompts & pending)
    # relaunch: a fresh engine log, data source and worker from the checkpoint
    engine.requests.clear()
    src2 = RolloutDataSource(PROMPTS)
    src2.load_state_dict(ds)
    m2, w2 = _worker(cfg, tok, engine, state=state, source=src2)
    try:
        second, metrics = w2.get_rollout(1, 0)
        third, _ = w2.get_rollout(2, 0)
        # what was in flight at the checkpoint is generated again: first of the data source, once
        # the restored finished groups no longer fill the buffer (streamed groups finish early, so
        # there may be enough of them for the third rollout too)
        _wait(lambda: pending <= engine.prompts())
    finally:
        w2.stop()
        m2.close()
    assert _groups(second) == [tuple(tuple(s["response_tokens"]) for s in g) for g in buffered]
    assert [s.prompt for s in second[::2]] == [g[0]["prompt"] for g in buffered]
    assert not engine.prompts() & restored_prompts  # none of them generated again
    k = min(4, len(finished))  # the finished groups are offered to the buffer first, in order
    assert [s.prompt for s in third[::2]][:k] == [g[0]["prompt"] for g in finished[:k]]
    assert metrics["rollout/fully_async/queue_size"] >= 0


@pytest.mark.parametrize("handler", ["drop", "retry"])
def test_aborted_and_too_stale_groups_go_to_the_unused_samples_handler(
    tiny_hf_checkpoint, tmp_path, tok, engine, handler
):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, max_weight_staleness=1, async_unused_samples_handler=handler,
               async_data_buffer_capacity_factor=1.0)  # fmt: skip
    engine.abort_once = {PROMPTS[0].prompt}
    m, w = _worker(cfg, tok, engine)
    try:
        first, m1 = w.get_rollout(0, 0)
        assert m1["rollout/fully_async/aborted_groups_filtered"] == 1
        if PROMPTS[0].prompt in {s.prompt for s in first}:  # only as a retry that finished in time
            assert handler == "retry" and sum(r["prompt"] == PROMPTS[0].prompt for r in engine.requests) > 2
        _wait(lambda: len(w.buffer.state_dict()["entries"]) == 4)
        stale = [e["samples"][0]["prompt"] for e in w.buffer.state_dict()["entries"]]
        engine.version = 3  # a weight update: the buffered groups (version 0) lag by 3 > 1
        second, m2 = w.get_rollout(1, 3)
        third, _ = w.get_rollout(2, 3)
    finally:
        w.stop()
        m.close()
    assert m2["rollout/fully_async/stale_groups_filtered"] >= 4
    assert all(s.weight_version_start == 3 for s in second + third)
    assert m2["rollout/fully_async/max_staleness"] <= 1
    regenerated = {r["prompt"] for r in engine.requests if r["version"] == 3}
    aborted_again = [r for r in engine.requests if r["prompt"] == PROMPTS[0].prompt]
    if handler == "retry":  # the aborted and the stale prompts are generated again
        assert set(stale) <= regenerated and len(aborted_again) > 2
    else:
        assert not set(stale) & regenerated and len(aborted_again) == 2


def test_a_custom_data_buffer_is_loaded_and_called(tiny_hf_checkpoint, tmp_path, tok, engine):
    RecordingBuffer.calls.clear()
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_async_data_buffer_path="loop_helpers.RecordingBuffer")
    m, w = _worker(cfg, tok, engine)
    try:
        samples, metrics = w.get_rollout(0, 7)
        _, state = w.checkpoint_state()
    finally:
        w.stop()
        m.close()
    assert isinstance(w.buffer, RecordingBuffer) and metrics["custom/buffer_calls"] > 0
    names = [c[0] for c in RecordingBuffer.calls]
    assert {"put", "get", "get_metrics", "state_dict"} <= set(names)
    assert ("get", 4, 7) in RecordingBuffer.calls and state["buffer"]["recorded"] is True


def test_buffer_flags_are_refused_where_they_have_no_effect(tiny_hf_checkpoint, tmp_path):
    for kw, match in (
        (dict(fully_async=False, async_max_concurrent_samples=4), "--async-max-concurrent-samples 4"),
        (dict(fully_async=False, async_data_buffer_capacity_factor=3.0), "capacity-factor"),
        (dict(fully_async=False, rollout_submission_granularity="sample"), "granularity sample"),
        (dict(over_sampling_batch_size=8), "--over-sampling-batch-size 8"),
        (dict(async_data_buffer_capacity_factor=0.0), "must be > 0"),
    ):
        with pytest.raises(ConfigError, match=match):
            _cfg(tiny_hf_checkpoint, tmp_path, **kw)
    _cfg(tiny_hf_checkpoint, tmp_path, fully_async=False, rollout_submission_granularity="group")
    for path, match in (("loop_helpers.write_prompts", "subclass of"), ("loop_helpers.Nope", "no attribute")):
        cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_async_data_buffer_path=path,
                   prompt_data=str(tmp_path / "x.jsonl"))  # fmt: skip
        with pytest.raises(ConfigError, match=f"--custom-async-data-buffer-path.*{match}"):
            validate_before_start(cfg)


def test_rollout_max_prompt_len_drops_long_prompts_in_the_worker(tiny_hf_checkpoint, tmp_path, tok, engine):
    limit = len(tok.encode("9+9=", add_special_tokens=False))
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, rollout_max_prompt_len=limit)
    m, w = _worker(cfg, tok, engine, source=RolloutDataSource(PROMPTS[8:12] + PROMPTS[:8]))
    try:
        samples, metrics = w.get_rollout(0, 0)
    finally:
        w.stop()
        m.close()
    assert all(len(s.prompt_tokens) <= limit for s in samples)
    # 10+10= and 11+11= once per pass over the 12 prompts: the worker keeps fetching for the next
    # rollout while this one is taken, so under load it may have started the next pass (4)
    dropped = metrics["rollout/dynamic_filter/drop_prompt_too_long"]
    assert dropped >= 2 and dropped % 2 == 0, dropped
    assert all(len(tok.encode(p, add_special_tokens=False)) <= limit for p in engine.prompts())


def test_a_streamed_group_resends_only_the_samples_without_a_result():
    """`stream_generate`: a retryable error chunk or a stream cut short resends those prompts only;
    a non-retryable error chunk fails the call."""
    bodies: list[dict] = []
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        ids = body["input_ids"]
        if ids == [[7]]:  # a refusal of the whole request (a bad body, a wrong secret): its status
            return JSONResponse({"error": {"message": "bad body"}}, status_code=400)
        bodies.append(body)

        def chunks():
            for i, p in enumerate(ids):
                if p == [2] and len(bodies) == 1:
                    break  # the first stream ends before prompt [2]: lost
                if p == [1] and len(bodies) == 1:
                    out = {"error": {"message": "paused", "retryable": True, "status": 503}}
                elif p == [9]:
                    out = {"error": {"message": "bad prompt", "status": 400}}
                else:
                    out = {"text": str(p[0]), "meta_info": {"finish_reason": {"type": "length"}}}
                yield b"data: " + json.dumps({**out, "index": i}).encode() + b"\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    server = serve_in_thread(app, "127.0.0.1", 0, "stub-stream")
    got: list[tuple[int, str]] = []
    try:
        sps = [{"sampling_seed": k} for k in range(3)]
        asyncio.run(stream_generate(server.url, [[0], [1], [2]], sps, lambda i, o: got.append((i, o["text"])),
                                    backoff_s=0.01))  # fmt: skip
        assert sorted(got) == [(0, "0"), (1, "1"), (2, "2")]
        assert [b["input_ids"] for b in bodies] == [[[0], [1], [2]], [[1], [2]]]
        assert [p["sampling_seed"] for p in bodies[1]["sampling_params"]] == [1, 2]  # each its own seed
        with pytest.raises(EngineHTTPError, match="bad prompt"):
            asyncio.run(stream_generate(server.url, [[0], [9]], sps[:2], lambda i, o: None, backoff_s=0.01))
        # raised as the engine's answer (it was a TypeError: a second `_parse_bytes` shadowed the first)
        with pytest.raises(EngineHTTPError, match="400.*bad body"):
            asyncio.run(stream_generate(server.url, [[7]], sps[:1], lambda i, o: None, backoff_s=0.01))
    finally:
        server.stop()
