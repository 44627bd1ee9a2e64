"""--partial-rollout: the engine seeds by absolute position and aborts with partial outputs; the rollout
manager keeps what over-sampling aborts and continues it in the next rollout exactly as an uninterrupted
seeded generation, log-probs and weight versions stitched, the older policy's tokens masked; the partial
store survives a checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest
import torch
from engine_hooks import HoldScheduler

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample, Status
from miles_platform.data.source import RolloutDataSource
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.manager import RolloutManager
from miles_platform.rollout.partial_rollout import token_versions

BUDGET = 16


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint):
    torch.set_num_threads(1)
    srv = start_engine_server(tiny_hf_checkpoint, max_batch_size=2)  # a group of 2 fills the batch
    yield srv
    srv.stop()


def _lps(out: dict) -> list[float]:
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def test_a_continued_request_draws_the_uninterrupted_tokens(engine):
    """Seeded by (seed, absolute position): prompt + the first 5 tokens as input gives tokens 6..12."""
    core, prompt = engine.core, [5, 6, 7, 8]
    sp = {"temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    full = core.generate(prompt, {**sp, "max_new_tokens": 12})
    head = core.generate(prompt, {**sp, "max_new_tokens": 5})
    tail = core.generate(prompt + head["output_ids"], {**sp, "max_new_tokens": 7})
    assert head["output_ids"] + tail["output_ids"] == full["output_ids"]
    assert torch.allclose(torch.tensor(_lps(head) + _lps(tail)), torch.tensor(_lps(full)), atol=1e-5)


def test_abort_request_answers_at_once_with_the_partial_output(engine):
    core, prompt = engine.core, [9, 10, 11]
    sp = {"temperature": 1.0, "sampling_seed": 4, "ignore_eos": True, "max_new_tokens": BUDGET}
    full = core.generate(prompt, sp)
    with HoldScheduler(core, lambda c: any(r.output_tokens >= 3 for r in c.running())) as held:
        fut = core.submit(prompt, sp)
        held.wait()  # mid-generation: 3 tokens out, the scheduler parked
        r = httpx.post(f"{engine.url}/abort_request", json={"abort_all": True}, timeout=10)
        assert r.status_code == 200 and r.json()["aborted"] == 1
        out = fut.result(10)  # answered while the scheduler is still parked
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == full["output_ids"][:3]
    assert torch.allclose(torch.tensor(_lps(out)), torch.tensor(_lps(full)[:3]), atol=1e-5)
    assert core.generate(prompt, sp)["output_ids"] == full["output_ids"]  # the engine serves on


def _cfg(ckpt, tmp_path, **kw) -> RunConfig:
    return RunConfig(
        hf_checkpoint=ckpt, prompt_data=str(tmp_path / "p.jsonl"), rm_type="math", rollout_batch_size=1,
        n_samples_per_prompt=2, over_sampling_batch_size=2, rollout_max_response_len=BUDGET,
        storage_root=str(tmp_path / "root"), partial_rollout=True, **kw,
    ).validate()  # fmt: skip


def _source() -> RolloutDataSource:
    return RolloutDataSource([PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=", label=str(2 * i), metadata={}) for i in range(6)])  # fmt: skip


def _checkpoint(m: RolloutManager) -> dict:
    """RunServices.checkpoint_state of a sync run around `m`, through JSON (trainer_state.json)."""
    from miles_platform.run_services import RunServices

    s = object.__new__(RunServices)
    s.worker = s.train_only = None
    s.manager, s.src = m, m.data_source
    return json.loads(json.dumps(s.checkpoint_state()))


def _resume(m: RolloutManager, state: dict) -> None:
    from miles_platform.run_services import RunServices

    s = object.__new__(RunServices)
    s.manager, s.src = m, m.data_source
    s._restore_partial_rollout(state.get("partial_rollout") or [])


def test_over_sampling_aborts_keeps_and_continues_like_an_uninterrupted_generation(
    engine, tiny_hf_checkpoint, tmp_path, monkeypatch
):
    from miles_platform.rollout.partial_rollout import PartialRollout

    core, tok = engine.core, load_tokenizer(tiny_hf_checkpoint)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, mask_offpolicy_in_partial_rollout=True)
    m = RolloutManager(cfg, tok, _source(), engine.url)
    try:
        # rollout 0: two groups for one; the first to finish is kept, the other (held at 3 tokens a
        # sample, queued behind the first in a batch of 2) is aborted into the partial store
        finished = core.stats["num_finished_requests"]

        def second_running(c) -> bool:
            return c.stats["num_finished_requests"] >= finished + 2 and any(
                r.output_tokens >= 3 for r in c.running()
            )

        with HoldScheduler(core, second_running) as held:
            abort = PartialRollout._abort

            async def abort_once_held(self, *args):  # the abort lands when the second group is parked
                await asyncio.to_thread(held.wait)
                await abort(self, *args)

            monkeypatch.setattr(PartialRollout, "_abort", abort_once_held)
            samples, metrics = m.generate(0)
            monkeypatch.setattr(PartialRollout, "_abort", abort)
        assert len(samples) == 2 and all(
            s.status != Status.ABORTED.value and s.reward is not None for s in samples
        )
        assert metrics["rollout/partial_rollout/pending_groups"] == 1
        (group,) = m.partial.pending
        for s in group:
            assert s.status == Status.ABORTED.value and s.response_length == 3 and s.reward is None
            assert s.metadata["start_rollout_id"] == 0 and s.metadata["weight_versions"] == [0]
            assert s.loss_mask == [1, 1, 1] and len(s.rollout_log_probs) == 3
        # a checkpoint now and a resume restore the store exactly (a fresh manager, as after kill -9)
        state = _checkpoint(m)
        assert "pending" not in state["data_source"]  # the prompt is not served again from the start
        m.close()
        m = RolloutManager(cfg, tok, _source(), engine.url)
        _resume(m, state)
        assert [[dataclasses.asdict(s) for s in g] for g in m.partial.pending] == [
            [dataclasses.asdict(s) for s in group]
        ]
        # a weight update (the same weights, version 1), then rollout 1 takes the partial group first;
        # both groups share the batch and the continued one, 13 tokens short, finishes first
        core.update_weights_from_tensors({}, 1)
        core.max_batch_size = 4
        samples, metrics = m.generate(1)
    finally:
        core.max_batch_size = 2
        m.close()
    continued = [s for s in samples if s.metadata.get("start_rollout_id") == 0]
    assert len(continued) == 2 and metrics["rollout/partial_rollout/continued_samples"] == 2
    params = m.sampling_params()
    for s in continued:
        ref = core.generate(s.prompt_tokens, {**params, "sampling_seed": s.metadata["sampling_seed"]})
        assert s.response_tokens == ref["output_ids"] and s.response_length > 3
        assert torch.allclose(torch.tensor(s.rollout_log_probs), torch.tensor(_lps(ref)), atol=1e-5)
        n = s.response_length
        assert (s.weight_version_start, s.weight_version_end) == (0, 1)
        assert s.metadata["weight_versions"] == [0, 1] and s.metadata["weight_version_offsets"] == [0, 3]
        assert token_versions(s) == [0] * 3 + [1] * (n - 3)
        assert s.loss_mask == [0] * 3 + [1] * (n - 3)  # the older policy's tokens leave the loss
        assert s.reward is not None and s.rollout_id == 1


class _StubManager:
    """What `PartialRollout._next_groups` reads of the manager, no engine."""

    def __init__(self, cfg):
        from miles_platform.rollout import filter_hub

        self.cfg, self.buffer_filter = cfg, filter_hub.load_buffer_filter(cfg)
        self.data_source = _source()


@pytest.mark.parametrize("mask", [False, True])
def test_mask_offpolicy_zeroes_the_loss_mask_of_the_tokens_a_continued_sample_holds(
    tiny_hf_checkpoint, tmp_path, mask
):
    from miles_platform.rollout.partial_rollout import PartialRollout

    cfg = _cfg(tiny_hf_checkpoint, tmp_path, mask_offpolicy_in_partial_rollout=mask)
    p = PartialRollout(_StubManager(cfg))
    held = [Sample(response_tokens=[3, 4], loss_mask=[1, 1], status=Status.ABORTED.value), Sample(status=Status.ABORTED.value)]  # fmt: skip
    p.pending = [held]
    (group,) = p._next_groups(1, 1, 1, {})
    assert group is held and not p.pending
    assert group[0].loss_mask == ([0, 0] if mask else [1, 1]) and group[1].loss_mask == []


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "nothing is aborted"),
        (["--over-sampling-batch-size", "2", "--fully-async"], "--fully-async"),
        (
            [
                "--over-sampling-batch-size",
                "4",
                "--custom-generate-function-path",
                "generate_fns.old_form_generate",
            ],
            "no contract",
        ),
        (
            ["--over-sampling-batch-size", "4", "--rollout-function-path", "generate_fns.generate_rollout"],
            "replaces the rollout",
        ),
    ],
)
def test_partial_rollout_is_refused_where_nothing_is_continued(args, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(["--rollout-batch-size", "2", "--partial-rollout", *args])
    with pytest.raises(ConfigError, match="needs --partial-rollout"):
        parse_run_config(["--rollout-batch-size", "2", "--mask-offpolicy-in-partial-rollout"])
    assert parse_run_config(["--rollout-batch-size", "2", "--partial-rollout", "--dynamic-sampling-filter-path",
                             "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"]).partial_rollout  # fmt: skip
