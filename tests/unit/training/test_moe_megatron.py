"""Qwen3-MoE on megatron-core (EP=1, local spec, gloo, CPU): HF -> torch_dist (TP=2) -> HF bit-exact
in HF's on-disk layout (one tensor per expert), and logits, loss and gradients of the megatron GPTModel
(TopKRouter + SequentialMLP experts) equal transformers' own Qwen3MoeForCausalLM in fp32. Controls: the
routing mapping is what makes it pass (norm_topk_prob flipped is far off), every expert is routed to,
and both HF layouts (module's fused 3-D experts, checkpoint's per-expert tensors) map to the same
megatron state. --moe-router-freeze-gate trains the experts, not the routers; --moe-aux-loss-coeff and
--moe-z-loss-coeff are the fsdp backend's formulas over the real tokens. Refusals before Ray:
--expert-model-parallel-size that does not split the experts (or a dense model), and a config with dense
layers between the sparse ones.

Everything touching torch.distributed runs in a subprocess (this file as a script).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_helpers import small_run_config, warm_python
from safetensors.torch import load_file

from miles_platform.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5  # fp32 parity, as the dense families (test_model_families_megatron.py)


def save_moe_checkpoint(tok_dir: str, path: Path, **overrides) -> str:
    """The tiny Qwen3-MoE (4 experts, top-2, every layer sparse) at GQA with 2 query groups (TP=2 splits
    whole groups), untied embeddings, norm weights drawn away from 1, sharp attention (q/k scaled) and
    routers drawn at std 0.5 instead of HF's zero init, so the top-2 choice differs between tokens and
    the gate values are far from uniform; experts scaled up 5x so what they add shows in the logits."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.families import build_model, tiny_config

    tok = load_tokenizer(tok_dir)
    cfg = tiny_config("qwen3_moe", len(tok), hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, moe_intermediate_size=16, num_hidden_layers=2, tie_word_embeddings=False,
                      **overrides)  # fmt: skip
    model = build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
            if ".mlp.experts." in name:
                p.mul_(5.0)  # the experts' output is not lost next to the residual stream
    save_hf_checkpoint(model, tok, path)
    return str(path)


@pytest.fixture(scope="module")
def report(tiny_hf_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("moe_megatron")
    hf = save_moe_checkpoint(tiny_hf_checkpoint, work / "hf")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([*warm_python(), __file__, hf, str(work)], capture_output=True, text=True,
                          env=env, timeout=400, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return hf, work, json.loads(proc.stdout.strip().splitlines()[-1])


def test_hf_to_torch_dist_to_hf_is_bit_exact_in_the_per_expert_layout(report):
    hf, work, r = report
    assert len(list((work / "td" / "release").glob("*.distcp"))) == 2  # TP=2: one file per rank
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in a and "model.layers.0.mlp.gate.weight" in a
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert r["to_torch_dist"]["content_hash"] and r["to_hf"]["tensors"] == len(a)


def test_megatron_moe_logits_loss_grads_match_hf_in_fp32(report):
    _, _, r = report
    p = r["parity"]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL, p
    # every HF parameter (routers and fused experts included) has its gradient compared
    assert p["grads_compared"] == p["hf_params"] and p["export_identical"]
    assert r["experts_routed_per_layer"] == [4, 4]  # every expert's mapping is exercised


def test_both_hf_expert_layouts_map_to_the_same_megatron_state(report):
    assert report[2]["layouts"] == {"same_names": True, "same_tensors": True}


def test_without_the_routing_mapping_parity_fails(report):
    """megatron with norm_topk_prob flipped (moe_router_pre_softmax the other way): gates that do not
    sum to one, far outside the bound; with the bridge's mapping, within it."""
    c = report[2]["control"]
    assert c["mapped_logits_max_abs_diff"] < TOL
    assert c["flipped_logits_max_abs_diff"] > 1000 * TOL, c


def test_router_freeze_gate_trains_the_experts_not_the_routers(report):
    f = report[2]["freeze"]
    assert f["frozen"] == 2 and f["router_max_change"] == 0.0 and f["expert_max_change"] > 1e-4, f


def test_aux_and_z_loss_on_megatron_are_the_fsdp_formulas_over_the_real_tokens(report):
    """The megatron trainer's load-balancing and z-loss terms equal the formulas computed from
    transformers' own router logits of the same batch (the fsdp backend's test computes the same),
    are reported, and alone (zero advantages) move the routers; without them nothing does."""
    a = report[2]["aux"]
    assert a["got"]["aux"] == pytest.approx(a["want"]["aux"], rel=1e-5) and 1.0 <= a["got"]["aux"] <= 2.0, a
    assert a["got"]["z"] == pytest.approx(a["want"]["z"], rel=1e-5) and a["got"]["z"] > 0, a
    assert a["reported"] == pytest.approx(a["got"], rel=1e-4), a
    moved = a["routers_moved"]
    assert moved["none"] == 0.0 and moved["aux"] > 1e-4 and moved["z"] > 1e-4, moved


def test_moe_router_dtype_fp32_routes_a_bf16_model_in_fp32(report):
    """--moe-router-dtype fp32 reaches megatron-core's TransformerConfig: a --bf16 model's router
    takes bf16 hidden states and returns fp32 logits, the fp32 product (within fp32 rounding: its
    own GEMM), which differs from the bf16 router's logits (what it returns without the flag)."""
    got = report[2]["router_dtype"]
    fp32, bf16 = got["fp32"], got["None"]
    assert fp32["input"] == bf16["input"] == "torch.bfloat16", got
    assert (fp32["logits"], bf16["logits"]) == ("torch.float32", "torch.bfloat16"), got
    assert fp32["to_fp32"] < 1e-5 < fp32["to_bf16"], got
    assert bf16["to_bf16"] == 0.0, got


def test_megatron_takes_moe_and_refuses_what_it_does_not_map_before_start(tiny_hf_checkpoint, tmp_path):
    from miles_platform.preflight import validate_before_start

    hf = save_moe_checkpoint(tiny_hf_checkpoint, tmp_path / "moe")
    validate_before_start(small_run_config(hf, tmp_path, train_backend="megatron"))
    validate_before_start(
        small_run_config(hf, tmp_path, train_backend="megatron", moe_router_freeze_gate=True)
    )
    validate_before_start(
        small_run_config(
            hf, tmp_path, train_backend="megatron", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001
        )
    )
    validate_before_start(
        small_run_config(hf, tmp_path, use_rollout_routing_replay=True, train_backend="megatron")
    )
    validate_before_start(  # EP 2 splits the 4 experts (tests/unit/training/test_megatron_layouts.py trains it)
        small_run_config(
            hf,
            tmp_path,
            train_backend="megatron",
            expert_model_parallel_size=2,
            actor_num_gpus_per_node=2,
            global_batch_size=4,
        )  # fmt: skip
    )
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3: the model has 4 experts"):
        validate_before_start(
            small_run_config(
                hf,
                tmp_path,
                train_backend="megatron",
                expert_model_parallel_size=3,
                actor_num_gpus_per_node=3,
                rollout_batch_size=3,
                global_batch_size=6,
            )  # fmt: skip
        )
    with pytest.raises(
        ConfigError, match="an MoE model at --tensor-model-parallel-size 2 needs --sequence-parallel"
    ):
        validate_before_start(
            small_run_config(
                hf,
                tmp_path,
                train_backend="megatron",
                tensor_model_parallel_size=2,
                actor_num_gpus_per_node=2,
            )
        )
    with pytest.raises(ConfigError, match="an MoE model with --pipeline-model-parallel-size > 1: not built"):
        validate_before_start(
            small_run_config(
                hf,
                tmp_path,
                train_backend="megatron",
                pipeline_model_parallel_size=2,
                actor_num_gpus_per_node=2,
            )
        )
    with pytest.raises(ConfigError, match="an MoE model with --context-parallel-size 2: not built"):
        validate_before_start(
            small_run_config(
                hf, tmp_path, train_backend="megatron", context_parallel_size=2, actor_num_gpus_per_node=2
            )
        )
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 1: the model has no experts"):
        validate_before_start(
            small_run_config(
                tiny_hf_checkpoint, tmp_path, train_backend="megatron", expert_tensor_parallel_size=1
            )
        )
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2: the model has no experts"):
        validate_before_start(
            small_run_config(
                tiny_hf_checkpoint,
                tmp_path,
                train_backend="megatron",
                expert_model_parallel_size=2,
                actor_num_gpus_per_node=2,
                global_batch_size=4,
            )  # fmt: skip
        )
    mixed = save_moe_checkpoint(tiny_hf_checkpoint, tmp_path / "mixed", mlp_only_layers=[1])
    with pytest.raises(ConfigError, match=r"layers \[1\] are dense MLPs.*--train-backend fsdp"):
        validate_before_start(small_run_config(mixed, tmp_path, train_backend="megatron"))
    validate_before_start(
        small_run_config(mixed, tmp_path, train_backend="fsdp")
    )  # fsdp runs HF's own blocks
    assert not (tmp_path / "root").exists(), "nothing is written before validation passes"


# ---------------------------------------------------------------- subprocess side


def _routing_checks(hf_path: str) -> dict:
    """Experts HF routes to; the two HF layouts through the bridge; megatron vs HF logits with the
    mapping and with norm_topk_prob flipped."""
    from miles_platform.models.bridge import get_bridge
    from miles_platform.models.checkpoint import load_hf_model, read_safetensors_dir, validate_hf_dir
    from miles_platform.models.moe import RoutingReplay
    from miles_platform.training import megatron_backend as mb

    hf, cfg = load_hf_model(hf_path), validate_hf_dir(hf_path)
    T = 64
    ids = torch.randint(0, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T).expand(2, T)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    with torch.no_grad(), RoutingReplay.of(hf).record() as rec:
        want = hf(input_ids=ids, position_ids=pos).logits
    bridge = get_bridge(cfg)
    rows = bridge.gpt_model_kwargs(cfg)["vocab_size"]
    module_sd = bridge.hf_to_megatron(dict(hf.state_dict()), cfg, padded_vocab_size=rows)
    disk_sd = bridge.hf_to_megatron(read_safetensors_dir(hf_path), cfg, padded_vocab_size=rows)

    def diff(c) -> float:
        model, _ = mb.build_gpt_model(c)
        mb.load_full_state(model, module_sd)
        with torch.no_grad():
            got = model(ids, pos, causal[None, None])[..., : c["vocab_size"]]
        return (got - want).abs().max().item()

    return dict(
        experts_routed_per_layer=[int(r.unique().numel()) for r in rec],
        layouts=dict(
            same_names=sorted(module_sd) == sorted(disk_sd),
            same_tensors=all(torch.equal(module_sd[k], disk_sd[k]) for k in module_sd),
        ),
        control=dict(
            mapped_logits_max_abs_diff=diff(cfg),
            flipped_logits_max_abs_diff=diff({**cfg, "norm_topk_prob": not cfg["norm_topk_prob"]}),
        ),
    )


def _freeze(hf_path: str) -> dict:
    """One AdamW step of a --moe-router-freeze-gate backend on the parity loss."""
    from types import SimpleNamespace

    from megatron_parity import nll

    from miles_platform.training.megatron_backend import MegatronBackend

    b = MegatronBackend(SimpleNamespace(tensor_model_parallel_size=1, seed=7, ref_load=None,
                                        moe_router_freeze_gate=True))  # fmt: skip
    b.build(hf_path)
    before = b.export_hf_state_dict()
    ids = torch.randint(0, b.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    nll(b.logits(ids, torch.arange(12).expand(2, 12)), ids, torch.ones(2, 12)).backward()
    opt = torch.optim.AdamW([p for p in b.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    after = b.export_hf_state_dict()

    def change(suffix: str) -> float:
        return max((after[k] - before[k]).abs().max().item() for k in before if k.endswith(suffix))

    return dict(
        frozen=sum(not p.requires_grad for p in b.parameters()),
        router_max_change=change("mlp.gate.weight"),
        expert_max_change=change("mlp.experts.gate_up_proj"),
    )


def _aux(hf_path: str) -> dict:
    """--moe-aux-loss-coeff / --moe-z-loss-coeff through a megatron TrainerActor: its terms, the same
    formulas from transformers' own router logits of the same padded batch (real tokens only), the
    reported metrics, and whether one step with zero advantages moves the routers."""
    from loop_helpers import random_train_batch

    from miles_platform.config import RunConfig
    from miles_platform.models.checkpoint import load_hf_model
    from miles_platform.training.actor import TrainerActor

    def actor(**kw):
        return TrainerActor(RunConfig(hf_checkpoint=hf_path, train_backend="megatron", rollout_batch_size=4,
                                      n_samples_per_prompt=1, lr=1e-2, micro_batch_size=4, weight_decay=0.0,
                                      advantage_estimator="reinforce_plus_plus", normalize_advantages=True, **kw).validate())  # fmt: skip

    def routers(a):
        return {k: v.clone() for k, v in a.backend.module.state_dict().items() if k.endswith("router.weight")}

    batch, idx = random_train_batch(rewards=[1.0, 0.0, 1.0, 0.0]), list(range(4))
    a = actor(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    with torch.enable_grad():
        a._response_log_probs(a.backend, batch, idx)
    got = dict(aux=float(a.moe_aux), z=float(a.moe_z))
    ids, pos = a._pack(batch, idx)
    real = (torch.arange(ids.shape[1])[None] < torch.tensor([len(t) for t in batch.tokens])[:, None]).reshape(
        -1
    )
    with torch.no_grad():
        out = load_hf_model(hf_path)(input_ids=ids, position_ids=pos, output_router_logits=True)
    aux, z = [], []
    for logits in out.router_logits:
        p = torch.softmax(logits[real].float(), -1)
        tokens = torch.bincount(p.topk(2, -1).indices.reshape(-1), minlength=4).float()
        aux.append(4 / (2 * p.shape[0] ** 2) * (p.sum(0) * tokens).sum())
        z.append(torch.logsumexp(logits[real].float(), -1).square().mean())
    m = a.train(0, batch)
    moved = {}
    flat = random_train_batch(rewards=[1.0] * 4)  # zero advantages: the policy loss has no gradient
    for name, kw in (("none", {}), ("aux", dict(moe_aux_loss_coeff=0.5)), ("z", dict(moe_z_loss_coeff=0.1))):
        b = actor(**kw)
        before = routers(b)
        b.train(0, flat)
        after = routers(b)
        moved[name] = max((after[k] - v).abs().max().item() for k, v in before.items())
    return dict(got=got, want=dict(aux=float(torch.stack(aux).mean()), z=float(torch.stack(z).mean())),
                reported=dict(aux=m["train/moe_aux_loss"], z=m["train/moe_z_loss"]), routers_moved=moved)  # fmt: skip


def _router_dtype(hf_path: str) -> dict:
    """--moe-router-dtype through megatron_precision.config_kwargs into a --bf16 model: the first
    router's gating logits, their dtype and their distance to the fp32 / bf16 product of its input
    and weight, with fp32 and without."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.training import megatron_precision
    from miles_platform.training.megatron_parallel import Layout, build_model_chunks

    cfg, T = validate_hf_dir(hf_path), 16
    ids = torch.randint(0, cfg["vocab_size"], (2, T), generator=torch.Generator().manual_seed(2))
    pos, causal = torch.arange(T).expand(2, T), torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    out = {}
    for dtype in ("fp32", None):
        kw = megatron_precision.config_kwargs(SimpleNamespace(bf16=True, moe_router_dtype=dtype))
        torch.manual_seed(0)
        (model,), _ = build_model_chunks(cfg, Layout(tp=1), torch.bfloat16, False, kw, device="cpu")
        router = next(m for m in model.modules() if type(m).__name__ == "TopKRouter")
        seen, gating = [], router.gating
        router.gating = lambda x, _g=gating, _s=seen: _s.append((x, _g(x))) or _s[-1][1]
        with torch.no_grad():
            model(ids, pos, causal[None, None])
        x, logits = seen[0]
        w = router.weight
        out[str(dtype)] = dict(
            input=str(x.dtype), weight=str(w.dtype), logits=str(logits.dtype),
            to_fp32=(logits.float() - F.linear(x.float(), w.float())).abs().max().item(),
            to_bf16=(logits.float() - F.linear(x.bfloat16(), w.bfloat16()).float()).abs().max().item(),
        )  # fmt: skip
    return out


def _main(hf: str, work: str) -> None:
    from contextlib import redirect_stdout
    from io import StringIO

    from megatron_parity import compare

    from miles_platform.training import megatron_shims
    from miles_platform.weights import conversion

    torch.set_num_threads(1)
    report, w = {}, Path(work)
    for name, argv in (
        ("to_torch_dist", ["hf-to-torch-dist", "--hf-checkpoint", hf, "--save", str(w / "td"),
                           "--tensor-model-parallel-size", "2"]),
        ("to_hf", ["torch-dist-to-hf", "--load", str(w / "td"), "--hf-checkpoint", hf, "--save", str(w / "back")]),
    ):  # fmt: skip
        buf = StringIO()
        with redirect_stdout(buf):
            assert conversion.cli_main(argv) == 0
        report[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    report["parity"], _, _ = compare(hf, w)
    report.update(_routing_checks(hf))
    report["freeze"] = _freeze(hf)
    report["aux"] = _aux(hf)
    report["router_dtype"] = _router_dtype(hf)
    megatron_shims.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _main(*sys.argv[1:])
