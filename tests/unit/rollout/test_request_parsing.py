"""A `/generate` batch's sampling params and log-prob options, parsed once per distinct entry: each
prompt still gets its own seed, every entry that differs is parsed (and validated) as itself, and
the prompts' parsed params are separate objects."""

from __future__ import annotations

import pytest

from miles_platform.rollout.engine_logprobs import LogprobOptions, parse_logprob_options
from miles_platform.rollout.engine_requests import RequestError, SamplingParams, parse_sampling_params


def test_a_rollout_batch_gets_each_prompt_its_seed():
    base = {"temperature": 1.0, "max_new_tokens": 8, "top_p": 1.0, "top_k": -1, "stop_token_ids": [2]}
    got = parse_sampling_params([{**base, "sampling_seed": i} for i in range(5)] + [dict(base)])
    assert [p.sampling_seed for p in got] == [0, 1, 2, 3, 4, None]
    assert all(p == SamplingParams(**base, sampling_seed=p.sampling_seed) for p in got)
    assert len({id(p) for p in got}) == 6  # one object per prompt
    got[0].sampling_seed = 99
    assert got[1].sampling_seed == 1


def test_every_entry_that_differs_is_parsed_as_itself():
    a = {"temperature": 1.0, "max_new_tokens": 8}
    b = {"temperature": 0.0, "max_new_tokens": 8}
    c = {"temperature": 1.0, "max_new_tokens": 8, "stop": "=", "top_k": 5}
    entries = [{**a, "sampling_seed": 1}, {**b, "sampling_seed": 2}, {**b, "sampling_seed": 3}, {**a, "sampling_seed": 4},
               {**c, "sampling_seed": 5}, {**a, "max_new_tokens": 4}]  # fmt: skip
    got = parse_sampling_params(entries)
    assert [(p.temperature, p.max_new_tokens, p.stop, p.top_k, p.sampling_seed) for p in got] == [
        (1.0, 8, [], -1, 1), (0.0, 8, [], -1, 2), (0.0, 8, [], -1, 3), (1.0, 8, [], -1, 4), (1.0, 8, ["="], 5, 5),
        (1.0, 4, [], -1, None),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"sampling_seed": "7"}, "sampling_seed"),
    ],  # fmt: skip
)
def test_a_bad_entry_after_good_ones_is_refused_naming_its_field(bad, says):
    good = {"temperature": 1.0, "max_new_tokens": 8}
    with pytest.raises(RequestError, match=says):
        parse_sampling_params([{**good, "sampling_seed": 1}, {**good, "sampling_seed": 2}, {**good, **bad}])


def test_log_prob_options_default_shared_and_per_prompt_validated():
    opts = parse_logprob_options({"return_logprob": True}, 3, True, 259, None)
    assert opts == [LogprobOptions()] * 3
    got = parse_logprob_options({"top_logprobs_num": [0, 2, None]}, 3, True, 259, None)
    assert [o.top_k for o in got] == [0, 2, 0]

    def error(msg):
        raise RequestError(msg)

    with pytest.raises(RequestError, match="top_logprobs_num"):
        parse_logprob_options({"top_logprobs_num": 999}, 2, True, 259, error)
    text = parse_logprob_options({"return_text_in_logprobs": True}, 2, True, 259, error)
    assert all(o.with_text for o in text)
