"""GPU evidence for the parts of miles-platform that run without sglang, transformer-engine or ray.

    python scripts/gpu_checks.py --out DIR        (or scripts/gpu_checks.sh DIR on a bare GPU machine)

Every check runs in its own subprocess (its own CUDA context and process group, a timeout of its
own), several at a time, so one failure or hang never stops the others. The report is rewritten
after every check: DIR/gpu_checks.json ({"cuda": ..., "checks": {name: {"status", ...numbers}}})
and DIR/gpu_checks.log (each child's output). Status is "pass", "fail", "error" (the check raised or
its process died), "skipped" (the code has no CUDA path; the reason says so) or "info" (recorded,
not judged). Without CUDA the same checks run on the CPU (`ran_on_cuda` false in each), which
makes the script testable anywhere; only a report with `"cuda": true` is GPU evidence.

Checks:
  env                      torch / CUDA / megatron-core / transformers versions, TF32 flags, TE import
  megatron_local_spec      tests/unit/training/test_megatron_backend.py `_compare`, `_resume`, `_shims` in-process:
                           MegatronBackend (local spec unless TE imports) vs the HF model on the device
  megatron_test_run        the same file's subprocess machinery `_run("cpu", ...)` exactly as its
                           fixture calls it ("cpu" there names the local-spec checks, not the device)
  engine_on_device         the embedded engine (EngineCore) on CUDA, if it has a device argument
  engine_logprobs_vs_device_forward  engine log-probs vs a teacher-forced forward of the same
                           checkpoint on the device (and on CPU), within 1e-4
  kernels_fp8 / kernels_int4 / kernels_logprob / kernels_xor_delta   kernels/* on device tensors
                           vs the CPU reference (bit-exact where the math is exact)
  fsdp_plain_step          FSDPBackend (world size 1, no rules) one AdamW step on the device vs CPU
  fsdp2_fp32_step          fsdp.shard_model (FSDP2 fully_shard) over NCCL world size 1 (file store),
                           one AdamW step vs the unsharded model on the device
  fsdp2_backend_bf16_rules FSDPBackend with --fsdp-precision-rules (FSDP2 + bf16 autocast): forward
                           dtypes follow the plan, fp32 DTensor masters and grads, every param steps
  pytest_megatron_file     `pytest tests/unit/training/test_megatron_backend.py` on this machine (info only)
  broadcast                weights/transports/broadcast.py between a trainer-rank process and an
                           EngineCore: NCCL on GPU 0 (skipped where NCCL refuses two ranks on one
                           GPU), gloo without CUDA; the engine must hold exactly the sent weights
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "tests")):  # the package; the test helpers (loop_helpers, conftest)
    if _p not in sys.path:
        sys.path.insert(0, _p)

MEGATRON_TOL = 1e-5  # tests/unit/training/test_megatron_backend.py TOL (local spec, fp32)
TE_TOL = 1e-4  # the same file's TE-spec bound
ENGINE_TOL = 1e-4  # tests/unit/rollout/test_engine.py teacher-forced bound

# child process -> (timeout_s, needs the tiny checkpoints); started in this order, --jobs at a time
CHILDREN: dict[str, tuple[int, bool]] = {
    "env": (60, False),
    "megatron_local_spec": (180, True),
    "megatron_test_run": (200, True),
    "kernels": (120, False),
    "fsdp": (180, True),
    "engine": (150, True),
    "pytest_megatron_file": (240, False),
    "broadcast": (150, True),
}


# ---------------------------------------------------------------------------------------- helpers


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


def _guard(fn, *args) -> dict:
    """Run one check function; an exception becomes status "error" with the traceback."""
    t0 = time.monotonic()
    try:
        res = fn(*args)
    except BaseException as e:  # noqa: BLE001 - a check must never take the others down
        res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": _tb(e)}
    res.setdefault("wall_s", round(time.monotonic() - t0, 2))
    return res


def _status(ok: bool) -> str:
    return "pass" if ok else "fail"


def _dev():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _maxdiff(a, b) -> float:
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def _ckpts(work: Path) -> tuple[str, str]:
    return str(work / "ckpt" / "tiny"), str(work / "ckpt" / "untied")


@functools.cache  # one module object per process: its helpers are called repeatedly
def _load_test_module(name: str):
    import importlib.util

    path = REPO / "tests" / f"{name}.py"  # conftest.py and the helpers; test files sit in tiers below
    if not path.exists():
        (path,) = (REPO / "tests").glob(f"**/{name}.py")
    spec = importlib.util.spec_from_file_location(f"_gpu_checks_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ setup


def make_checkpoints(work: Path) -> dict:
    """The two tiny checkpoints of the test suite: `tiny_hf_checkpoint` (tied, models.families'
    builder) and tests/unit/training/test_megatron_backend.py's `untied` one, by that file's builder."""
    from miles_platform.models.tiny import save_tiny_checkpoint

    tied, untied = _ckpts(work)
    save_tiny_checkpoint(tied)
    _load_test_module("test_megatron_backend").save_untied_checkpoint(tied, untied)
    return {"setup": {"status": "pass", "tied": tied, "untied": untied}}


# -------------------------------------------------------------------------------------------- env


def check_env(work: Path) -> dict:
    import platform

    import torch

    out = {
        "status": "info",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(
            device_name=p.name,
            capability=f"{p.major}.{p.minor}",
            total_mem_gib=round(p.total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        )
    for mod in ("transformers", "safetensors", "megatron.core", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = f"{getattr(m, '__version__', '?')} ({Path(m.__file__).parent})"
        except Exception as e:  # noqa: BLE001
            out[mod] = f"not importable: {type(e).__name__}: {e}"
    try:
        import transformer_engine  # noqa: F401

        out["transformer_engine"] = "importable"
    except Exception as e:  # noqa: BLE001
        out["transformer_engine"] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    try:
        from miles_platform.training.megatron_backend import te_available

        out["megatron_backend.te_available"] = te_available()
    except Exception as e:  # noqa: BLE001
        out["megatron_backend.te_available"] = f"error: {type(e).__name__}: {e}"
    return {"env": out}


# --------------------------------------------------------------------------------------- megatron


def _judge_megatron(r: dict, tol: float) -> list[str]:
    """The assertions of tests/unit/training/test_megatron_backend.py, as a list of what failed."""
    bad = []
    for ck in ("tied", "untied"):
        if ck not in r:
            bad.append(f"{ck}: missing")
            continue
        x = r[ck]
        for k in ("logits_max_abs_diff", "loss_abs_diff", "grad_max_abs_diff"):
            if not x[k] < tol:
                bad.append(f"{ck}.{k}={x[k]:.3g} >= {tol}")
        if x["grads_compared"] != x["hf_params"]:
            bad.append(f"{ck}: grads_compared {x['grads_compared']} != hf_params {x['hf_params']}")
        if not x["export_identical"]:
            bad.append(f"{ck}: export not identical")
    t = r.get("tied", {})
    if "changed_after_step" in t:
        if not t["changed_after_step"] > 0:
            bad.append("resume: the optimizer step did not change the logits")
        if t["resume_logits_max_abs_diff"] != 0.0:
            bad.append(f"resume_logits_max_abs_diff={t['resume_logits_max_abs_diff']}")
        if t["ref_load_logits_max_abs_diff"] != 0.0:
            bad.append(f"ref_load_logits_max_abs_diff={t['ref_load_logits_max_abs_diff']}")
        if not t["saved_files"] >= 3:
            bad.append(f"saved_files={t['saved_files']}")
    else:
        bad.append("resume: not run")
    return bad


def check_megatron_local_spec(work: Path) -> dict:
    import torch

    tmb = _load_test_module("test_megatron_backend")
    from miles_platform.training import megatron_shims

    tied, untied = _ckpts(work)
    wdir = work / "megatron_inproc"
    wdir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    t0 = time.monotonic()
    report = {}
    report["tied"], backend, batch = tmb._compare(tied, wdir)
    params = list(backend.module.parameters())
    placement = {
        "param_devices": sorted({p.device.type for p in params}),
        "batch_device": batch[0].device.type,
        "params_dtype": sorted({str(p.dtype) for p in params}),
        "layer_spec": "transformer_engine" if report["tied"]["te_spec"] else "local",
        "matmul_allow_tf32_after_build": torch.backends.cuda.matmul.allow_tf32 if cuda else None,
    }
    report["tied"].update(tmb._resume(backend, batch, tied, wdir))
    ckpt = wdir / "iter_0000001"
    placement["saved"] = sorted(p.name for p in ckpt.iterdir())
    report["untied"], _, _ = tmb._compare(untied, wdir)
    report["shims"] = tmb._shims()
    megatron_shims.destroy_process_group()
    tol = TE_TOL if report["tied"]["te_spec"] else MEGATRON_TOL
    bad = _judge_megatron(report, tol)
    s = report["shims"]
    # on a CUDA machine the CPU shims must stay off and megatron allocates on the GPU
    if s["active"] != (not cuda):
        bad.append(f"shims.active={s['active']} with cuda={cuda}")
    if s["buffer_device"] != ("cuda" if cuda else "cpu") or not s["idempotent"]:
        bad.append(f"shims.buffer_device={s['buffer_device']} idempotent={s['idempotent']}")
    if cuda and placement["param_devices"] != ["cuda"]:
        bad.append(f"megatron params on {placement['param_devices']}")
    return {
        "megatron_local_spec": {
            "status": _status(not bad),
            "ran_on_cuda": cuda and placement["param_devices"] == ["cuda"],
            "tolerance": tol,
            "failures": bad,
            "report": report,
            **placement,
            "compute_s": round(time.monotonic() - t0, 2),
        }
    }


def check_megatron_test_run(work: Path) -> dict:
    """tests/unit/training/test_megatron_backend.py's fixture path: `_run("cpu", work, tied, untied)` (a subprocess
    of that file with PYTHONPATH=<repo>, gloo/nccl world size 1; dev = cuda when available)."""
    import torch

    tmb = _load_test_module("test_megatron_backend")
    tied, untied = _ckpts(work)
    wdir = work / "megatron_run"
    wdir.mkdir(parents=True, exist_ok=True)
    r = tmb._run("cpu", str(wdir), tied, untied)
    cuda = torch.cuda.is_available()
    tol = TE_TOL if r["tied"]["te_spec"] else MEGATRON_TOL
    bad = _judge_megatron(r, tol)
    s = r["shims"]
    if s["active"] != (not cuda):
        bad.append(f"shims.active={s['active']} with cuda={cuda}")
    want_device = "cuda" if cuda else "cpu"  # tests/unit/training/test_megatron_backend.py::test_cpu_shims
    test_cpu_shims_would_pass = (
        s["active"] == (not cuda) and s["buffer_device"] == want_device and s["idempotent"]
    )
    return {
        "megatron_test_run": {
            "status": _status(not bad),
            "ran_on_cuda": cuda and s["buffer_device"] == "cuda",
            "tolerance": tol,
            "failures": bad,
            "report": r,
            "test_cpu_shims_assertions_hold": test_cpu_shims_would_pass,
        }
    }


# ----------------------------------------------------------------------------------------- engine


def _teacher_forced(model, prompt, output, dev):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device=dev)).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    return lp.gather(1, torch.tensor(output, device=dev)[:, None])[:, 0].cpu()


def check_engine(work: Path) -> dict:
    import inspect

    import torch
    import transformers

    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.rollout import engine_batch, engine_core, engine_requests, engine_weights
    from miles_platform.rollout.engine_core import EngineCore

    cuda = torch.cuda.is_available()
    tied, _ = _ckpts(work)
    params = list(inspect.signature(EngineCore.__init__).parameters)
    has_device = any(p in params for p in ("device", "device_id", "gpu_id"))
    cuda_lines = [
        ln.strip()
        for mod in (engine_core, engine_requests, engine_batch, engine_weights)
        for ln in inspect.getsource(mod).splitlines()
        if "cuda" in ln and "#" not in ln
    ]
    out = {}
    if not has_device:
        out["engine_on_device"] = {
            "status": "skipped",
            "reason": "EngineCore has no device argument: it loads the model with the default (CPU) "
            "device and builds its input ids, masks and KV cache on the CPU",
            "EngineCore.__init__": params,
            "cuda_mentions_in_engine_modules": cuda_lines,
        }

    eng = EngineCore(tied, dtype="fp32", max_batch_size=8)
    try:
        model, tok = load_hf_checkpoint(tied)
        prompts = [tok("What is 7+11?")["input_ids"], tok("What is 14+")["input_ids"], [5, 6, 7]]
        res = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 3},
            return_logprob=True,
            timeout=120,
        )
        engine_dev = next(eng.model.parameters()).device.type
    finally:
        eng.stop()
    dev = "cuda" if cuda else "cpu"
    dmodel = load_hf_checkpoint(tied)[0].to(dev)
    rows, cpu_max, dev_max, cpu_dev_max = [], 0.0, 0.0, 0.0
    for prompt, r in zip(prompts, res):
        lps = torch.tensor([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
        ref_cpu = _teacher_forced(model, prompt, r["output_ids"], "cpu")
        ref_dev = _teacher_forced(dmodel, prompt, r["output_ids"], dev)
        d_cpu, d_dev = _maxdiff(lps, ref_cpu), _maxdiff(lps, ref_dev)
        cpu_max, dev_max = max(cpu_max, d_cpu), max(dev_max, d_dev)
        cpu_dev_max = max(cpu_dev_max, _maxdiff(ref_cpu, ref_dev))
        rows.append(
            {
                "prompt_len": len(prompt),
                "n_out": len(r["output_ids"]),
                "max_diff_vs_device": d_dev,
                "per_token_abs_diff_vs_device": [round(float(x), 7) for x in (lps - ref_dev).abs()],
            }
        )
    ok = dev_max < ENGINE_TOL and cpu_max < ENGINE_TOL and all(x["n_out"] == 12 for x in rows)
    out["engine_logprobs_vs_device_forward"] = {
        "status": _status(ok),
        "ran_on_cuda": cuda,
        "engine_device": engine_dev,
        "teacher_forced_device": dev,
        "tolerance": ENGINE_TOL,
        "engine_vs_cpu_forward_max_abs_diff": cpu_max,
        "engine_vs_device_forward_max_abs_diff": dev_max,
        "cpu_vs_device_forward_max_abs_diff": cpu_dev_max,
        "rows": rows,
        # the engine passes its KV cache as `cache=` (transformers >= 5.2x); an older transformers
        # names it `past_key_values` and swallows `cache` into **kwargs: decode steps then see no context
        "transformers": transformers.__version__,
        "forward_accepts_cache_kwarg": "cache" in inspect.signature(type(model).forward).parameters,
    }
    if has_device:
        out["engine_on_device"] = {
            "status": "info",
            "note": "EngineCore takes a device argument: not wired here",
        }
    return out


# ---------------------------------------------------------------------------------------- kernels


def _kernel_fp8(dev: str) -> dict:
    import torch

    from kernels import quant as kq

    g = torch.Generator().manual_seed(0)
    cases = {
        "300x260_fp32": torch.randn(300, 260, generator=g) * torch.logspace(-3, 1, 260),
        "4096x4096_bf16": torch.randn(4096, 4096, generator=g).to(torch.bfloat16),
    }
    res, ok = {}, True
    for name, w in cases.items():
        q_c, s_c = kq.fp8_block_quant(w)
        q_d, s_d = kq.fp8_block_quant(w.to(dev))
        same_q = torch.equal(q_c.view(torch.uint8), q_d.cpu().view(torch.uint8))
        mismatches = int((q_c.view(torch.uint8) != q_d.cpu().view(torch.uint8)).sum())
        same_s = torch.equal(s_c, s_d.cpu())
        deq_d = kq.fp8_block_dequant(q_d, s_d)
        deq_c = kq.fp8_block_dequant(q_c, s_c)
        res[name] = {
            "out_device": q_d.device.type,
            "q_bit_exact": same_q,
            "q_mismatching_elements": mismatches,
            "scale_inv_exact": same_s,
            "scale_inv_mismatching_blocks": int((s_c != s_d.cpu()).sum()),
            "scale_inv_max_rel_diff": float(((s_c - s_d.cpu()).abs() / s_c).max()),
            "scale_inv_numel": s_c.numel(),
            "dequant_max_abs_diff": _maxdiff(deq_c, deq_d),
            "roundtrip_max_rel_err": float(
                (deq_d.cpu().float() - w.float()).abs().max() / w.float().abs().max()
            ),
            "roundtrip_max_rel_err_cpu": float(
                (deq_c.float() - w.float()).abs().max() / w.float().abs().max()
            ),
        }
        ok = ok and same_q and same_s and res[name]["dequant_max_abs_diff"] == 0.0
    return {"status": _status(ok), "cases": res}


def _kernel_int4(dev: str) -> dict:
    import torch

    from kernels import quant as kq

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 256, generator=g) * torch.logspace(-3, 1, 256)).to(torch.bfloat16)
    res, ok = {}, True
    q_c, s_c = kq.int4_quant(w, 128)
    q_d, s_d = kq.int4_quant(w.to(dev), 128)
    res["int4_quant"] = {
        "out_device": q_d.device.type,
        "q_exact": torch.equal(q_c, q_d.cpu()),
        "q_mismatching_elements": int((q_c != q_d.cpu()).sum()),
        "q_numel": q_c.numel(),
        "scale_exact": torch.equal(s_c, s_d.cpu()),
        "scale_mismatching_groups": int((s_c != s_d.cpu()).sum()),
        "scale_numel": s_c.numel(),
    }
    ok = ok and res["int4_quant"]["q_exact"] and res["int4_quant"]["scale_exact"]
    for name, fn in {
        "pack_int4": lambda: (kq.pack_int4(q_c), kq.pack_int4(q_d)),
        "unpack_int4": lambda: (
            kq.unpack_int4(kq.pack_int4(q_c), 256),
            kq.unpack_int4(kq.pack_int4(q_c).to(dev), 256),
        ),
        "int4_pack_quantize": lambda: (
            kq.int4_pack_quantize(w, 128)["weight_packed"],
            kq.int4_pack_quantize(w.to(dev), 128)["weight_packed"],
        ),
        "fake_int4_quant": lambda: (kq.fake_int4_quant(w, 128), kq.fake_int4_quant(w.to(dev), 128)),
    }.items():
        try:
            a, b = fn()
            res[name] = {"out_device": b.device.type, "exact": torch.equal(a, b.cpu())}
            ok = ok and res[name]["exact"]
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            ok = False
    try:
        p = kq.int4_pack_quantize(w.to(dev), 128)
        deq = kq.int4_dequant(p["weight_packed"], p["weight_scale"], p["weight_shape"])
        ref = kq.int4_dequant(*kq.int4_pack_quantize(w, 128).values())
        res["int4_dequant"] = {"out_device": deq.device.type, "max_abs_diff": _maxdiff(ref, deq)}
        ok = ok and res["int4_dequant"]["max_abs_diff"] == 0.0
    except Exception as e:  # noqa: BLE001
        res["int4_dequant"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        ok = False
    # straight-through gradient on the device
    try:
        wd = w.float().to(dev).requires_grad_(True)
        kq.fake_int4_quant(wd, 128).sum().backward()
        res["fake_int4_ste_grad_is_ones"] = bool(torch.equal(wd.grad.cpu(), torch.ones(wd.shape)))
        ok = ok and res["fake_int4_ste_grad_is_ones"]
    except Exception as e:  # noqa: BLE001
        res["fake_int4_ste_grad_is_ones"] = f"error: {type(e).__name__}: {str(e)[:400]}"
        ok = False
    return {"status": _status(ok), "results": res}


def _kernel_logprob(dev: str) -> dict:
    import torch

    from kernels import logprob as kl

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 700, 1000, generator=g) * 3
    tokens = torch.randint(0, 1000, (4, 700), generator=g)
    ref_lp = kl.log_probs_reference(logits.double(), tokens).float()
    ref_ent = kl.entropy_reference(logits.double()).float()
    lp = kl.selective_log_softmax(logits.to(dev), tokens.to(dev), chunk_size=512)
    ent = kl.entropy_from_logits(logits.to(dev), chunk_size=512)
    lp_bf16 = kl.selective_log_softmax(logits.to(dev).bfloat16(), tokens.to(dev))
    ref_bf16 = kl.log_probs_reference(logits.bfloat16(), tokens)
    d = {
        "out_device": lp.device.type,
        "selective_log_softmax_max_abs_diff_vs_fp64": _maxdiff(ref_lp, lp),
        "entropy_max_abs_diff_vs_fp64": _maxdiff(ref_ent, ent),
        "bf16_logits_vs_cpu_reference_max_abs_diff": _maxdiff(ref_bf16, lp_bf16),
    }
    ok = max(v for v in d.values() if isinstance(v, float)) < 1e-4
    return {"status": _status(ok), **d}


def _kernel_xor_delta(dev: str) -> dict:
    import torch

    from kernels import xor_delta as kx

    g = torch.Generator().manual_seed(3)
    old = torch.randn(1 << 20, generator=g)  # 4 MiB fp32
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=g)[:5000].sort().values
    new[idx] += 1.0
    ob_c, nb_c = old.view(torch.uint8), new.view(torch.uint8)
    ob_d, nb_d = ob_c.to(dev), nb_c.to(dev)
    res, ok = {}, True

    def run(name, fn):
        nonlocal ok
        try:
            r = fn()
            res[name] = r
            ok = ok and all(v for k, v in r.items() if k.startswith("ok"))
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            ok = False

    def xor():
        dx = kx.xor_bytes(ob_d, nb_d)
        ref = kx.xor_bytes_reference(ob_c, nb_c)
        buf = ob_d.clone()
        kx.apply_xor_(buf, dx)
        return {
            "out_device": dx.device.type,
            "ok_equal_reference": torch.equal(dx.cpu(), ref),
            "ok_apply_recovers_new": torch.equal(buf.cpu(), nb_c),
            "nonzero_bytes": kx.count_nonzero_bytes(dx),
            "nonzero_bytes_cpu": kx.count_nonzero_bytes(ref),
        }

    def overwrite():
        i_d, v_d = kx.changed_positions(ob_d, nb_d, 4)
        i_c, v_c = kx.changed_positions_reference(ob_c, nb_c, 4)
        buf = ob_d.clone()
        kx.apply_overwrite_(buf, i_d, v_d, 4)
        gaps, kind = kx.encode_indices(i_d)
        return {
            "out_device": i_d.device.type,
            "n_changed": int(i_d.numel()),
            "ok_indices_equal_reference": torch.equal(i_d.cpu(), i_c) and torch.equal(i_d.cpu(), idx),
            "ok_values_equal_reference": torch.equal(v_d.cpu(), v_c),
            "ok_apply_recovers_new": torch.equal(buf.cpu(), nb_c),
            "ok_indices_roundtrip": torch.equal(kx.decode_indices(gaps).cpu(), i_c),
            "index_dtype": kind,
        }

    def unaligned():  # storage offset 1: the byte-wise reference path on the device
        o, n = ob_d[1:-3], nb_d[1:-3]
        i_d, v_d = kx.changed_positions(o, n, 4)
        i_c, v_c = kx.changed_positions_reference(ob_c[1:-3], nb_c[1:-3], 4)
        return {"ok_equal_reference": torch.equal(i_d.cpu(), i_c) and torch.equal(v_d.cpu(), v_c)}

    def tensor_bytes():
        b = kx.tensor_bytes(old.to(dev))
        return {"returns_device": b.device.type, "ok_bytes_equal": torch.equal(b.cpu(), ob_c)}

    run("xor", xor)
    run("overwrite", overwrite)
    run("unaligned_overwrite", unaligned)
    run("tensor_bytes", tensor_bytes)
    return {"status": _status(ok), "results": res}


def check_kernels(work: Path) -> dict:
    import torch

    dev = _dev()
    out = {}
    for name, fn in (
        ("kernels_fp8", _kernel_fp8),
        ("kernels_int4", _kernel_int4),
        ("kernels_logprob", _kernel_logprob),
        ("kernels_xor_delta", _kernel_xor_delta),
    ):
        out[name] = _guard(fn, dev)
        out[name]["ran_on_cuda"] = dev == "cuda"
        if dev == "cuda":
            torch.cuda.synchronize()
    return out


# ------------------------------------------------------------------------------------------- fsdp


def _batch(vocab: int, dev: str):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = (torch.rand(3, 12, generator=g) > 0.2).float()
    pos = torch.arange(12).expand(3, 12)
    return ids.to(dev), pos.to(dev), mask.to(dev)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _one_step(named_params, logits_fn, batch, lr=1e-2) -> dict:
    """loss, grads and parameters after one AdamW step, all on CPU (full tensors)."""
    import torch

    ids, pos, mask = batch
    loss = _load_test_module("test_megatron_backend")._nll(
        logits_fn(ids, pos), ids, mask
    )  # the parity test's loss
    loss.backward()
    params = dict(named_params())
    grad_dtypes = sorted({str(p.grad.dtype) for p in params.values() if p.grad is not None})
    grads = {n: _full(p.grad).detach().float().cpu() for n, p in params.items() if p.grad is not None}
    before = {n: _full(p.detach()).float().cpu().clone() for n, p in params.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=lr)
    opt.step()
    opt.zero_grad()
    after = {n: _full(p.detach()).float().cpu() for n, p in params.items()}
    return {
        "loss": float(loss.detach()),
        "grads": grads,
        "grad_dtypes": grad_dtypes,
        "after": after,
        "moved": sum(not torch.equal(before[n], after[n]) for n in params),
        "n_params": len(params),
    }


def _cmp_steps(a: dict, b: dict) -> dict:
    return {
        "loss_abs_diff": abs(a["loss"] - b["loss"]),
        "grad_max_abs_diff": max(_maxdiff(a["grads"][n], b["grads"][n]) for n in a["grads"]),
        "param_after_step_max_abs_diff": max(_maxdiff(a["after"][n], b["after"][n]) for n in a["after"]),
        "same_param_names": sorted(a["after"]) == sorted(b["after"]),
        "grads_compared": len(set(a["grads"]) & set(b["grads"])),
    }


def check_fsdp(work: Path) -> dict:
    import torch
    import torch.distributed as dist

    from miles_platform.config import RunConfig
    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.training.fsdp import shard_model, wrap_units
    from miles_platform.training.fsdp_backend import FSDPBackend

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    tied, _ = _ckpts(work)
    out = {}

    def plain(device):
        b = FSDPBackend(RunConfig(), 0, 1)
        b.build(tied)
        b.module.to(device)
        return b

    ref_cpu = plain("cpu")
    vocab = ref_cpu.module.config.vocab_size
    step_cpu = _one_step(ref_cpu.named_parameters, ref_cpu.logits, _batch(vocab, "cpu"))

    def plain_step():
        b = plain(dev)
        s = _one_step(b.named_parameters, b.logits, _batch(vocab, dev))
        devs = sorted({p.device.type for p in b.parameters()})
        c = _cmp_steps(step_cpu, s)
        ok = (
            c["loss_abs_diff"] < 1e-5
            and c["grad_max_abs_diff"] < 1e-5
            and c["param_after_step_max_abs_diff"] < 1e-5
            and s["moved"] == s["n_params"]
        )
        return {"status": _status(ok), "ran_on_cuda": devs == ["cuda"], "param_devices": devs,
                "vs": "same step on CPU", **c, "moved": s["moved"], "n_params": s["n_params"]}  # fmt: skip

    out["fsdp_plain_step"] = _guard(plain_step)

    # FSDP2 over a real process group: NCCL on CUDA (gloo without), world size 1, file store
    backend = "nccl" if cuda else "gloo"
    try:
        if cuda:
            torch.cuda.set_device(0)
        store = dist.FileStore(str(work / f"fsdp_store_{os.getpid()}"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    except Exception as e:  # noqa: BLE001
        err = {"status": "error", "error": f"init_process_group({backend}): {type(e).__name__}: {e}"}
        out["fsdp2_fp32_step"] = dict(err)
        out["fsdp2_backend_bf16_rules"] = dict(err)
        return out

    def fsdp2_fp32():
        ref = plain(dev)
        s_ref = _one_step(ref.named_parameters, ref.logits, _batch(vocab, dev))
        model = shard_model(load_hf_model(tied), RunConfig())
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        dtensor = all(isinstance(p, DTensor) for p in params)
        devs = sorted({p.device.type for p in params})

        def logits(ids, pos):
            return model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits

        s = _one_step(model.named_parameters, logits, _batch(vocab, dev))
        c = _cmp_steps(s_ref, s)
        ok = (
            dtensor
            and c["same_param_names"]
            and c["loss_abs_diff"] < 1e-5
            and c["grad_max_abs_diff"] < 1e-5
            and c["param_after_step_max_abs_diff"] < 1e-5
            and s["moved"] == s["n_params"]
        )
        return {"status": _status(ok), "ran_on_cuda": devs == ["cuda"], "process_group": backend,
                "world_size": dist.get_world_size(), "units": wrap_units(model), "params_are_dtensors": dtensor,
                "param_devices": devs, "vs": "unsharded model, same step, same device", **c,
                "moved": s["moved"], "n_params": s["n_params"]}  # fmt: skip

    out["fsdp2_fp32_step"] = _guard(fsdp2_fp32)

    def fsdp2_rules():
        from torch.distributed.tensor import DTensor

        cfg = RunConfig(
            train_forward_dtype="bf16",
            rollout_dtype="bf16",
            fsdp_precision_rules="module:model.layers.1=bf16",
        )
        b = FSDPBackend(cfg, 0, 1)
        b.build(tied)  # rules set: goes through fsdp.shard_model (FSDP2) even at world size 1
        model = b.module
        plan = model.precision_plan
        tpf = _load_test_module("test_precision_fsdp")  # the same forward-dtype probe as its tests
        seen, s = tpf._forward_param_dtypes(
            model, lambda: _one_step(b.named_parameters, b.logits, _batch(vocab, dev))
        )
        params = list(model.parameters())
        masters = sorted({str(p.dtype) for p in params})
        devs = sorted({p.device.type for p in params})
        dtensor = all(isinstance(p, DTensor) for p in params)
        # every planned parameter carried its planned dtype in the forward (a tied lm_head.weight is
        # the embedding's Parameter under a second name: seen, not planned)
        mismatched = {k: (seen.get(k), v) for k, v in plan.param_dtype.items() if seen.get(k) != v}
        forward_matches_plan = not mismatched
        grads = s["grad_dtypes"]
        ok = (
            forward_matches_plan
            and masters == ["torch.float32"]
            and grads == ["torch.float32"]
            and dtensor
            and s["moved"] == s["n_params"]
            and bool(torch.isfinite(torch.tensor(s["loss"])))
        )
        return {"status": _status(ok), "ran_on_cuda": devs == ["cuda"], "process_group": backend,
                "units": wrap_units(model), "needs_param_maps": plan.needs_param_maps,
                "forward_dtypes_match_plan": forward_matches_plan, "mismatched": mismatched,
                "seen_not_planned": sorted(set(seen) - set(plan.param_dtype)),
                "bf16_params_in_forward": sorted(k for k, v in seen.items() if v == "bf16"),
                "master_dtypes": masters, "grad_dtypes": grads, "params_are_dtensors": dtensor,
                "loss_bf16": s["loss"], "loss_abs_diff_vs_fp32_cpu": abs(s["loss"] - step_cpu["loss"]),
                "moved": s["moved"], "n_params": s["n_params"]}  # fmt: skip

    out["fsdp2_backend_bf16_rules"] = _guard(fsdp2_rules)
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------ pytest


def check_pytest_megatron_file(work: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rA",
        "-p",
        "no:cacheprovider",
        "tests/unit/training/test_megatron_backend.py",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=230)
    lines = proc.stdout.splitlines()
    outcomes = [ln for ln in lines if ln.split(" ")[0] in ("PASSED", "FAILED", "ERROR", "SKIPPED")]
    return {
        "pytest_megatron_file": {
            "status": "info",
            "cmd": " ".join(cmd[1:]),
            "rc": proc.returncode,
            "outcomes": outcomes,
            "summary": lines[-1] if lines else "",
            "tail": (proc.stdout + proc.stderr)[-2500:],
            "wall_s": round(time.monotonic() - t0, 1),
        }
    }


# ------------------------------------------------------------------------------------- broadcast


def _expected_broadcast_state(ckpt: str) -> dict:
    from safetensors.torch import load_file

    state = load_file(str(Path(ckpt) / "model.safetensors"))
    return {
        k: v + 0.01 * (i + 1) if v.is_floating_point() else v
        for i, (k, v) in enumerate(sorted(state.items()))
    }


def _ensure_ray_importable() -> None:
    """broadcast.py imports ray for its endpoint helper only; the two functions used here do not
    need it. Where the image lacks ray, an empty module stands in (in every process)."""
    import types

    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules["ray"] = types.ModuleType("ray")


def _trainer_rank(ckpt: str, port: int, backend: str, group_name: str, errq) -> None:
    """Rank 0 of the weights group, in its own process: what TrainerActor.broadcast_weights does."""
    try:
        _ensure_ray_importable()
        import torch

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
    except BaseException as e:  # noqa: BLE001
        errq.put(f"{type(e).__name__}: {e}")


def check_broadcast(work: Path) -> dict:
    """weights/transports/broadcast.py + EngineCore.update_weights_from_distributed between two
    processes on this machine: NCCL with CUDA (both ranks on GPU 0), gloo without. Ray is not needed
    by these two functions; where the image lacks it, an empty module stands in for the import."""
    import multiprocessing as mp

    import torch

    _ensure_ray_importable()
    from miles_platform.cluster.ports import free_port
    from miles_platform.rollout.engine_core import EngineCore

    tied, _ = _ckpts(work)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    expected = _expected_broadcast_state(tied)
    names = sorted(expected)
    core = EngineCore(tied, dtype="fp32")
    port, group_name = free_port("127.0.0.1"), "miles_weights_check"
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    proc = ctx.Process(target=_trainer_rank, args=(tied, port, backend, group_name, errq), daemon=True)
    t0 = time.monotonic()
    proc.start()
    try:
        first = errq.get(timeout=90)  # "imported", or the trainer's early error: do not wait 120 s on it
        if first != "imported":
            raise RuntimeError(f"trainer rank failed before joining: {first}")
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
    except BaseException as e:  # noqa: BLE001
        proc.kill()
        msg = f"{type(e).__name__}: {e}"
        skipped = cuda and "duplicate gpu" in msg.lower()
        return {
            "broadcast": {
                "status": "skipped" if skipped else "error",
                "reason": "NCCL refuses two ranks on one GPU; needs 2+ GPUs" if skipped else None,
                "error": msg[:3000],
                "backend": backend,
                "ran_on_cuda": cuda,
            }
        }
    finally:
        core.stop()
    compared = [n for n in names if n in got]
    diff = max(_maxdiff(got[n], expected[n]) for n in compared)
    ok = trainer_error is None and version == 1 and diff == 0.0 and len(compared) >= len(got)
    return {
        "broadcast": {
            "status": _status(ok),
            "backend": backend,
            "ran_on_cuda": cuda,
            "tensors": len(names),
            "bytes": sum(t.numel() * t.element_size() for t in expected.values()),
            "engine_version_after": version,
            "max_abs_diff_engine_vs_trainer": diff,
            "trainer_error": trainer_error,
            "seconds_incl_group_setup": round(seconds, 2),
        }
    }


CHILD_FNS = {
    "broadcast": check_broadcast,
    "setup": make_checkpoints,
    "env": check_env,
    "megatron_local_spec": check_megatron_local_spec,
    "megatron_test_run": check_megatron_test_run,
    "engine": check_engine,
    "kernels": check_kernels,
    "fsdp": check_fsdp,
    "pytest_megatron_file": check_pytest_megatron_file,
}


def child_main(name: str, work: Path, result: Path) -> None:
    t0 = time.monotonic()
    try:
        res = CHILD_FNS[name](work)
    except BaseException as e:  # noqa: BLE001
        res = {
            name: {"status": "error", "error": f"{type(e).__name__}: {str(e)[:3000]}", "traceback": _tb(e)}
        }
    for v in res.values():
        v.setdefault("wall_s", round(time.monotonic() - t0, 2))
    result.write_text(json.dumps(res, indent=1, default=str))


# ------------------------------------------------------------------------------------------ parent


class Runner:
    def __init__(self, out: Path, work: Path, deadline_s: float):
        self.out, self.work = out, work
        self.end = time.monotonic() + deadline_s
        self.lock = threading.Lock()
        self.report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": {}}
        self.log = open(out / "gpu_checks.log", "w")  # noqa: SIM115

    def write(self) -> None:
        with self.lock:
            c = self.report["checks"]
            self.report["summary"] = {k: v.get("status") for k, v in c.items()}
            judged = {k: v for k, v in c.items() if v.get("status") in ("pass", "fail", "error")}
            self.report["all_judged_pass"] = bool(judged) and all(
                v["status"] == "pass" for v in judged.values()
            )
            tmp = self.out / "gpu_checks.json.tmp"
            tmp.write_text(json.dumps(self.report, indent=1, default=str))
            tmp.replace(self.out / "gpu_checks.json")

    def child(self, name: str, timeout: float) -> dict:
        timeout = min(timeout, self.end - time.monotonic() - 3)
        if timeout < 5:
            return {name: {"status": "error", "error": "not run: the overall deadline was reached"}}
        result = self.work / f"result_{name}.json"
        env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
                       [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))  # fmt: skip
        cmd = [sys.executable, __file__, "--child", name, "--work", str(self.work), "--result", str(result)]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the child and the processes it started
            output, _ = proc.communicate()
        wall = round(time.monotonic() - t0, 1)
        with self.lock:
            self.log.write(
                f"\n===== {name} (rc={proc.returncode}, {wall}s{', TIMEOUT' if timed_out else ''})\n"
            )
            self.log.write(output or "")
            self.log.flush()
        if result.exists():
            res = json.loads(result.read_text())
        else:
            why = f"timed out after {timeout:.0f}s" if timed_out else f"child exited rc={proc.returncode}"
            res = {name: {"status": "error", "error": why, "output_tail": (output or "")[-3000:]}}
        for v in res.values():
            v["child"], v["child_wall_s"] = name, wall
        print(
            f"[gpu_checks] {name}: " + ", ".join(f"{k}={v.get('status')}" for k, v in res.items()), flush=True
        )
        return res

    def run(self, names: list[str], jobs: int) -> dict:
        setup = self.child("setup", 120)
        self.report["checks"].update(setup)
        self.write()
        have_ckpts = setup["setup"]["status"] == "pass"

        def one(name):
            timeout, needs = CHILDREN[name]
            if needs and not have_ckpts:
                res = {name: {"status": "error", "error": "not run: setup (tiny checkpoints) failed"}}
            else:
                res = self.child(name, timeout)
            with self.lock:
                self.report["checks"].update(res)
            self.write()

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, names))
        env = self.report["checks"].get("env", {})
        self.report["cuda"] = bool(env.get("cuda_available"))
        self.report["device_name"] = env.get("device_name")
        self.report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.write()
        self.log.close()
        return self.report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="report directory (gpu_checks.json, gpu_checks.log)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a new temp dir)")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(CHILDREN))
    ap.add_argument("--jobs", type=int, default=0, help="checks at a time (default: 4 with CUDA, else 2)")
    ap.add_argument("--deadline", type=float, default=380.0, help="seconds for the whole run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child_main(a.child, a.work, a.result)
        return 0
    if a.out is None:
        ap.error("--out is required")
    import tempfile

    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="gpu_checks_"))
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in a.only.split(",") if n] or list(CHILDREN)
    unknown = set(names) - set(CHILDREN)
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}")
    jobs = a.jobs or (4 if Path("/dev/nvidia0").exists() or os.environ.get("CUDA_VISIBLE_DEVICES") else 2)
    report = Runner(a.out, work, a.deadline).run(names, jobs)
    print(json.dumps(report["summary"], indent=1))
    return 0 if report["all_judged_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
