"""Miles' gemma_math, gpqa and deterministic_random reward types, each against hand-checked
examples; ifbench refused by name (it needs IFBench's checkers)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.rollout.rm_hub import async_rm
from miles_platform.rollout.rm_hub.gpqa_rm import gpqa_reward


def _rm(rm_type: str, **sample) -> float:
    args = RunConfig(rollout_batch_size=1, rm_type=rm_type)
    return asyncio.run(async_rm(args, Sample(**sample)))


def test_gemma_math_grades_the_boxed_answer_after_the_last_channel_marker():
    thinking = r"thought: maybe \boxed{3}<channel|>so the answer is \boxed{\frac{1}{2}}"
    assert _rm("gemma_math", response=thinking, label="0.5") == 1.0  # 1/2 == 0.5, after the marker
    assert _rm("gemma_math", response=r"<channel|>\boxed{3} wait", label="4") == 0.0
    assert _rm("gemma_math", response=r"no marker: \boxed{4}", label=r"\boxed{4}") == 1.0  # whole text
    assert _rm("gemma_math", response=r"\boxed{3}<channel|>no box", label="3") == 0.0  # only after it
    assert _rm("gemma_math", response=r"\boxed{4}", label="") == 0.0


@pytest.mark.parametrize(
    "response, label, metadata, want",
    [
        ("The answer is B", "B", None, 1.0),
        ("<think>answer is A</think> Final answer: C", "C", None, 1.0),  # after the thinking only
        ("The answer is B", 2, None, 0.0),  # an index: C
        ("C is correct.", "blue whale", {"choices": ["cat", "dog", "blue whale"]}, 1.0),  # label text -> C
        ("It must be the Blue-Whale!", None, {"choices": ["cat", "blue whale"], "correct_letter": "B"}, 1.0),
        ("I pick D", "E", {"valid_letters": ["A", "B", "C", "D"]}, 0.0),  # E is no valid letter: D != E
        ("", "A", None, 0.0),
    ],
)
def test_gpqa_hand_checked(response, label, metadata, want):
    assert gpqa_reward(response, label, metadata) == want


def test_gpqa_reads_the_samples_metadata():
    meta = {"choices": {"A": "4", "B": "5"}, "correct_letter": "B"}
    assert _rm("gpqa", response="answer: B", label=None, metadata=meta) == 1.0
    assert _rm("gpqa", response="answer: A", label=None, metadata=meta) == 0.0


def test_deterministic_random_is_milses_hash_of_tokens_and_response():
    tokens, response = [1, 2, 3], "hello"
    want = hashlib.sha256(b"[1, 2, 3]hello").digest()[0] % 2  # Miles': str(sample.tokens) + response
    got = [
        _rm(
            "deterministic_random",
            prompt_tokens=tokens[:2],
            response_tokens=tokens[2:],
            response=response,
            index=i,
        )
        for i in range(3)
    ]
    assert got == [float(want)] * 3  # the same whatever the index or run
    rewards = {_rm("deterministic_random", prompt_tokens=[i], response="x") for i in range(16)}
    assert rewards == {0.0, 1.0}


def test_ifbench_is_refused_naming_what_it_needs():
    with pytest.raises(ConfigError, match="ifbench.*IFBench.*--custom-rm-path"):
        _rm("ifbench", response="x")
