"""The embedded engine (EngineCore) on the device: its log-probs against a teacher-forced forward of
the same checkpoint on the device (fp32 within 1e-4, the CUDA default bf16 within bf16 rounding), its
decode throughput against HF `generate` on the same device; and the `broadcast` weight transport
from a trainer-rank process into it (NCCL on GPU 0, gloo without CUDA), after which the engine must
hold exactly the sent weights."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from miles_platform.models.checkpoint import load_hf_checkpoint
from miles_platform.rollout.engine_core import EngineCore

pytestmark = pytest.mark.gpu

ENGINE_TOL = 1e-4  # tests/unit/rollout/test_engine.py's teacher-forced bound
MAX_NEW = 12


def _maxdiff(a, b) -> float:
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def _teacher_forced(model, prompt, output, dev):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=dev)).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(output, device=dev)[:, None])[:, 0].cpu()


def _engine_logprob_check(ckpt, device, dtype, record, tol):
    import transformers

    eng = EngineCore(ckpt, dtype=dtype, max_batch_size=8, device=device)
    try:
        model, tok = load_hf_checkpoint(ckpt)
        prompts = [tok("What is 7+11?")["input_ids"], tok("What is 14+")["input_ids"], [5, 6, 7]]
        res = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": MAX_NEW, "temperature": 1.0, "sampling_seed": 3},
            return_logprob=True,
            timeout=120,
        )
        engine_dev = next(eng.model.parameters()).device.type
        served = eng.dtype
    finally:
        eng.stop()
    dmodel = load_hf_checkpoint(ckpt)[0].to(device=device, dtype=served)
    rows, dev_max = [], 0.0
    for prompt, r in zip(prompts, res):
        lps = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
        ref_dev = _teacher_forced(dmodel, prompt, r["output_ids"], device)
        d_dev = _maxdiff(lps, ref_dev)
        dev_max = max(dev_max, d_dev)
        rows.append({"prompt_len": len(prompt), "n_out": len(r["output_ids"]), "max_diff_vs_device": d_dev})
    record(engine_device=engine_dev, served_dtype=str(served), teacher_forced_device=str(device), tolerance=tol,
           engine_vs_device_forward_max_abs_diff=dev_max, rows=rows, transformers=transformers.__version__,
           forward_accepts_cache_kwarg="cache" in inspect.signature(type(model).forward).parameters)  # fmt: skip
    record.ran_on(engine_dev)
    assert dev_max < tol, dev_max
    assert all(x["n_out"] == MAX_NEW for x in rows), [x["n_out"] for x in rows]


def test_engine_logprobs_match_a_teacher_forced_forward_on_the_device(tiny_hf_checkpoint, device, record):
    """The engine on the device (weights, KV cache, sampler there) in fp32: its log-probs are a
    teacher-forced forward's of the same weights on the same device."""
    _engine_logprob_check(tiny_hf_checkpoint, device, "fp32", record, ENGINE_TOL)


def test_engine_default_dtype_on_the_device(tiny_hf_checkpoint, device, record):
    """The engine's default on CUDA is bf16 (fp32 on the CPU): against a bf16 teacher-forced forward."""
    tol = 5e-2 if torch.device(device).type == "cuda" else ENGINE_TOL  # bf16: batch shape changes rounding
    _engine_logprob_check(tiny_hf_checkpoint, device, "auto", record, tol)


def test_engine_tokens_per_second_vs_hf_generate(tiny_hf_checkpoint, device, record):
    """Decode throughput of the engine against HF `generate` on the same device, same batch."""
    from bench.bench_engine import hf_generate_tokens_per_s

    eng = EngineCore(tiny_hf_checkpoint, max_batch_size=512, device=device)
    try:
        prompts = [[5 + i % 50, 9, 17, 33] for i in range(64)]
        sp = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1}
        eng.generate(
            input_ids=prompts[:4], sampling_params=dict(sp, max_new_tokens=4), timeout=120
        )  # warm-up
        t0 = time.perf_counter()
        out = eng.generate(input_ids=prompts, sampling_params=sp, timeout=600)
        ours = sum(len(r["output_ids"]) for r in out) / (time.perf_counter() - t0)
        dev = next(eng.model.parameters()).device.type
        dtype = eng.dtype
    finally:
        eng.stop()
    base = hf_generate_tokens_per_s(tiny_hf_checkpoint, prompts, 64, device, dtype)
    record(engine_tokens_per_s=ours, hf_generate_tokens_per_s=base, ratio=ours / base, dtype=str(dtype))
    record.ran_on(dev)
    assert ours > 0 and base > 0


# ------------------------------------------------------------------------------------- broadcast


def _expected_broadcast_state(ckpt: str) -> dict:
    """The checkpoint's tensors, each float one moved by a distinct amount: what the trainer sends."""
    from safetensors.torch import load_file

    state = load_file(str(Path(ckpt) / "model.safetensors"))
    return {
        k: v + 0.01 * (i + 1) if v.is_floating_point() else v
        for i, (k, v) in enumerate(sorted(state.items()))
    }


def _ensure_ray_importable() -> None:
    """broadcast.py imports ray for its endpoint helper only; the two functions used here do not
    need it. Where the image lacks ray, an empty module stands in (in every process)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules["ray"] = types.ModuleType("ray")


def _trainer_rank(ckpt: str, port: int, backend: str, group_name: str, errq) -> None:
    """Rank 0 of the weights group, in its own process: what TrainerActor.broadcast_weights does."""
    try:
        _ensure_ray_importable()
        from miles_platform.weights.transports.broadcast import broadcast, new_weights_group

        errq.put("imported")
        if backend == "nccl":
            torch.cuda.set_device(0)
        group = new_weights_group("127.0.0.1", port, 0, 2, group_name, backend)
        for _name, t in sorted(_expected_broadcast_state(ckpt).items()):
            broadcast(group, t.to("cuda" if backend == "nccl" else "cpu").contiguous())
        if backend == "nccl":
            torch.cuda.synchronize()
        errq.put(None)
    except BaseException as e:  # noqa: BLE001 - reported to the engine side, which fails the test
        errq.put(f"{type(e).__name__}: {e}")


def test_broadcast_puts_exactly_the_trainer_weights_into_the_engine(tiny_hf_checkpoint, record):
    from miles_platform.cluster.ports import free_port

    _ensure_ray_importable()
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    expected = _expected_broadcast_state(tiny_hf_checkpoint)
    names = sorted(expected)
    record(backend=backend, ran_on_cuda=cuda, tensors=len(names),
           bytes=sum(t.numel() * t.element_size() for t in expected.values()))  # fmt: skip
    core = EngineCore(tiny_hf_checkpoint, dtype="fp32", device="cuda:0" if cuda else "cpu")
    port, group_name = free_port("127.0.0.1"), "miles_weights_check"
    errq = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(
        target=_trainer_rank, args=(tiny_hf_checkpoint, port, backend, group_name, errq), daemon=True
    )
    t0 = time.monotonic()
    proc.start()
    try:
        first = errq.get(timeout=90)  # "imported", or the trainer's early error: do not wait 120 s on it
        assert first == "imported", f"trainer rank failed before joining: {first}"
        core.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, backend)
        version = core.update_weights_from_distributed(
            names,
            [str(expected[n].dtype).removeprefix("torch.") for n in names],
            [list(expected[n].shape) for n in names],
            group_name,
            weight_version=1,
        )
        seconds = time.monotonic() - t0
        proc.join(60)
        trainer_error = errq.get(timeout=5) if not errq.empty() else "trainer rank gave no result"
        got = core.get_weights()
    except Exception as e:
        if cuda and "duplicate gpu" in str(e).lower():  # NCCL's refusal at the first collective
            pytest.skip(f"NCCL refuses two ranks on one GPU; needs 2+ GPUs ({str(e)[:300]})")
        raise
    finally:
        if proc.is_alive():
            proc.kill()
        core.stop()
    compared = [n for n in names if n in got]
    diff = max(_maxdiff(got[n], expected[n]) for n in compared)
    record(engine_version_after=version, max_abs_diff_engine_vs_trainer=diff,
           trainer_error=trainer_error, seconds_incl_group_setup=round(seconds, 2))  # fmt: skip
    assert trainer_error is None
    assert version == 1
    assert diff == 0.0
    assert len(compared) >= len(got)


def test_a_bf16_engine_holds_qwen3_5s_a_log_in_fp32_on_the_device(
    tiny_hf_checkpoint, tmp_path, device, record
):
    """models/gdn.py on the device: the engine serving a tiny Qwen3.5 in bf16 holds A_log in fp32 as stored
    (SGLang's choice), every other weight bf16, and its log-probs are a teacher-forced bf16 forward's of the
    same model with A_log kept so (transformers' GatedDeltaNet: fla's kernels when installed, else torch's)."""
    from safetensors.torch import load_file

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.gdn import keep_decay_fp32

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))
    from test_qwen3_5_bridge import q35_config, sharp_q35

    tok = load_tokenizer(tiny_hf_checkpoint)
    ckpt = str(tmp_path / "q35")
    save_hf_checkpoint(sharp_q35(q35_config(len(tok), "qwen3_5")), tok, ckpt)
    stored = load_file(f"{ckpt}/model.safetensors")
    eng = EngineCore(ckpt, dtype="bf16", max_batch_size=8, device=device)
    try:
        dtypes = {n: p.dtype for n, p in eng.model.named_parameters()}
        a_log = sorted(n for n in dtypes if n.endswith(".linear_attn.A_log"))
        exact = all(torch.equal(dict(eng.model.named_parameters())[n].cpu(), stored[n]) for n in a_log)
        prompt = tok("What is 7+11?")["input_ids"]
        r = eng.generate(input_ids=[prompt], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 1.0,
                                                              "sampling_seed": 3}, return_logprob=True, timeout=120)[0]  # fmt: skip
    finally:
        eng.stop()
    model = load_hf_checkpoint(ckpt)[0].to(device=device, dtype=torch.bfloat16)
    keep_decay_fp32(model)
    with torch.no_grad():
        for n in a_log:
            dict(model.named_parameters())[n].copy_(stored[n].to(device))
    lps = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
    diff = _maxdiff(lps, _teacher_forced(model, prompt, r["output_ids"], device))
    record(a_log=a_log, a_log_dtypes=[str(dtypes[n]) for n in a_log], a_log_as_stored=exact,
           engine_vs_forward_max_abs_diff=diff)  # fmt: skip
    record.ran_on(device)
    assert a_log and all(dtypes[n] == torch.float32 for n in a_log) and exact
    assert {d for n, d in dtypes.items() if n not in a_log} == {torch.bfloat16}
    assert diff < 5e-2, diff  # bf16: batch shape changes rounding (test_engine_default_dtype_on_the_device)
