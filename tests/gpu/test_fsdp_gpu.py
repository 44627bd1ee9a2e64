"""FSDP on the device: FSDPBackend (world size 1, no rules) one AdamW step against the same step on
the CPU; FSDP2 `fully_shard` over a real process group (NCCL with CUDA, gloo without; world size
1, file store) against the unsharded model; FSDPBackend with --fsdp-precision-rules (FSDP2 + bf16
autocast): forward dtypes follow the plan, masters and grads stay fp32 DTensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron_parity import nll
from precision_probe import forward_param_dtypes
from torch.distributed.tensor import DTensor

from miles_platform.config import RunConfig
from miles_platform.models.checkpoint import load_hf_model
from miles_platform.training.fsdp import shard_model, wrap_units
from miles_platform.training.fsdp_backend import FSDPBackend

pytestmark = pytest.mark.gpu

TOL = 1e-5  # fp32 on both sides: the same math, another device or a sharded layout


def _maxdiff(a, b) -> float:
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def _batch(vocab: int, dev: str):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    mask = (torch.rand(3, 12, generator=g) > 0.2).float()
    pos = torch.arange(12).expand(3, 12)
    return ids.to(dev), pos.to(dev), mask.to(dev)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _one_step(named_params, logits_fn, batch, lr=1e-2) -> dict:
    """loss, grads and parameters after one AdamW step, all on CPU (full tensors)."""
    ids, pos, mask = batch
    loss = nll(logits_fn(ids, pos), ids, mask)  # the megatron parity's loss
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


def _plain(ckpt: str, device: str) -> FSDPBackend:
    b = FSDPBackend(RunConfig(), 0, 1)
    b.build(ckpt)
    b.module.to(device)
    return b


@pytest.fixture(scope="module")
def cpu_step(tiny_hf_checkpoint):
    """(vocab size, one step of the plain backend on the CPU): the reference."""
    ref = _plain(tiny_hf_checkpoint, "cpu")
    vocab = ref.module.config.vocab_size
    return vocab, _one_step(ref.named_parameters, ref.logits, _batch(vocab, "cpu"))


@pytest.fixture(scope="module")
def process_group(tmp_path_factory, device):
    """The default group FSDP2 shards over: NCCL with CUDA, gloo without; world size 1, file store."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("fsdp") / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    yield backend
    dist.destroy_process_group()


def test_plain_backend_step_matches_the_cpu(tiny_hf_checkpoint, cpu_step, device, record):
    vocab, step_cpu = cpu_step
    b = _plain(tiny_hf_checkpoint, device)
    s = _one_step(b.named_parameters, b.logits, _batch(vocab, device))
    devs = sorted({p.device.type for p in b.parameters()})
    c = _cmp_steps(step_cpu, s)
    record(param_devices=devs, vs="same step on CPU", **c, moved=s["moved"], n_params=s["n_params"])
    record.ran_on(*devs)
    assert c["loss_abs_diff"] < TOL and c["grad_max_abs_diff"] < TOL, c
    assert c["param_after_step_max_abs_diff"] < TOL, c
    assert s["moved"] == s["n_params"]


def test_fsdp2_fp32_step_matches_the_unsharded_model(
    tiny_hf_checkpoint, cpu_step, process_group, device, record
):
    vocab, _ = cpu_step
    ref = _plain(tiny_hf_checkpoint, device)
    s_ref = _one_step(ref.named_parameters, ref.logits, _batch(vocab, device))
    model = shard_model(load_hf_model(tiny_hf_checkpoint), RunConfig())
    params = list(model.parameters())
    dtensor = all(isinstance(p, DTensor) for p in params)
    devs = sorted({p.device.type for p in params})

    def logits(ids, pos):
        return model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits

    s = _one_step(model.named_parameters, logits, _batch(vocab, device))
    c = _cmp_steps(s_ref, s)
    record(process_group=process_group, world_size=dist.get_world_size(), units=wrap_units(model),
           params_are_dtensors=dtensor, param_devices=devs, vs="unsharded model, same step, same device",
           **c, moved=s["moved"], n_params=s["n_params"])  # fmt: skip
    record.ran_on(*devs)
    assert dtensor and c["same_param_names"]
    assert c["loss_abs_diff"] < TOL and c["grad_max_abs_diff"] < TOL, c
    assert c["param_after_step_max_abs_diff"] < TOL, c
    assert s["moved"] == s["n_params"]


def test_backend_bf16_rules_follow_the_plan(tiny_hf_checkpoint, cpu_step, process_group, device, record):
    vocab, step_cpu = cpu_step
    cfg = RunConfig(
        train_forward_dtype="bf16", rollout_dtype="bf16", fsdp_precision_rules="module:model.layers.1=bf16"
    )
    b = FSDPBackend(cfg, 0, 1)
    b.build(tiny_hf_checkpoint)  # rules set: goes through fsdp.shard_model (FSDP2) even at world size 1
    model = b.module
    plan = model.precision_plan
    seen, s = forward_param_dtypes(
        model, lambda: _one_step(b.named_parameters, b.logits, _batch(vocab, device))
    )
    params = list(model.parameters())
    masters = sorted({str(p.dtype) for p in params})
    devs = sorted({p.device.type for p in params})
    dtensor = all(isinstance(p, DTensor) for p in params)
    # every planned parameter carried its planned dtype in the forward (a tied lm_head.weight is
    # the embedding's Parameter under a second name: seen, not planned)
    mismatched = {k: (seen.get(k), v) for k, v in plan.param_dtype.items() if seen.get(k) != v}
    record(process_group=process_group, units=wrap_units(model), needs_param_maps=plan.needs_param_maps,
           mismatched=mismatched, seen_not_planned=sorted(set(seen) - set(plan.param_dtype)),
           bf16_params_in_forward=sorted(k for k, v in seen.items() if v == "bf16"),
           master_dtypes=masters, grad_dtypes=s["grad_dtypes"], params_are_dtensors=dtensor,
           loss_bf16=s["loss"], loss_abs_diff_vs_fp32_cpu=abs(s["loss"] - step_cpu["loss"]),
           moved=s["moved"], n_params=s["n_params"])  # fmt: skip
    record.ran_on(*devs)
    assert not mismatched, mismatched
    assert masters == ["torch.float32"] and s["grad_dtypes"] == ["torch.float32"]
    assert dtensor
    assert s["moved"] == s["n_params"]
    assert bool(torch.isfinite(torch.tensor(s["loss"])))


@pytest.mark.parametrize("forward", ["fp32", "bf16"])
def test_shared_prefix_packing_on_the_device(tiny_hf_checkpoint, device, record, forward):
    """training/shared_prefix.py on the device: sdpa's boolean 4D mask there (a CUDA kernel with a
    mask, not the causal one), the packed rows' log-probs against the padded forward's of the same
    backend, fp32 and the bf16 autocast (whose sums in another order move by bf16's rounding)."""
    from miles_platform.training.backend import ScoreRequest
    from miles_platform.training.shared_prefix import pack_shared_prefixes

    if forward == "bf16" and device == "cpu":
        pytest.skip("bf16 autocast: the CUDA default")
    cfg = RunConfig(
        hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=1, train_forward_dtype=forward
    ).validate()
    be = FSDPBackend(cfg, device=device)
    be.build(tiny_hf_checkpoint)
    assert be.shares_prefixes
    g = torch.Generator().manual_seed(0)
    seqs, plens = [], []
    for _ in range(4):
        prompt = torch.randint(3, 60, (6,), generator=g).tolist()
        for _ in range(8):
            seqs.append(
                prompt
                + torch.randint(3, 60, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            )
            plens.append(6)
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    ids, pos = ids.to(device), torch.arange(width, device=device).expand(len(seqs), -1)
    packed = pack_shared_prefixes(seqs, plens, width, device)
    real = torch.zeros(len(seqs), width - 1, dtype=torch.bool, device=device)
    for i, s in enumerate(seqs):
        real[i, : len(s) - 1] = True
    with torch.no_grad():
        padded = be.score(ScoreRequest(ids, pos)).log_probs[real]
        shared = be.score(ScoreRequest(ids, pos, packed=packed)).log_probs[real]
    diff = _maxdiff(shared, padded)
    record(
        forward=forward,
        positions_padded=ids.numel(),
        positions_packed=packed.input_ids.numel(),
        max_diff=diff,
    )
    record.ran_on(shared.device.type, *{p.device.type for p in be.parameters()})
    assert diff < (2e-5 if forward == "fp32" else 0.1)
