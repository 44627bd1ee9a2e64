"""Fixtures of the GPU checks (tests/gpu/test_*_gpu.py, `gpu` marker).

Each check records what it measured with `record(name=value, ...)` (pytest's `record_property`,
JSON-safe); scripts/gpu_checks.py writes those values and every test's status to gpu_checks.json.
Without CUDA the checks are skipped, unless MILES_GPU_CHECKS_ON_CPU=1 runs them on the CPU
(tests/conftest.py), where `device` is "cpu" and `ran_on_cuda` is recorded false.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_platform.models.tiny import save_untied_checkpoint


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def untied_hf_checkpoint(tiny_hf_checkpoint, tmp_path_factory) -> str:
    """GQA, untied embeddings, the tokenizer of `tiny_hf_checkpoint` (the megatron parity's second shape)."""
    return save_untied_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("ckpt") / "untied")


class Recorder:
    """`record(k=v, ...)` keeps measured numbers in the test's report; `record.ran_on(dev)` also
    asserts that, with CUDA present, the check really ran there (the point of running it)."""

    def __init__(self, record_property):
        self._record = record_property

    def __call__(self, **values) -> None:
        for k, v in values.items():
            self._record(k, json.loads(json.dumps(v, default=str)))  # plain types cross xdist

    def ran_on(self, *device_types: str) -> None:
        ran_on_cuda = bool(device_types) and set(device_types) == {"cuda"}
        self(ran_on_cuda=ran_on_cuda)
        if torch.cuda.is_available():
            assert ran_on_cuda, f"CUDA is available but the check ran on {sorted(set(device_types))}"


@pytest.fixture
def record(record_property) -> Recorder:
    return Recorder(record_property)
