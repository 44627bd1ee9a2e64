"""Prefill-only scoring on the embedded engine, SGLang's way (what an OPD teacher serves): input
log-probs from `logprob_start_len`, `top_logprobs_num`, `token_ids_logprob`, over real HTTP, checked
against a plain forward of the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from miles_platform.models.checkpoint import load_hf_model
from miles_platform.rollout import client
from miles_platform.rollout.client import EngineHTTPError
from miles_platform.rollout.engine_server import start_engine_server

PROMPT = [5, 9, 17, 22, 30, 41]


@pytest.fixture(scope="module")
def server(tiny_hf_checkpoint):
    srv = start_engine_server(tiny_hf_checkpoint, api_key="k")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_hf_checkpoint):
    model = load_hf_model(tiny_hf_checkpoint).eval()

    def log_probs(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits / temperature, dim=-1)  # row p predicts token p + 1

    return log_probs


def _score(url, body):
    return client.post(url, "/generate", body, api_key="k")


def test_prefill_only_scoring_matches_a_plain_forward(server, reference):
    out = _score(server.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                              "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                              "token_ids_logprob": [1, 2, 40]})  # fmt: skip
    meta, ref = out["meta_info"], reference(PROMPT)
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0  # scored, nothing generated
    tokens = meta["input_token_logprobs"]
    assert [t[1] for t in tokens] == PROMPT and tokens[0][0] is None  # position 0 has no left context
    want = [ref[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))]
    assert [t[0] for t in tokens[1:]] == pytest.approx(want, abs=1e-5)
    top, ids = meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert top[0] is None and ids[0] is None and len(top) == len(ids) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        v, i = ref[p - 1].topk(3)
        assert [e[1] for e in top[p]] == i.tolist()
        assert [e[0] for e in top[p]] == pytest.approx(v.tolist(), abs=1e-5)
        assert [e[1] for e in ids[p]] == [1, 2, 40]
        assert [e[0] for e in ids[p]] == pytest.approx(ref[p - 1, [1, 2, 40]].tolist(), abs=1e-5)
        assert all(len(e) == 3 and e[2] is None for e in top[p] + ids[p])  # [logprob, id, text-or-None]


def test_a_batch_scores_each_prompt_from_its_own_start_with_its_own_ids(server, reference):
    other = [7, 3, 88, 12]
    body = {"input_ids": [PROMPT, other], "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
            "return_logprob": True, "logprob_start_len": [3, 1], "token_ids_logprob": [[4], [6, 8]],
            "return_text_in_logprobs": True}  # fmt: skip
    a, b = (o["meta_info"] for o in _score(server.url, body))
    assert [t[1] for t in a["input_token_logprobs"]] == PROMPT[3:]
    assert [t[1] for t in b["input_token_logprobs"]] == other[1:]
    ref_b = reference(other, temperature=0.7)  # scored at the request's temperature
    assert [t[0] for t in b["input_token_logprobs"]] == pytest.approx(
        [ref_b[p - 1, other[p]].item() for p in range(1, len(other))], abs=1e-5
    )
    assert [[e[1] for e in pos] for pos in b["input_token_ids_logprobs"]] == [[6, 8]] * 3
    assert [[e[1] for e in pos] for pos in a["input_token_ids_logprobs"]] == [[4]] * 3
    assert all(isinstance(e[2], str) for e in a["input_token_logprobs"])  # return_text_in_logprobs


def test_generation_reports_top_logprobs_that_prefill_scoring_reproduces(server):
    """A student's rollout top-k and a teacher engine scoring the same tokens agree when they are one model."""
    gen = _score(server.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 1.0,
                              "sampling_seed": 3, "ignore_eos": True}, "return_logprob": True,
                              "top_logprobs_num": 4})  # fmt: skip
    meta = gen["meta_info"]
    out_ids, top = gen["output_ids"], meta["output_top_logprobs"]
    assert len(top) == len(out_ids) == 5 and all(len(t) == 4 for t in top)
    scored = _score(server.url, {"input_ids": PROMPT + out_ids, "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": len(PROMPT),
                                 "top_logprobs_num": 4})["meta_info"]  # fmt: skip
    assert [t[0] for t in scored["input_token_logprobs"]] == pytest.approx(
        [t[0] for t in meta["output_token_logprobs"]], abs=1e-5
    )
    for g, s in zip(top, scored["input_top_logprobs"], strict=True):
        assert [e[1] for e in g] == [e[1] for e in s]
        assert [e[0] for e in g] == pytest.approx([e[0] for e in s], abs=1e-5)


@pytest.mark.parametrize(
    "extra, match",
    [({"top_logprobs_num": -1}, "top_logprobs_num"), ({"logprob_start_len": 6}, "logprob_start_len"),
     ({"token_ids_logprob": [10**6]}, "out of vocabulary")],
)  # fmt: skip
def test_bad_scoring_fields_are_a_400_naming_the_field(server, extra, match):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, **extra}
    with pytest.raises(EngineHTTPError, match=match) as e:
        _score(server.url, body)
    assert e.value.status == 400


def test_the_router_splits_a_scoring_batch_with_its_per_prompt_fields(server, tiny_hf_checkpoint):
    """Per-prompt logprob_start_len / token_ids_logprob lists are sliced with the prompts they belong to."""
    from miles_platform.rollout.router import start_router

    second = start_engine_server(tiny_hf_checkpoint, api_key="k")
    router = start_router(worker_urls=[server.url, second.url], api_key="k", worker_api_key="k")
    try:
        prompts = [PROMPT, PROMPT[:4], PROMPT[1:], PROMPT[:3]]
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": [0, 1, 2, 1], "token_ids_logprob": [[3], [4, 5], [6], [7]],
                "top_logprobs_num": [1, 2, 0, 3]}  # fmt: skip
        direct, routed = _score(server.url, body), _score(router.url, body)
        for d, r in zip(direct, routed, strict=True):
            for f in ("input_token_logprobs", "input_token_ids_logprobs", "input_top_logprobs"):
                assert _flat(r["meta_info"].get(f)) == pytest.approx(
                    _flat(d["meta_info"].get(f)), abs=1e-5, nan_ok=True
                ), f
        assert second.core.stats["num_scored_requests"] > 0  # the batch really was split
    finally:
        router.stop()
        second.stop()


def _flat(entries) -> list:
    """Nested [logprob, id, text] entries (None at position 0) as one flat list, None -> nan."""
    if entries is None:
        return []
    out = []
    for e in entries:
        if isinstance(e, list) and e and isinstance(e[0], list):
            out += _flat(e)
        elif e is None:
            out.append(float("nan"))
        else:
            out += [float("nan") if e[0] is None else e[0], e[1]]
    return out
