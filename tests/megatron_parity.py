"""MegatronBackend against the torch-native HF model: logits, loss, grads, export, resume, --ref-load
and the CPU shims, measured once and reported as numbers (JSON) for tests to judge.

`run(mode, work, tied[, untied])` runs this file as a script in a subprocess (its own gloo/nccl
group, world size 1), as tests/unit/training/test_megatron_backend.py does; tests/gpu calls
`compare` / `resume` / `shims` in-process too. "cpu" mode names the local-spec checks (the device is
CUDA when available), "gpu" the transformer-engine spec.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5  # megatron vs HF, fp32, local spec
TE_TOL = 1e-4  # the transformer-engine spec (fused norms)


def run(*args: str) -> dict:
    from loop_helpers import warm_python

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run(
        [*warm_python(), __file__, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def nll(logits, ids, mask):
    """Masked next-token NLL: the loss every parity check differentiates."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()


def compare(hf_path: str, work: Path) -> tuple[dict, object, tuple]:
    """Megatron vs HF on one batch: (numbers, the backend, (ids, pos))."""
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
    m_loss = nll(m_logits, ids, mask)
    m_loss.backward()
    h_logits = hf(input_ids=ids, position_ids=pos).logits
    h_loss = nll(h_logits, ids, mask)
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


def resume(backend, batch, hf_path: str, work: Path) -> dict:
    """torch_dist save, one AdamW step (grads of `compare`), load: the logits come back exactly;
    a second backend built with --ref-load gives them too."""
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


def shims() -> dict:
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
    report["tied"], backend, batch = compare(tied, work_dir)
    if mode == "cpu":
        report["tied"].update(resume(backend, batch, tied, work_dir))
        report["untied"], _, _ = compare(untied, work_dir)
        report["shims"] = shims()
    megatron_shims.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _main(*sys.argv[1:])
