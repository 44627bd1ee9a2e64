"""--train-backend megatron: parity with the torch-native HF model, export, resume, --ref-load, shims.

Everything runs once in a subprocess (tests/megatron_parity.py as a script, gloo world size 1) and
reports numbers as JSON; the tests below assert on them. tests/gpu/test_megatron_gpu.py judges the
same numbers on a CUDA machine.
"""

import pytest
import torch
from megatron_parity import TE_TOL, TOL
from megatron_parity import run as _run

from miles_platform.models.tiny import save_untied_checkpoint


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    untied = save_untied_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("mb") / "untied")
    work = tmp_path_factory.mktemp("mb_work")
    return _run("cpu", str(work), tiny_hf_checkpoint, str(untied))


@pytest.mark.parametrize("ckpt", ["tied", "untied"])
def test_logits_loss_grads_match_torch_native(report, ckpt):
    r = report[ckpt]
    assert r["logits_max_abs_diff"] < TOL
    assert r["loss_abs_diff"] < TOL
    assert r["grad_max_abs_diff"] < TOL
    assert r["grads_compared"] == r["hf_params"]  # every HF parameter has a megatron gradient


@pytest.mark.parametrize("ckpt", ["tied", "untied"])
def test_export_is_the_hf_state(report, ckpt):
    assert report[ckpt]["export_identical"]


def test_resume_gives_identical_logits(report):
    r = report["tied"]
    assert r["changed_after_step"] > 0  # the step moved the weights, so the load had work to do
    assert r["resume_logits_max_abs_diff"] == 0.0
    assert r["ref_load_logits_max_abs_diff"] == 0.0
    assert r["saved_files"] >= 3  # torch_dist: metadata.json, .metadata, *.distcp


def test_cpu_shims(report):
    s = report["shims"]
    assert s["active"] == (not torch.cuda.is_available())
    assert s["buffer_device"] == ("cuda" if torch.cuda.is_available() else "cpu") and s["idempotent"]


@pytest.mark.gpu
def test_transformer_engine_spec_parity(tiny_hf_checkpoint, tmp_path):
    r = _run("gpu", str(tmp_path), tiny_hf_checkpoint)
    assert r["tied"]["te_spec"] and r["tied"]["export_identical"]
    assert r["tied"]["logits_max_abs_diff"] < TE_TOL and r["tied"]["grad_max_abs_diff"] < TE_TOL
