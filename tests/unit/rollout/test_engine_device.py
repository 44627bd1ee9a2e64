"""The embedded engine on a device, proved without a GPU (tests/device_check.py), its KV budget
(--sglang-mem-fraction-static) and SGLang's release / resume of its memory."""

from __future__ import annotations

import pytest
import torch
from device_check import fake_device, on_device

from miles_platform.errors import ConfigError
from miles_platform.rollout import engine_core, engine_memory
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.engine_requests import EnginePaused, RequestError
from miles_platform.rollout.lora_serving import read_adapter_dir

PROMPTS = [[5, 9, 17, 33, 41], [12, 4, 99], [60, 61, 62, 63], [5, 9, 17, 33, 41]]


def _body(n_tokens=8, **extra) -> dict:
    sp = [
        {"max_new_tokens": n_tokens, "temperature": 0.0},  # greedy
        {"max_new_tokens": n_tokens, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "sampling_seed": 3},
        {"max_new_tokens": n_tokens, "temperature": 1.0, "min_p": 0.05, "sampling_seed": 4},
        {"max_new_tokens": n_tokens, "temperature": 1.0, "sampling_seed": 5},
    ]
    return {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True, **extra}


def _run(core: EngineCore, body: dict) -> list[dict]:
    futures, _ = core.submit_json(body)
    return [f.result(120) for f in futures]


@pytest.fixture
def on_fake_device(monkeypatch):
    """EngineCore's scheduler thread (where every engine tensor op runs) under the fake device."""
    run = EngineCore._run

    def faked(self):
        with fake_device():
            run(self)

    monkeypatch.setattr(EngineCore, "_run", faked)
    return torch.device("meta", 0)


def _same(a: list[dict], b: list[dict], tol=1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        mx, my = x["meta_info"], y["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in my:
                for (lx, tx, _), (ly, ty, _) in zip(mx[key], my[key], strict=True):
                    assert tx == ty and (lx == ly or abs(lx - ly) < tol)
        for key in ("output_token_sampling_mask", "output_top_logprobs"):
            if key in my:
                assert len(mx[key]) == len(my[key])


def test_sampling_and_log_probs_run_on_the_engines_device(on_fake_device, tiny_hf_checkpoint, tmp_path):
    """Prefill, decode, every sampler branch, sampling supports, top log-probs, prefill scoring and a
    LoRA adapter: every tensor op on the engine's device, the same answers as on the CPU."""
    from test_lora_engine import _random_adapter

    adapter = _random_adapter(tiny_hf_checkpoint, tmp_path / "a", ["q_proj", "v_proj"], seed=1)
    tensors, conf = read_adapter_dir(adapter)
    body = _body(return_sampling_mask=True, top_logprobs_num=3, logprob_start_len=0,
                 lora_path=[None, "a", None, "a"])  # fmt: skip
    answers = {}
    for name, device in (("fake", on_fake_device), ("cpu", None)):
        core = EngineCore(tiny_hf_checkpoint, num_threads=1, device=device)
        try:
            assert core.device == (on_fake_device if device is not None else torch.device("cpu"))
            core.load_lora_adapter("a", tensors, conf)
            answers[name] = _run(core, body)
            if device is not None:
                assert all(on_device(p) for p in core.model.parameters())
        finally:
            core.stop()
    _same(answers["fake"], answers["cpu"])


def test_a_cpu_tensor_in_the_sampler_is_caught(on_fake_device, tiny_hf_checkpoint, monkeypatch):
    """The check itself: the sampler's temperatures built on the CPU (as before it had a device)."""
    from miles_platform.rollout import sampling

    monkeypatch.setattr(sampling, "_on", lambda values, dtype, device: torch.tensor(values, dtype=dtype))
    core = EngineCore(tiny_hf_checkpoint, num_threads=1, device=on_fake_device)
    try:
        futures, _ = core.submit_json(_body())
        with pytest.raises(AssertionError, match="meets tensors on the rank's device"):
            futures[1].result(60)
    finally:
        core.stop()


def test_kv_budget_bounds_the_cache_and_keeps_the_answers(tiny_hf_checkpoint, monkeypatch):
    """--sglang-mem-fraction-static: with room for 60 cached tokens the batch never holds more, rows
    go back to the queue and are prefilled again, and every answer is the unbounded engine's."""
    free = EngineCore(tiny_hf_checkpoint, num_threads=1)
    try:
        want = _run(free, _body(n_tokens=24))
        per_token = engine_memory.kv_bytes_per_token(free.model.config, torch.float32)
        weights = sum(p.numel() * p.element_size() for p in free.model.parameters())
        assert free.kv_budget is None and free.stats["max_kv_tokens_seen"] > 60
    finally:
        free.stop()
    monkeypatch.setattr(engine_memory, "total_memory", lambda device: 2 * (weights + 60 * per_token))
    core = EngineCore(tiny_hf_checkpoint, num_threads=1, mem_fraction_static=0.5)
    try:
        assert core.kv_budget == 60
        got = _run(core, _body(n_tokens=24))
        assert core.stats["max_kv_tokens_seen"] <= 60
        assert core.stats["num_kv_retractions"] > 0
        _same(got, want, tol=1e-4)
        with pytest.raises(RequestError, match="does not fit the KV cache budget of 60 tokens"):
            core.generate(input_ids=list(range(3, 70)), sampling_params={"max_new_tokens": 2})
    finally:
        core.stop()
    monkeypatch.setattr(engine_memory, "total_memory", lambda device: weights)
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static 0.5: .* leaves no room"):
        EngineCore(tiny_hf_checkpoint, num_threads=1, mem_fraction_static=0.5)


def test_release_and_resume_leave_the_served_weights_bit_identical(on_fake_device, tiny_hf_checkpoint):
    """SGLang's memory occupation API: released weights leave the device (host memory holds them),
    requests get 503 and updates are refused meanwhile, resume brings every value back."""
    core = EngineCore(tiny_hf_checkpoint, num_threads=1, device=on_fake_device)
    try:
        before = core.get_weights()
        answer = _run(core, _body())
        assert core.release_memory_occupation(["kv_cache"]) == ["kv_cache"]
        assert core.release_memory_occupation() == ["kv_cache", "weights"]
        assert not any(on_device(p) for p in core.model.parameters())
        with pytest.raises(EnginePaused, match="released its kv_cache and weights"):
            core.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        with pytest.raises(RequestError, match="weights are released; resume them first"):
            core.update_weights_from_tensors({k: v for k, v in before.items()}, 1)
        assert core.resume_memory_occupation(["weights"]) == ["kv_cache"]
        assert core.resume_memory_occupation(["kv_cache", "cuda_graph"]) == []
        assert all(on_device(p) for p in core.model.parameters())
        after = core.get_weights()
        assert all(torch.equal(before[k], after[k]) for k in before) and core.weight_version == 0
        _same(_run(core, _body()), answer, tol=0.0)
    finally:
        core.stop()


def test_release_refuses_a_busy_engine(tiny_hf_checkpoint):
    core = EngineCore(tiny_hf_checkpoint, num_threads=1)
    gate = __import__("threading").Event()
    core.step_hook = lambda c: gate.wait(30)
    try:
        futures, _ = core.submit_json(_body(n_tokens=4))
        with pytest.raises(RequestError, match="requests are running or queued"):
            core.release_memory_occupation()
        gate.set()
        [f.result(60) for f in futures]
        assert core.release_memory_occupation(["kv_cache"]) == ["kv_cache"]
        with pytest.raises(RequestError, match="tags"):
            core.release_memory_occupation(["activations"])
    finally:
        gate.set()
        core.stop()


def test_default_device_and_dtype_are_the_cpu_and_fp32(tiny_hf_checkpoint):
    """Backward compatible: EngineCore(path) computes on the CPU in fp32, as it always did."""
    core = EngineCore(tiny_hf_checkpoint, num_threads=1)
    try:
        assert core.device == torch.device("cpu") and core.dtype == torch.float32
    finally:
        core.stop()
    assert engine_core.parse_engine_dtype("auto", "cuda:0") == torch.bfloat16
    assert engine_core.parse_engine_dtype("auto", "cpu") == torch.float32
