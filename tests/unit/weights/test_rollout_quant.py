"""Low precision that survives updates: a quantized rollout checkpoint's format on every version, and
INT4 QAT (the trainer's forward sees the int4 weights the engines serve)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import quant as kq
from miles_platform.errors import CheckpointError
from miles_platform.weights.checksum import checksum
from miles_platform.weights.quantize import load_dense_hf_model, quantize_checkpoint
from miles_platform.weights.rollout_quant import (
    dense_from_update,
    read_served_state,
    rollout_quant,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _trained(q: str) -> dict[str, torch.Tensor]:
    """The trainer's weights after some steps: the dequantized start, moved off the quantization grid."""
    g = torch.Generator().manual_seed(1)
    state = load_dense_hf_model(q).state_dict()
    state.pop("lm_head.weight")  # tied: the trainer exports no lm_head
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_every_update_is_requantized_bit_for_bit_and_served_in_the_same_format(
    tiny_hf_checkpoint, tmp_path, fmt
):
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.weights.sync import served_weights

    q = str(tmp_path / fmt)
    quantize_checkpoint(tiny_hf_checkpoint, q, fmt, group_size=16)
    rq = rollout_quant(q)
    assert rq.fmt == fmt and rq.modules and (rq.group_size == 16 if fmt == "int4" else True)
    weights = _trained(q)
    served = rq.quantize(weights)
    # the update holds exactly the rollout checkpoint's tensors (names and dtypes) ...
    with open(Path(q) / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    assert set(served) == set(header)
    for m in rq.modules:  # ... and each quantized module is quantize(trainer weight), bit for bit
        w = weights[f"{m}.weight"]
        if fmt == "fp8":
            qw, s = kq.fp8_block_quant(w)
            assert served[f"{m}.weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(_bits(served[f"{m}.weight"]), _bits(qw)) and torch.equal(
                served[f"{m}.weight_scale_inv"], s
            )
        else:
            want = kq.int4_pack_quantize(w, rq.group_size)
            assert all(torch.equal(served[f"{m}.{k}"], v) for k, v in want.items())
    core = EngineCore(q, num_threads=1)
    try:
        v0 = core.served_quantization()
        _, _, stored = read_served_state(q)
        assert v0["format"] == fmt and v0["xxh3_128"] == {n: checksum(t) for n, t in stored.items()}
        core.update_weights_from_tensors(served, 1)
        v1 = core.served_quantization()
        assert (v1["weight_version"], v1["format"]) == (1, fmt)
        assert v1["xxh3_128"] == {n: checksum(t) for n, t in served.items() if n in stored}
        got = core.get_weights()
        dense, _ = dense_from_update(served)
        assert all(torch.equal(got[k], dense[k].to(got[k].dtype)) for k in dense)
        m = next(iter(sorted(rq.modules)))
        assert not torch.equal(got[f"{m}.weight"], weights[f"{m}.weight"])  # served quantized, not dense
        # an update missing a quantized tensor is refused before any weight changes
        drop = f"{m}.weight_scale_inv" if fmt == "fp8" else f"{m}.weight_scale"
        with pytest.raises(CheckpointError, match=re.escape(m)):
            core.update_weights_from_tensors({k: v for k, v in served.items() if k != drop}, 2)
        assert core.weight_version == 1 and torch.equal(core.get_weights()[f"{m}.weight"], got[f"{m}.weight"])
        # the run's path: the served copy beside the version's export, loaded from disk as a `disk` update does
        cfg = SimpleNamespace(hf_checkpoint=q)
        export = str(tmp_path / "v000002")
        shipped, served_dir, expected = served_weights(cfg, weights, export)
        assert served_dir == f"{export}-{fmt}" and rollout_quant(served_dir) == rq
        core.update_weights_from_disk(served_dir, 2)
        assert core.served_quantization()["format"] == fmt
        got = core.get_weights()
        assert all(torch.equal(got[k], expected[k].to(got[k].dtype)) for k in expected)
    finally:
        core.stop()


def test_the_dense_export_of_a_quantized_run_claims_no_quantization(tiny_hf_checkpoint, tmp_path):
    from miles_platform.weights.sync import export_policy

    q = str(tmp_path / "fp8")
    quantize_checkpoint(tiny_hf_checkpoint, q, "fp8")
    out = export_policy(_trained(q), SimpleNamespace(hf_checkpoint=q), str(tmp_path / "v1"))
    assert "quantization_config" not in json.loads((Path(out) / "config.json").read_text())
    assert rollout_quant(out) is None
    quantize_checkpoint(out, str(tmp_path / "v1-int4"), "int4", group_size=16)  # the asset can quantize it


def test_trainer_shipped_updates_are_quantized_too_broadcast_fp8_and_shared_memory(
    tiny_hf_checkpoint, tmp_path
):
    """broadcast (rank 0 sends) and colocated tensor (each rank stages in shared memory): the trainer
    quantizes what it ships (Miles' fp8 / int4 recipes are colocated); fp8 crosses gloo as bytes."""
    import threading

    import httpx

    from miles_platform.rollout.engine_server import start_engine_server
    from miles_platform.training.actor import TrainerActor
    from miles_platform.weights.shared_tensors import stage
    from miles_platform.weights.transports.broadcast import (
        broadcast,
        dtype_name,
        new_weights_group,
        weights_update_endpoint,
    )

    q = str(tmp_path / "fp8")
    quantize_checkpoint(tiny_hf_checkpoint, q, "fp8")
    weights = _trained(q)
    served = TrainerActor._for_engines(SimpleNamespace(cfg=SimpleNamespace(hf_checkpoint=q)), weights)
    assert served.keys() == rollout_quant(q).quantize(weights).keys() != weights.keys()
    dense, _ = dense_from_update(served)
    server = start_engine_server(q)
    try:
        ep, out = weights_update_endpoint(), {}
        t = threading.Thread(target=lambda: out.setdefault("g", new_weights_group(
            ep["master_address"], ep["master_port"], 0, 2, "g", "gloo", 30)))  # fmt: skip
        t.start()
        body = {**ep, "rank_offset": 1, "world_size": 2, "group_name": "g"}
        assert httpx.post(f"{server.url}/init_weights_update_group", json=body, timeout=60).status_code == 200
        t.join(60)
        send = threading.Thread(target=lambda: [broadcast(out["g"], v.contiguous()) for v in served.values()])
        send.start()
        body = {"names": list(served), "dtypes": [dtype_name(v.dtype) for v in served.values()],
                "shapes": [list(v.shape) for v in served.values()], "group_name": "g", "weight_version": 1}  # fmt: skip
        r = httpx.post(f"{server.url}/update_weights_from_distributed", json=body, timeout=60)
        send.join(60)
        assert r.status_code == 200, r.text
        got = server.core.get_weights()
        assert server.core.served_quantization()["format"] == "fp8"
        assert all(torch.equal(got[k], dense[k].to(got[k].dtype)) for k in dense)
        staged = stage(served)  # colocated: shared memory, fp8 included
        try:
            server.core.update_weights_from_tensor(staged.descriptor, 2)
        finally:
            staged.close()
        assert server.core.served_quantization()["weight_version"] == 2
        assert all(torch.equal(server.core.get_weights()[k], got[k]) for k in got)
    finally:
        server.stop()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_int4_qat_forward_equals_the_dequantized_int4_forward(
    tiny_hf_checkpoint, tmp_path, monkeypatch, family
):
    """Every packed weight: Linear layers; for the MoE also its router and fused experts (Miles' QAT scope)."""
    from miles_platform.config import ConfigError
    from miles_platform.models.tiny import save_tiny_checkpoint
    from miles_platform.training.qat import QAT_FLAG_ENV, QAT_GROUP_ENV, check_int4_qat, maybe_apply_int4_qat

    q = str(tmp_path / "int4")
    base = tiny_hf_checkpoint if family == "qwen3" else save_tiny_checkpoint(tmp_path / family, family)
    quantize_checkpoint(base, q, "int4", group_size=16)
    rq = rollout_quant(q)
    weights = _trained(q)
    qat, served = load_dense_hf_model(q), load_dense_hf_model(q)
    qat.load_state_dict(weights, strict=False)
    # what int4 engines serve of these weights: dequant(quantize(W)), loaded as plain tensors
    served.load_state_dict(dense_from_update(rq.quantize(weights))[0], strict=False)
    assert maybe_apply_int4_qat(qat, q) == 0  # off unless the environment says so
    monkeypatch.setenv(QAT_FLAG_ENV, "1")
    monkeypatch.setenv(QAT_GROUP_ENV, "16")
    hooked = maybe_apply_int4_qat(qat, q)
    assert hooked == (
        len(rq.modules) if family == "qwen3" else 2 * 6
    )  # per layer: q, k, v, o, router, experts
    if family == "qwen3_moe":
        assert qat.get_submodule("model.layers.0.mlp.experts").int4_qat_params == (
            "gate_up_proj",
            "down_proj",
        )
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = qat(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(out.detach(), served(input_ids=ids).logits)
        plain = load_dense_hf_model(q)
        plain.load_state_dict(weights, strict=False)
        assert not torch.equal(out.detach(), plain(input_ids=ids).logits)  # the hook is what made them equal
    out.float().pow(2).mean().backward()  # straight-through: the fp32 parameters get the gradient
    hooked = [getattr(m, n) for m in qat.modules() for n in getattr(m, "int4_qat_params", ())]
    assert hooked and all(p.grad is not None and p.grad.abs().sum() > 0 for p in hooked)
    # preflight: QAT needs an int4 rollout checkpoint and the fsdp backend
    cfg = SimpleNamespace(hf_checkpoint=q, train_backend="fsdp")
    assert "groups of 16" in check_int4_qat(cfg)
    with pytest.raises(ConfigError, match="not quantized"):
        check_int4_qat(SimpleNamespace(hf_checkpoint=tiny_hf_checkpoint, train_backend="fsdp"))
    monkeypatch.setenv(QAT_FLAG_ENV, "yes")
    with pytest.raises(ConfigError, match="must be 1"):
        check_int4_qat(cfg)
    monkeypatch.delenv(QAT_FLAG_ENV)  # Miles' --train-env-vars reaches the trainers too
    assert check_int4_qat(cfg) is None
    cfg.train_env = lambda: {QAT_FLAG_ENV: "1", QAT_GROUP_ENV: "32"}
    assert "groups of 32; the checkpoint packs groups of 16" in check_int4_qat(cfg)


def test_with_int4_qat_the_trainer_scores_what_the_int4_engine_serves(
    tiny_hf_checkpoint, tmp_path, monkeypatch
):
    """Step 0 (the checkpoint's weights) and after an update (weights off the int4 grid): the fsdp
    trainer's log-probs of the engine's tokens equal the engine's with QAT on; without, not after an update."""
    from miles_platform.config import parse_run_config
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.training.fsdp_backend import FSDPBackend
    from miles_platform.training.qat import QAT_FLAG_ENV, QAT_GROUP_ENV

    q = str(tmp_path / "int4")
    quantize_checkpoint(tiny_hf_checkpoint, q, "int4", group_size=16)
    rq = rollout_quant(q)
    cfg = parse_run_config(["--rollout-batch-size", "2", "--hf-checkpoint", q])
    plain = FSDPBackend(cfg, 0, 1)
    plain.build(q)
    monkeypatch.setenv(QAT_FLAG_ENV, "1")
    monkeypatch.setenv(QAT_GROUP_ENV, "16")
    qat = FSDPBackend(cfg, 0, 1)
    qat.build(q)
    assert qat.int4_qat_modules == len(rq.modules) and plain.int4_qat_modules == 0
    core = EngineCore(q, num_threads=1)

    def gaps():
        sp = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}
        out = core.generate([[1, 2, 3, 4]], [sp], return_logprob=True)[0]
        ids = torch.tensor([[1, 2, 3, 4, *out["output_ids"]]])
        engine = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        pos = torch.arange(ids.shape[1])[None]
        res = []
        for b in (qat, plain):
            with torch.no_grad():
                lp = torch.log_softmax(b.logits(ids, pos)[0, 3:-1].float(), -1)
            res.append(float((lp.gather(1, ids[0, 4:, None])[:, 0] - engine).abs().max()))
        return res

    try:
        with_qat, _ = gaps()
        assert with_qat < 1e-5  # step 0: the ratio is 1
        with torch.no_grad():  # "training": both trainers move off the int4 grid the same way
            for b in (qat, plain):
                for p in b.module.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        core.update_weights_from_tensors(rq.quantize(qat.export_hf_state_dict()), 1)
        with_qat, without = gaps()
        # measured: 4.8e-7 with QAT, 0.027 without
        assert with_qat < 1e-5 and without > 10 * max(with_qat, 1e-6), (with_qat, without)
    finally:
        core.stop()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_int4_qat_on_megatron_hooks_the_layers_holding_packed_weights(
    tiny_hf_checkpoint, tmp_path, monkeypatch, family
):
    """linear_qkv / linear_proj / linear_fc1 / linear_fc2 (and the MoE's router and local experts): the
    megatron forward with QAT equals the megatron forward of dequant(quantize(W)), logit for logit."""
    from miles_platform.models.tiny import save_tiny_checkpoint
    from miles_platform.training.megatron_backend import MegatronBackend
    from miles_platform.training.qat import QAT_FLAG_ENV, QAT_GROUP_ENV

    q = str(tmp_path / "int4")
    base = tiny_hf_checkpoint if family == "qwen3" else save_tiny_checkpoint(tmp_path / family, family)
    quantize_checkpoint(base, q, "int4", group_size=16)
    rq, weights = rollout_quant(q), _trained(q)
    cfg = SimpleNamespace(tensor_model_parallel_size=1, seed=7, ref_load=None, hf_checkpoint=q)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(10).expand(2, 10)

    def logits(state, qat: bool):
        if qat:
            monkeypatch.setenv(QAT_FLAG_ENV, "1")
            monkeypatch.setenv(QAT_GROUP_ENV, "16")
        else:
            monkeypatch.delenv(QAT_FLAG_ENV, raising=False)
        b = MegatronBackend(cfg)
        b.build(q)
        b.load_hf_state_dict(state)
        with torch.no_grad():
            return b.logits(ids, pos), b.int4_qat_modules

    with_qat, hooked = logits(weights, True)
    served, none = logits(dense_from_update(rq.quantize(weights))[0], False)
    # per layer: qkv, proj, fc1, fc2 (dense) / qkv, proj, router, 4 experts x (fc1, fc2) (the tiny MoE)
    assert (hooked, none) == ((8, 0) if family == "qwen3" else (2 * 11, 0))
    assert torch.equal(with_qat, served)  # without the hooks: the trained weights' logits, not these
