"""Qwen3-MoE and Rollout Routing Replay (R3): the embedded engine returns SGLang's routed_experts
(int32, (tokens - 1, layers, top_k), base64), equal to the routes HF's own forward takes; a trainer
whose routes differ from the engine's (here: the engine's routers perturbed, as precision and kernel
noise do on real hardware) is pulled back to the engine's log-probs by replaying the routes, and
counts the flips; R3 refuses a dense model and the megatron backend before anything starts (MoE itself on
megatron: tests/unit/training/test_moe_megatron.py).
An R3 run through the whole loop (disk-delta, resume, the routes in the shard): tests/e2e/test_model_families_loop.py."""

import json
import shutil

import numpy as np
import pytest
import torch
from loop_helpers import small_run_config

from miles_platform.config import ConfigError, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.models.checkpoint import load_hf_model
from miles_platform.models.moe import RoutingReplay, decode_routes
from miles_platform.models.tiny import save_tiny_checkpoint
from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.rollout.engine_server import start_engine_server

PROMPTS = [[5, 9, 17, 33, 41, 7], [12, 4, 99, 3], [60, 61, 62, 63, 64]]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", "qwen3_moe")


def _generate(url, n_tokens=24, seed=3):
    body = {"input_ids": [p for p in PROMPTS for _ in range(4)], "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": [{"max_new_tokens": n_tokens, "temperature": 1.0, "ignore_eos": True,
                                 "sampling_seed": seed + i} for i in range(4 * len(PROMPTS))]}  # fmt: skip
    return post(url, "/generate", body)


def test_engine_returns_the_routes_hf_takes_in_sglang_shape(moe_ckpt):
    server = start_engine_server(moe_ckpt, num_threads=1)
    try:
        outs = _generate(server.url)
    finally:
        server.stop()
    model = load_hf_model(moe_ckpt).eval()
    rr = RoutingReplay.of(model)
    assert (rr.num_layers, rr.top_k, rr.num_experts) == (2, 2, 4)
    for out, prompt in zip(outs, [p for p in PROMPTS for _ in range(4)], strict=True):
        ids = prompt + out["output_ids"]
        routes = decode_routes(out["meta_info"]["routed_experts"], rr.num_layers, rr.top_k)
        assert routes.dtype == np.int32 and routes.shape == (len(ids) - 1, 2, 2)
        with torch.no_grad(), rr.record() as rec:
            model(input_ids=torch.tensor([ids]))
        want = torch.stack(rec, dim=1).numpy()[: len(ids) - 1]
        assert (np.sort(routes, -1) == np.sort(want, -1)).all()  # prefill rows and every decode step


def test_a_dense_engine_refuses_return_routed_experts(tiny_hf_checkpoint):
    server = start_engine_server(tiny_hf_checkpoint, num_threads=1)
    try:
        with pytest.raises(EngineHTTPError, match="dense"):
            post(server.url, "/generate", {"input_ids": [1, 2], "return_routed_experts": True})
    finally:
        server.stop()


def _perturbed_copy(ckpt, out, scale):
    """The checkpoint with its router weights nudged by `scale` x their std (noise a real engine's
    precision / kernels add): a few near-tied routes flip, everything else barely moves."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    sd = load_file(f"{out}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for k, v in sd.items():
        if k.endswith("mlp.gate.weight"):
            sd[k] = v + scale * v.std() * torch.randn(v.shape, generator=g)
    save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


def _trainer_log_probs(ckpt, samples, replay: bool):
    from miles_platform.training.actor import TrainBatch, TrainerActor

    cfg = RunConfig(hf_checkpoint=ckpt, rollout_batch_size=1, use_rollout_routing_replay=replay).validate()
    actor = TrainerActor(cfg)
    batch = TrainBatch.from_samples(samples)
    lps = actor._all_log_probs(actor.backend, batch, list(range(len(samples))))
    return [lps[i] for i in range(len(samples))], actor._moe_metrics()


def test_routing_replay_pulls_the_trainer_back_to_the_engines_log_probs(moe_ckpt, tmp_path):
    engine_ckpt = _perturbed_copy(moe_ckpt, tmp_path / "engine", scale=0.02)
    server = start_engine_server(engine_ckpt, num_threads=1)
    try:
        outs = _generate(server.url)
    finally:
        server.stop()
    samples = []
    for out, prompt in zip(outs, [p for p in PROMPTS for _ in range(4)], strict=True):
        s = Sample(prompt_tokens=prompt, response_tokens=out["output_ids"], loss_mask=[1] * len(out["output_ids"]),
                   rollout_log_probs=[x[0] for x in out["meta_info"]["output_token_logprobs"]])  # fmt: skip
        s.rollout_routed_experts = decode_routes(out["meta_info"]["routed_experts"], 2, 2).tolist()
        samples.append(s)
    gap = {}
    for replay in (False, True):
        lps, metrics = _trainer_log_probs(moe_ckpt, samples, replay)
        gap[replay] = max(
            float((lp - torch.tensor(s.rollout_log_probs)).abs().max())
            for lp, s in zip(lps, samples, strict=True)
        )
        if replay:
            flips, frac = metrics["train/moe_route_flips"], metrics["train/moe_route_flip_frac"]
        assert metrics["train/moe_load_balance"] >= 1.0
    # some routes flipped between engine and trainer; replaying them closes most of the gap (what
    # is left is the perturbation's effect on the gate values, not on the choice of experts)
    assert flips > 0 and 0 < frac < 0.5
    assert gap[False] > 5e-3, gap  # measured 1.3e-2 without R3, 4.5e-5 with it (15 flips, 2.2%)
    assert gap[True] < gap[False] / 10, gap


def test_r3_refuses_a_dense_model_and_lora_before_start(moe_ckpt, tiny_hf_checkpoint, tmp_path):
    from miles_platform.preflight import validate_before_start

    with pytest.raises(ConfigError, match="dense"):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, use_rollout_routing_replay=True))
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay: --use-rollout-logprobs / LoRA"):
        small_run_config(moe_ckpt, tmp_path, use_rollout_routing_replay=True, lora_rank=4)
    assert not (tmp_path / "root").exists(), "nothing is written before validation passes"
    assert json.load(open(f"{moe_ckpt}/config.json"))["architectures"] == ["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_quantized_moe_checkpoint_is_served_close_to_the_original(moe_ckpt, fmt, tmp_path):
    """On disk an MoE checkpoint holds one tensor per expert (HF's layout); the engine dequantizes
    them and fuses them into the expert modules (`fuse_checkpoint_experts`). Every expert is quantized."""
    from miles_platform.rollout.engine_weights import load_model
    from miles_platform.weights.quantize import quantize_checkpoint

    st = quantize_checkpoint(moe_ckpt, str(tmp_path / fmt), fmt)
    assert st.tensors_quantized >= 2 * 4 * 3  # 2 layers x 4 experts x gate / up / down at least
    served, _ = load_model(str(tmp_path / fmt), torch.float32)
    ref = load_hf_model(moe_ckpt)
    ref_sd, got_sd = ref.state_dict(), served.state_dict()
    assert sorted(got_sd) == sorted(ref_sd)
    w = "model.layers.0.mlp.experts.gate_up_proj"
    err, amax = float((got_sd[w] - ref_sd[w]).abs().max()), float(ref_sd[w].abs().max())
    assert 0 < err < 0.15 * amax  # quantized, and not re-initialized (that would be ~amax)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, lr = (torch.log_softmax(m(ids).logits, -1) for m in (served, ref))
    tok_q, tok_r = lq[:, :-1].gather(-1, ids[:, 1:, None]), lr[:, :-1].gather(-1, ids[:, 1:, None])
    assert float((tok_q - tok_r).abs().max()) < {"fp8": 0.02, "int4": 0.1}[fmt]


def test_the_engine_loads_an_moe_checkpoint_in_hfs_on_disk_layout_from_disk(moe_ckpt, tmp_path):
    """`update_weights_from_disk` of a Qwen3-MoE dir as transformers saves it (and Qwen3-30B-A3B
    ships): one tensor per expert. The engine fuses them as transformers' own loader does, and then
    serves exactly the weights transformers loads from that dir."""
    from safetensors.torch import load_file

    from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts, split_fused_experts

    other = _perturbed_copy(moe_ckpt, tmp_path / "other", scale=0.5)  # the routers differ: a real update
    on_disk = load_file(f"{other}/model.safetensors")
    assert any(".mlp.experts.3.down_proj.weight" in k for k in on_disk)  # HF's per-expert layout
    want = load_hf_model(other).state_dict()
    assert fuse_checkpoint_experts(on_disk).keys() <= want.keys()
    back = split_fused_experts(fuse_checkpoint_experts(on_disk))  # what exports write: the disk layout
    assert back.keys() == on_disk.keys() and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    server = start_engine_server(moe_ckpt, num_threads=1, weight_roots=[str(tmp_path)])
    try:
        out = post(server.url, "/update_weights_from_disk", {"model_path": other, "weight_version": 1})
        assert out["success"] and out["weight_version"] == 1, out
        got = server.core.model.state_dict()
    finally:
        server.stop()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="per-expert tensors are incomplete"):
        fuse_checkpoint_experts({k: v for k, v in on_disk.items() if ".experts.1.up_proj" not in k})


def _routers_move(ckpt, batch, **kw) -> bool:
    """Whether one training step on `batch` changes any router weight."""
    a = _moe_actor(ckpt, **kw)
    before = {k: v.clone() for k, v in a.backend.module.state_dict().items() if k.endswith("mlp.gate.weight")}
    a.train(0, batch)
    after = a.backend.module.state_dict()
    return any(not torch.equal(v, after[k]) for k, v in before.items())


def _moe_actor(ckpt, **kw):
    from miles_platform.training.actor import TrainerActor

    return TrainerActor(RunConfig(hf_checkpoint=ckpt, rollout_batch_size=4, n_samples_per_prompt=1, lr=1e-2, micro_batch_size=4, weight_decay=0.0,
                                  advantage_estimator="reinforce_plus_plus", normalize_advantages=True, **kw).validate())  # fmt: skip


def test_moe_aux_loss_is_megatrons_switch_loss_over_the_real_tokens(moe_ckpt):
    """--moe-aux-loss-coeff: the trainer's load-balancing term equals megatron's formula computed here
    from HF's own router logits over the unpadded tokens, and joins the loss with its coefficient."""
    from loop_helpers import random_train_batch

    batch = random_train_batch(rewards=[1.0, 0.0, 1.0, 0.0])
    actor = _moe_actor(moe_ckpt, moe_aux_loss_coeff=0.5)
    idx = list(range(4))
    with torch.enable_grad():
        actor._response_log_probs(actor.backend, batch, idx)
    got = float(actor.moe_aux)
    # independently: HF's router logits of the same padded forward, real tokens only
    ids, pos = actor._pack(batch, idx)
    out = actor.backend.module(input_ids=ids, position_ids=pos, output_router_logits=True)
    real = (torch.arange(ids.shape[1])[None] < torch.tensor([len(t) for t in batch.tokens])[:, None]).reshape(
        -1
    )
    terms = []
    for logits in out.router_logits:
        p = torch.softmax(logits[real].float(), -1)
        chosen = p.topk(2, -1).indices
        tokens = torch.bincount(chosen.reshape(-1), minlength=4).float()
        n = p.shape[0]
        terms.append(4 / (2 * n * n) * (p.sum(0) * tokens).sum())
    want = float(torch.stack(terms).mean())
    assert got == pytest.approx(want, rel=1e-5) and 1.0 <= got <= 2.0  # 1 = perfectly even, k=2 of 4: <= 2
    m = actor.train(0, batch)
    assert m["train/moe_aux_loss"] == pytest.approx(got, rel=1e-4)
    # the term joins the loss: with equal rewards (zero advantages) the policy loss has no gradient,
    # so only the aux loss moves the routers
    flat = random_train_batch(rewards=[1.0] * 4)
    for coeff, moved in ((0.0, False), (0.5, True)):
        assert _routers_move(moe_ckpt, flat, moe_aux_loss_coeff=coeff) == moved, coeff


def test_moe_router_freeze_gate_trains_the_experts_not_the_routers(moe_ckpt):
    from loop_helpers import random_train_batch

    actor = _moe_actor(moe_ckpt, moe_router_freeze_gate=True)
    before = {k: v.clone() for k, v in actor.backend.module.state_dict().items()}
    actor.train(0, random_train_batch(rewards=[1.0, 0.0, 1.0, 0.0]))
    after = actor.backend.module.state_dict()
    gates = [k for k in before if k.endswith("mlp.gate.weight")]
    experts = [k for k in before if ".mlp.experts." in k]
    assert gates and experts
    assert all(torch.equal(before[k], after[k]) for k in gates)
    assert any(not torch.equal(before[k], after[k]) for k in experts)


def test_moe_flags_are_refused_where_they_mean_nothing(moe_ckpt, tiny_hf_checkpoint, tmp_path):
    from miles_platform.preflight import validate_before_start

    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff, --moe-router-freeze-gate: .*dense"):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, moe_aux_loss_coeff=0.01,
                                               moe_router_freeze_gate=True))  # fmt: skip
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff -1"):
        small_run_config(moe_ckpt, tmp_path, moe_aux_loss_coeff=-1.0)
    with pytest.raises(ConfigError, match="--moe-router-dtype.*fp64"):  # Miles' other value: not built
        small_run_config(moe_ckpt, tmp_path, moe_router_dtype="fp64")
    for forward in ("fp32", "bf16", "fp16"):  # fp32 routers under any forward dtype (megatron's semantics)
        small_run_config(moe_ckpt, tmp_path, moe_router_dtype="fp32", train_forward_dtype=forward,
                         rollout_dtype=forward)  # fmt: skip
    assert not (tmp_path / "root").exists()


def test_moe_router_dtype_fp32_keeps_routers_fp32_under_a_bf16_master(moe_ckpt):
    a = _moe_actor(moe_ckpt, fsdp_master_dtype="bf16", moe_router_dtype="fp32")
    dtypes = {k: v.dtype for k, v in a.backend.module.state_dict().items()}
    assert {d for k, d in dtypes.items() if k.endswith("mlp.gate.weight")} == {torch.float32}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16


def test_moe_z_loss_is_megatrons_router_z_loss_over_the_real_tokens(moe_ckpt):
    """--moe-z-loss-coeff: the trainer's router z-loss equals megatron's z_loss_func (mean over the
    tokens of logsumexp(router logits)^2, here averaged over layers) computed from HF's own router
    logits over the unpadded tokens; it is reported and, alone (zero advantages), moves the routers."""
    from loop_helpers import random_train_batch

    batch = random_train_batch(rewards=[1.0, 0.0, 1.0, 0.0])
    actor = _moe_actor(moe_ckpt, moe_z_loss_coeff=0.1)
    idx = list(range(4))
    with torch.enable_grad():
        actor._response_log_probs(actor.backend, batch, idx)
    got = float(actor.moe_z)
    ids, pos = actor._pack(batch, idx)
    out = actor.backend.module(input_ids=ids, position_ids=pos, output_router_logits=True)
    lens = torch.tensor([len(t) for t in batch.tokens])
    real = (torch.arange(ids.shape[1])[None] < lens[:, None]).reshape(-1)
    want = float(
        torch.stack([torch.logsumexp(x[real].float(), -1).square().mean() for x in out.router_logits]).mean()
    )
    assert got == pytest.approx(want, rel=1e-5) and got > 0
    m = actor.train(0, batch)
    assert m["train/moe_z_loss"] == pytest.approx(got, rel=1e-4)
    flat = random_train_batch(rewards=[1.0] * 4)
    for coeff, moved in ((0.0, False), (0.1, True)):
        assert _routers_move(moe_ckpt, flat, moe_z_loss_coeff=coeff) == moved, coeff
    with pytest.raises(ConfigError, match="--moe-z-loss-coeff -1"):
        RunConfig(hf_checkpoint=moe_ckpt, moe_z_loss_coeff=-1.0).validate()


def test_moe_z_loss_is_refused_on_a_dense_model(tiny_hf_checkpoint, tmp_path):
    from miles_platform.preflight import validate_before_start

    with pytest.raises(ConfigError, match="--moe-z-loss-coeff: .*dense"):
        validate_before_start(small_run_config(tiny_hf_checkpoint, tmp_path, moe_z_loss_coeff=0.01))
    assert not (tmp_path / "root").exists()


def test_moe_router_dtype_fp32_routes_in_fp32_under_bf16_in_trainer_and_engine(moe_ckpt):
    """--moe-router-dtype fp32 with a bf16 forward (megatron-core's moe_router_dtype; megatron itself:
    tests/unit/training/test_moe_megatron.py): in the fsdp trainer and the embedded engine the gate's
    logits are the fp32 product of the bf16 hidden states and the bf16 weight, not the bf16 one (which
    differs: the test can fail), both pick the same experts for the engine's tokens, and replaying the
    engine's routes (R3) gives the trainer's own logits."""
    import torch.nn.functional as F

    from miles_platform.models.moe import routers
    from miles_platform.training.actor import TrainerActor
    from miles_platform.training.fsdp import forward_autocast

    def grab(seen, name):
        def hook(mod, args, out):
            w = mod.weight.full_tensor() if hasattr(mod.weight, "full_tensor") else mod.weight
            seen.setdefault(name, (args[0].detach(), w.detach().clone(), out[0].detach()))

        return hook

    seen: dict = {}
    server = start_engine_server(moe_ckpt, num_threads=1, dtype="bf16", router_dtype="fp32")
    routers(server.core.model)[0].register_forward_hook(grab(seen, "engine"))
    try:
        outs = _generate(server.url, n_tokens=12)
    finally:
        server.stop()
    actor = TrainerActor(RunConfig(hf_checkpoint=moe_ckpt, rollout_batch_size=1, train_forward_dtype="bf16",
                                   rollout_dtype="bf16", moe_router_dtype="fp32").validate())  # fmt: skip
    model = actor.backend.module
    routers(model)[0].register_forward_hook(grab(seen, "trainer"))
    rr = RoutingReplay.of(model)
    same = total = 0
    for out, prompt in zip(outs, [p for p in PROMPTS for _ in range(4)], strict=True):
        ids = prompt + out["output_ids"]
        routes = decode_routes(out["meta_info"]["routed_experts"], 2, 2)
        replayed = torch.cat([torch.tensor(routes, dtype=torch.long), torch.full((1, 2, 2), -1)])
        with torch.no_grad(), forward_autocast(actor.cfg):
            with rr.record() as rec:
                own = model(input_ids=torch.tensor([ids])).logits
            with rr.replay(replayed):  # R3: the engine's routes, weighted by the fp32 gate values
                assert torch.equal(model(input_ids=torch.tensor([ids])).logits, own)
        want = np.sort(torch.stack(rec, dim=1).numpy()[: len(ids) - 1], -1)
        same, total = same + int((np.sort(routes, -1) == want).all(-1).sum()), total + want.shape[0] * 2
    assert (
        same == total == rr.routed and rr.flips == 0
    )  # 384 of 384 (383 when the fp32 master weight went in unrounded)
    for name, (x, w, logits) in seen.items():
        assert x.dtype == torch.bfloat16 and logits.dtype == torch.float32, name
        assert torch.equal(logits, F.linear(x.float(), w.bfloat16().float())), (
            name
        )  # the weight as bf16 holds it
        assert (logits - F.linear(x, w.bfloat16()).float()).abs().max() > 1e-4, name  # the bf16 router's
