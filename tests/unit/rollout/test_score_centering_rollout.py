"""Score centering's rollout side (rollout/candidates.py): what the engine is asked for and what each
Sample records, checked against a teacher-forced forward of the same checkpoint.

Unfiltered sampling: `rollout_topk_*` are the top K of the sampler distribution log_softmax(z / T).
Filtered sampling (top-k / top-p): they are the whole realized support with its renormalized
log-probs, and the sampled token's rollout log-prob is its entry. Tool rows hold -1 / -inf."""

from __future__ import annotations

import json

import pytest
import torch
from loop_helpers import small_run_kwargs

from miles_platform.config import RunConfig
from miles_platform.data.dataset import PromptRecord
from miles_platform.models.checkpoint import load_hf_model, load_tokenizer
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.generate_hub import multi_turn
from miles_platform.rollout.manager import RolloutManager
from miles_platform.store.shards import samples_to_table

KEY = "k"
RECORDS = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=", label=str(2 * i), metadata={}) for i in range(2)]


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint):
    srv = start_engine_server(tiny_hf_checkpoint, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def forward(tiny_hf_checkpoint):
    model = load_hf_model(tiny_hf_checkpoint).eval()

    def tempered(s, temperature: float) -> torch.Tensor:
        """z / T at each response position of the sample (one teacher-forced forward)."""
        with torch.no_grad():
            z = model(input_ids=torch.tensor([s.tokens])).logits[0, :-1].float()
        return z[len(s.prompt_tokens) - 1 :] / temperature

    return tempered


def _cfg(ckpt, tmp_path, **kw) -> RunConfig:
    base = dict(loss_type="score_centering", use_rollout_logprobs=True, rollout_top_logprobs_num=5,
                rollout_temperature=0.7, rollout_max_response_len=6, api_key=KEY)  # fmt: skip
    return RunConfig(**small_run_kwargs(ckpt, tmp_path, **{**base, **kw})).validate()


def _rollout(cfg, url, seeds=((3, 4), (5, 6))):
    """Samples of the run's rollout (one group per seed tuple), as the manager makes them."""
    tok = load_tokenizer(cfg.hf_checkpoint)
    m = RolloutManager(cfg, tok, None, url)
    try:
        records = RECORDS[: len(seeds)]
        prompts = [tok.encode(r.prompt, add_special_tokens=False) for r in records]
        groups = m.generate_groups(records, prompts, [list(s) for s in seeds])
        return [s for g in groups for s in g]
    finally:
        m.close()


def test_unfiltered_rollout_records_the_samplers_top_k(tiny_hf_checkpoint, tmp_path, engine, forward):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path)
    samples = _rollout(cfg, engine.url)
    for s in samples:
        n = s.response_length
        ids, lps = torch.tensor(s.rollout_topk_token_ids), torch.tensor(s.rollout_topk_log_probs)
        assert ids.shape == lps.shape == (n, 5) and n > 0
        want = torch.log_softmax(forward(s, 0.7), -1)
        top = want.topk(5, dim=-1)
        assert torch.equal(ids, top.indices)
        assert torch.allclose(lps, top.values, atol=1e-5)
        assert torch.allclose(torch.tensor(s.rollout_log_probs), want.gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0], atol=1e-5)  # fmt: skip
        # not the T = 1 distribution: the sampler's tempered one
        assert not torch.allclose(lps, torch.log_softmax(forward(s, 1.0), -1).gather(1, ids), atol=1e-3)
    # the shard keeps them: [n][K] int32 / float32 columns
    table = samples_to_table(samples)
    assert table.column("rollout_topk_token_ids").to_pylist()[0] == samples[0].rollout_topk_token_ids


def test_filtered_rollout_records_the_whole_support(tiny_hf_checkpoint, tmp_path, engine, forward):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, rollout_top_k=4, rollout_top_p=0.9, rollout_top_logprobs_num=6)
    samples = _rollout(cfg, engine.url)
    for s in samples:
        for j, (sup, ids, lps) in enumerate(
            zip(s.rollout_sampling_support, s.rollout_topk_token_ids, s.rollout_topk_log_probs, strict=True)
        ):
            assert len(ids) == 6 and ids[: len(sup)] == sup and set(ids[len(sup) :]) <= {-1}
            assert all(x == float("-inf") for x in lps[len(sup) :])
            z = forward(s, 0.7)[j]
            want = torch.log_softmax(z[sup], -1)
            assert torch.allclose(torch.tensor(lps[: len(sup)]), want, atol=1e-5)
            assert s.rollout_log_probs[j] == pytest.approx(lps[sup.index(s.response_tokens[j])], abs=1e-7)


def test_a_support_wider_than_k_is_refused_by_name():
    from miles_platform.data.sample import Sample
    from miles_platform.rollout.candidates import append_support_rows

    with pytest.raises(RuntimeError, match="--rollout-top-logprobs-num"):
        append_support_rows(Sample(), [1], [[1, 2, 3]], [[-1.0, -2.0, -3.0]], 2)


def test_multi_turn_keeps_candidate_rows_aligned_with_tool_rows(
    tiny_hf_checkpoint, tmp_path, forward, monkeypatch
):
    """A two-turn episode (a tool call, then an answer): model rows are the top K of the forward
    over the whole trajectory, tool rows are -1 / -inf, every per-token list has one entry per token."""
    tok = load_tokenizer(tiny_hf_checkpoint)
    model = load_hf_model(tiny_hf_checkpoint).eval()
    said = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "5"]
    bodies = []

    async def scripted_post(url, body, api_key=None):  # the engine, saying what the script says
        bodies.append(body)
        turn = len(bodies) - 1
        out = tok.encode(said[turn], add_special_tokens=False) + [tok.eos_token_id]
        ids = body["input_ids"] + out
        with torch.no_grad():
            z = model(input_ids=torch.tensor([ids])).logits[0, len(body["input_ids"]) - 1 : -1] / 0.7
        lp = torch.log_softmax(z, -1)
        k = body["top_logprobs_num"]
        top = lp.topk(k, -1)
        meta = {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[float(lp[j, t]), t, None] for j, t in enumerate(out)],
            "output_top_logprobs": [
                [[float(v), int(i), None] for v, i in zip(vs, is_, strict=True)]
                for vs, is_ in zip(top.values, top.indices, strict=True)
            ],  # fmt: skip
        }
        return {"text": said[turn], "output_ids": out, "meta_info": meta}

    monkeypatch.setattr(multi_turn, "post", scripted_post)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_generate_function_path=multi_turn.__name__ + ".generate",
               generate_tool_specs_path="generate_fns.TOOL_SPECS", generate_tool_call_parser="qwen25",
               generate_execute_tool_function_path="generate_fns.add", rollout_max_response_len=200,
               rollout_batch_size=1, n_samples_per_prompt=1, rollout_top_logprobs_num=3)  # fmt: skip
    [s] = _rollout(cfg, "http://unused", seeds=((1,),))
    assert [b["top_logprobs_num"] for b in bodies] == [3, 3] and s.metadata["turns"] == 2
    n = s.response_length
    assert len(s.rollout_topk_token_ids) == len(s.rollout_topk_log_probs) == len(s.loss_mask) == n
    want = torch.log_softmax(forward(s, 0.7), -1).topk(3, -1)
    for j, (ids, lps, m) in enumerate(zip(s.rollout_topk_token_ids, s.rollout_topk_log_probs, s.loss_mask)):
        if m:
            assert ids == want.indices[j].tolist()
            assert torch.allclose(torch.tensor(lps), want.values[j], atol=1e-5)
        else:
            assert ids == [-1] * 3 and lps == [float("-inf")] * 3
    assert 0 in s.loss_mask  # there was a tool row
    json.dumps(s.turns)  # the episode is a real multi-turn one


def test_the_engine_answers_support_rows_only_when_asked_right(engine):
    from miles_platform.rollout import client
    from miles_platform.rollout.client import EngineHTTPError

    body = {"input_ids": [5, 9, 17], "return_logprob": True, "return_sampling_mask": True,
            "sampling_params": {"max_new_tokens": 3, "top_k": 3, "temperature": 0.7, "sampling_seed": 1}}  # fmt: skip
    selected = client.post(engine.url, "/generate", body, api_key=KEY)["meta_info"]
    rows = client.post(engine.url, "/generate", {**body, "sampling_logprobs_mode": "support"}, api_key=KEY)
    rows = rows["meta_info"]
    assert rows["output_token_sampling_mask"] == selected["output_token_sampling_mask"]
    for t, sup, row, lp in zip(rows["output_token_logprobs"], rows["output_token_sampling_mask"],
                               rows["output_token_sampling_logprobs"], selected["output_token_sampling_logprobs"]):  # fmt: skip
        assert len(row) == len(sup) and row[sup.index(t[1])] == pytest.approx(lp, abs=1e-6)
        assert sum(torch.tensor(row).exp()) == pytest.approx(1, abs=1e-5)
    for bad, why in (({"sampling_logprobs_mode": "all"}, "must be 'selected' or 'support'"),
                     ({"sampling_logprobs_mode": "support", "return_sampling_mask": False}, "needs return_sampling_mask")):  # fmt: skip
        with pytest.raises(EngineHTTPError, match=why):
            client.post(engine.url, "/generate", {**body, **bad}, api_key=KEY)
