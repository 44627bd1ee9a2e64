"""--train-backend megatron: parity with the torch-native HF model, export, resume, --ref-load, shims.

Everything runs once in a subprocess (this file as a script, gloo world size 1) and reports
numbers as JSON; the tests below assert on them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_helpers import warm_python

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5


def _run(*args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run(
        [*warm_python(), __file__, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def save_untied_checkpoint(tied: str, path) -> str:
    """GQA with 2 query groups and untied embeddings, the tokenizer of `tied` (scripts/gpu_checks.py
    builds its untied checkpoint with this too)."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config

    tok = load_tokenizer(tied)
    cfg = tiny_qwen3_config(
        len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=2, tie_word_embeddings=False,
    )  # fmt: skip
    save_hf_checkpoint(build_model(cfg, seed=2), tok, path)
    return str(path)


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
    assert r["tied"]["logits_max_abs_diff"] < 1e-4 and r["tied"]["grad_max_abs_diff"] < 1e-4


# ---------------------------------------------------------------- subprocess side


def _nll(logits, ids, mask):
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()


def _compare(hf_path: str, work: Path) -> dict:
    from types import SimpleNamespace

    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.training.megatron_backend import MegatronBackend, uses_fused_norms

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = SimpleNamespace(tensor_model_parallel_size=1, seed=7, ref_load=None)
    backend = MegatronBackend(cfg)
    backend.build(hf_path)
    hf = load_hf_model(hf_path).to(dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, backend.vocab_size, (3, 12), generator=g).to(dev)
    pos = torch.arange(12, device=dev).expand(3, 12)
    mask = (torch.rand(3, 12, generator=g) > 0.2).float().to(dev)

    m_logits = backend.logits(ids, pos)
    m_loss = _nll(m_logits, ids, mask)
    m_loss.backward()
    h_logits = hf(input_ids=ids, position_ids=pos).logits
    h_loss = _nll(h_logits, ids, mask)
    h_loss.backward()
    m_grads = backend.bridge.megatron_to_hf(
        {n: p.grad for n, p in backend.named_parameters()}, backend.hf_config
    )
    h_grads = {n: p.grad for n, p in hf.named_parameters()}
    exported = backend.export_hf_state_dict()
    hf_state = {n: p.detach().cpu() for n, p in hf.named_parameters()}
    out = dict(
        te_spec=uses_fused_norms(backend.module),
        logits_max_abs_diff=(m_logits - h_logits).abs().max().item(),
        loss_abs_diff=abs(m_loss.item() - h_loss.item()),
        grad_max_abs_diff=max((m_grads[n] - h_grads[n]).abs().max().item() for n in h_grads),
        grads_compared=len(set(m_grads) & set(h_grads)),
        hf_params=len(h_grads),
        export_identical=sorted(exported) == sorted(hf_state)
        and all(torch.equal(exported[n], hf_state[n]) for n in hf_state),
    )
    return out, backend, (ids, pos)


def _resume(backend, batch, hf_path: str, work: Path) -> dict:
    from types import SimpleNamespace

    from miles_platform.training.megatron_backend import MegatronBackend

    ckpt = work / "iter_0000001"
    with torch.no_grad():
        saved_logits = backend.logits(*batch)
    backend.save_model(str(ckpt))
    opt = torch.optim.AdamW(backend.parameters(), lr=1e-2)
    opt.step()  # grads from the parity pass
    opt.zero_grad()
    with torch.no_grad():
        changed = (backend.logits(*batch) - saved_logits).abs().max().item()
        backend.load_model(str(ckpt))
        resumed = backend.logits(*batch)
    warm = MegatronBackend(SimpleNamespace(tensor_model_parallel_size=1, seed=9, ref_load=str(ckpt)))
    warm.build(hf_path)
    with torch.no_grad():
        ref_loaded = warm.logits(*batch)
    return dict(
        changed_after_step=changed,
        resume_logits_max_abs_diff=(resumed - saved_logits).abs().max().item(),
        ref_load_logits_max_abs_diff=(ref_loaded - saved_logits).abs().max().item(),
        saved_files=len([p for p in ckpt.iterdir() if p.is_file()]),
    )


def _shims() -> dict:
    from megatron.core.utils import GlobalMemoryBuffer

    from miles_platform.training import megatron_shims

    active = megatron_shims.apply_cpu_shims()
    buf = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t")
    return dict(
        active=active, buffer_device=buf.device.type, idempotent=megatron_shims.apply_cpu_shims() == active
    )


def _main(mode: str, work: str, tied: str, untied: str | None = None) -> None:
    torch.set_num_threads(1)
    from miles_platform.training import megatron_backend, megatron_shims

    if mode == "gpu" and not megatron_backend.te_available():
        raise SystemExit("transformer-engine is not importable on this GPU machine")
    work_dir = Path(work)
    report = {}
    report["tied"], backend, batch = _compare(tied, work_dir)
    if mode == "cpu":
        report["tied"].update(_resume(backend, batch, tied, work_dir))
        report["untied"], _, _ = _compare(untied, work_dir)
        report["shims"] = _shims()
    megatron_shims.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _main(*sys.argv[1:])
