"""MegatronBackend (local spec unless transformer-engine imports) against the HF model on the device:
tests/megatron_parity.py's numbers, judged as tests/unit/training/test_megatron_backend.py judges
them (fp32 bound 1e-5, 1e-4 with the TE spec), in this process and through the unit test's own
subprocess path. With CUDA the CPU shims must stay off and megatron must allocate on the GPU."""

from __future__ import annotations

import pytest
import torch
from megatron_parity import TE_TOL, TOL, compare, resume, shims

pytestmark = pytest.mark.gpu


def _failures(r: dict, tol: float) -> list[str]:
    """The assertions of tests/unit/training/test_megatron_backend.py, as a list of what failed."""
    bad = []
    for ck in ("tied", "untied"):
        x = r[ck]
        for k in ("logits_max_abs_diff", "loss_abs_diff", "grad_max_abs_diff"):
            if not x[k] < tol:
                bad.append(f"{ck}.{k}={x[k]:.3g} >= {tol}")
        if x["grads_compared"] != x["hf_params"]:
            bad.append(f"{ck}: grads_compared {x['grads_compared']} != hf_params {x['hf_params']}")
        if not x["export_identical"]:
            bad.append(f"{ck}: export not identical")
    t = r["tied"]
    if not t["changed_after_step"] > 0:
        bad.append("resume: the optimizer step did not change the logits")
    for k in ("resume_logits_max_abs_diff", "ref_load_logits_max_abs_diff"):
        if t[k] != 0.0:
            bad.append(f"{k}={t[k]}")
    if not t["saved_files"] >= 3:  # torch_dist: metadata.json, .metadata, *.distcp
        bad.append(f"saved_files={t['saved_files']}")
    cuda = torch.cuda.is_available()
    s = r["shims"]
    if s["active"] != (not cuda):  # on a CUDA machine the CPU shims stay off
        bad.append(f"shims.active={s['active']} with cuda={cuda}")
    if s["buffer_device"] != ("cuda" if cuda else "cpu") or not s["idempotent"]:
        bad.append(f"shims.buffer_device={s['buffer_device']} idempotent={s['idempotent']}")
    return bad


@pytest.fixture(scope="module")
def in_process(tiny_hf_checkpoint, untied_hf_checkpoint, tmp_path_factory):
    """compare / resume / compare / shims in this process (megatron's group: world size 1)."""
    from miles_platform.training import megatron_shims

    work = tmp_path_factory.mktemp("megatron_inproc")
    report = {}
    report["tied"], backend, batch = compare(tiny_hf_checkpoint, work)
    params = list(backend.module.parameters())
    placement = {
        "param_devices": sorted({p.device.type for p in params}),
        "batch_device": batch[0].device.type,
        "params_dtype": sorted({str(p.dtype) for p in params}),
        "layer_spec": "transformer_engine" if report["tied"]["te_spec"] else "local",
        "matmul_allow_tf32_after_build": torch.backends.cuda.matmul.allow_tf32,
    }
    report["tied"].update(resume(backend, batch, tiny_hf_checkpoint, work))
    placement["saved"] = sorted(p.name for p in (work / "iter_0000001").iterdir())
    report["untied"], _, _ = compare(untied_hf_checkpoint, work)
    report["shims"] = shims()
    megatron_shims.destroy_process_group()
    return report, placement


def test_megatron_matches_hf_resumes_and_exports_on_the_device(in_process, record):
    report, placement = in_process
    tol = TE_TOL if report["tied"]["te_spec"] else TOL
    bad = _failures(report, tol)
    record(tolerance=tol, failures=bad, report=report, **placement)
    record.ran_on(*placement["param_devices"])
    assert not bad, bad


def test_megatron_unit_test_subprocess_path_on_the_device(
    tiny_hf_checkpoint, untied_hf_checkpoint, tmp_path, record
):
    """tests/unit/training/test_megatron_backend.py's fixture, exactly as it runs it: `run("cpu", ...)`
    ("cpu" names the local-spec checks; the device is CUDA when available)."""
    from megatron_parity import run

    r = run("cpu", str(tmp_path), tiny_hf_checkpoint, untied_hf_checkpoint)
    tol = TE_TOL if r["tied"]["te_spec"] else TOL
    bad = _failures(r, tol)
    record(tolerance=tol, failures=bad, report=r)
    record.ran_on(r["shims"]["buffer_device"])
    assert not bad, bad
