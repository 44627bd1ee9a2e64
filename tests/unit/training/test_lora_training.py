"""LoRA on the fsdp trainer (real PEFT, in-process): flags, target selection, frozen base,
adapter-only optimizer, exact resume, and the PEFT / merged exports."""

import json
import os

import pytest
import torch
from loop_helpers import random_train_batch

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.models.checkpoint import content_hash, load_hf_model
from miles_platform.training.actor import TrainerActor
from miles_platform.training.lora import export_merged_hf_dir, resolve_target_modules, write_adapter_dir


def _cfg(ckpt, save=None, **kw):
    base = dict(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                lr=1e-2, save=save, num_rollout=4, micro_batch_size=2, lora_rank=4, lora_alpha=8)  # fmt: skip
    base.update(kw)
    return RunConfig(**base).validate()


def _batch(seed=0):
    return random_train_batch(seed, rewards=[1.0, 0.0, 0.0, 1.0])


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--lora-alpha", "32"], "--lora-alpha: LoRA flags, but --lora-rank is 0"),
        (["--target-modules", "attn", "--lora-train-only"], "--target-modules, --lora-train-only"),
        (
            [
                "--lora-rank",
                "8",
                "--train-backend",
                "megatron",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--actor-num-gpus-per-node",
                "2",
            ],
            "--num-layers-per-virtual-pipeline-stage 1: LoRA on the megatron",
        ),
        (
            [
                "--lora-rank",
                "8",
                "--update-weight-transfer-mode",
                "disk-delta",
                "--update-weight-disk-dir",
                "/x",
            ],
            "disk-delta",
        ),  # fmt: skip
        (["--lora-rank", "8", "--lora-dropout", "1.0"], "--lora-dropout"),
        (["--lora-rank", "-1"], "--lora-rank -1"),
        (["--lora-rank", "8", "--lora-adapter-path", "/nonexistent"], "no adapter_config.json"),
        (["--lora-rank", "8", "--check-lora-weight-equal", "--rollout-engine", "sglang"], "embedded"),
    ],
)
def test_lora_flags_are_validated_before_anything_starts(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(["--rollout-batch-size", "2", *argv])


def test_target_groups_names_and_exclusions_resolve_as_miles_does(tiny_hf_checkpoint):
    m = load_hf_model(tiny_hf_checkpoint)
    default = resolve_target_modules(m, None, None)
    assert (
        default
        == resolve_target_modules(m, "all-linear", None)
        == resolve_target_modules(m, "attn,mlp", None)
    )
    assert {n.rsplit(".", 1)[1] for n in default} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"}  # fmt: skip
    assert len(default) == 7 * m.config.num_hidden_layers
    mixed = resolve_target_modules(m, "attn,lm_head", "k_proj")
    assert "lm_head" in mixed and not any(n.endswith("k_proj") for n in mixed)
    assert resolve_target_modules(m, "model.layers.1.self_attn.q_proj,q_proj", None) == [
        f"model.layers.{i}.self_attn.q_proj" for i in range(m.config.num_hidden_layers)
    ]
    assert resolve_target_modules(m, "*.layers.0.mlp.*", None) == [
        f"model.layers.0.mlp.{x}" for x in ("down_proj", "gate_proj", "up_proj")
    ]
    with pytest.raises(ConfigError, match="all-linear must be used alone"):
        resolve_target_modules(m, "all-linear,lm_head", None)
    with pytest.raises(ConfigError, match="'qkv_proj' matches no linear module"):
        resolve_target_modules(m, "qkv_proj", None)
    with pytest.raises(ConfigError, match="names explicitly"):
        resolve_target_modules(m, "q_proj,v_proj", "q_proj")


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm4_moe"])
def test_mla_targets_and_every_dense_and_shared_expert_mlp_get_their_adapter(family):
    """Miles' MLA targets (q_a / q_b / kv_a_proj_with_mqa / kv_b beside o_proj; the V3.2 indexer never), and
    every resolved target holds a PEFT adapter: PEFT 0.21 on transformers v5 rewrote `*.gate_proj / up_proj /
    down_proj` targets of these MoE models to the packed experts' parameters, so the dense layer's MLP and
    the shared expert were silently left without one (training/lora._exact_targets)."""
    from types import SimpleNamespace

    from miles_platform.models.families import build_model, tiny_config
    from miles_platform.training.lora import wrap_model

    model = build_model(tiny_config(family, 128), seed=0)
    targets = resolve_target_modules(model, None, None)
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"] if family != "glm4_moe" else []
    attn = mla + (["q_proj", "k_proj", "v_proj"] if not mla else []) + ["o_proj"]
    assert sorted(t for t in targets if ".self_attn." in t) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in attn
    )
    cfg = SimpleNamespace(target_modules=None, exclude_modules=None, lora_adapter_path=None, lora_rank=4,
                          lora_alpha=8, lora_dropout=0.0)  # fmt: skip
    adapted = {n.split(".lora_")[0] for n, _ in wrap_model(model, cfg).named_parameters() if ".lora_" in n}
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj",
                 "model.layers.1.mlp.shared_experts.up_proj", "model.layers.1.mlp.experts"):  # fmt: skip
        assert f"base_model.model.{name}" in adapted, name
    assert not any(".indexer." in n for n in adapted)


def test_a_gate_and_up_pair_selects_the_packed_experts_as_miles_does(caplog):
    """Miles' GPT-OSS LoRA recipe (`--target-modules "gate_proj,up_proj,down_proj"`): a gate_proj / up_proj
    pair also selects the packed `gate_up_proj` (with a warning), scoped pairs keep their prefix, one of the
    two alone does not expand; split modules stay selected where the model has them (DeepSeek-V3's dense
    MLP and shared expert)."""
    from miles_platform.models.families import tiny_config
    from miles_platform.training.lora import hf_meta_model

    gpt_oss = hf_meta_model(tiny_config("gpt_oss", 128).to_dict())
    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")]
    assert resolve_target_modules(gpt_oss, "gate_proj,up_proj,down_proj", None) == experts
    assert "also the packed experts' gate_up_proj" in caplog.text
    scoped = "model.layers.1.mlp.experts.gate_proj,model.layers.1.mlp.experts.up_proj"
    assert resolve_target_modules(gpt_oss, scoped, None) == ["model.layers.1.mlp.experts.gate_up_proj"]
    with pytest.raises(ConfigError, match="'gate_proj' matches no linear module"):
        resolve_target_modules(gpt_oss, "gate_proj,down_proj", None)
    v3 = resolve_target_modules(
        hf_meta_model(tiny_config("deepseek_v3", 128).to_dict()), "gate_proj,up_proj", None
    )
    assert v3 == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                  "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.shared_experts.gate_proj",
                  "model.layers.1.mlp.shared_experts.up_proj"]  # fmt: skip


# ---------------------------------------------------------------- training


def test_only_the_adapter_trains_and_the_base_stays_bit_identical(tiny_hf_checkpoint):
    actor = TrainerActor(_cfg(tiny_hf_checkpoint))
    base0 = actor.get_base_weights()
    adapter0, conf = actor.get_lora_adapter()
    assert conf["r"] == 4 and conf["lora_alpha"] == 8 and conf["peft_type"] == "LORA"
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter0)
    opt_params = [p for g in actor.opt.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == sum(t.numel() for t in adapter0.values())
    # B starts at 0: the adapter's v0 is exactly the base policy
    assert all(not t.any() for k, t in adapter0.items() if ".lora_B." in k)
    assert all(torch.equal(v, base0[k]) for k, v in actor.get_hf_weights().items())
    for r in range(3):
        m = actor.train(r, _batch(r))
    assert m["train/grad_norm"] > 0
    base1 = actor.get_base_weights()
    assert base1.keys() == base0.keys() and all(torch.equal(base0[k], base1[k]) for k in base0)
    adapter1, _ = actor.get_lora_adapter()
    assert any(not torch.equal(adapter0[k], adapter1[k]) for k in adapter0)
    merged = actor.get_hf_weights()
    assert any(not torch.equal(merged[k], base0[k]) for k in base0)


def test_resume_restores_adapter_and_optimizer_exactly(tiny_hf_checkpoint, tmp_path):
    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    a.train(0, _batch(0))
    ckpt = a.save(0, {"weight_version": 1})
    files = sorted(os.listdir(ckpt))
    assert "model.safetensors" not in files and "adapter" in files  # the base is never copied
    pointer = json.load(open(os.path.join(ckpt, "adapter", "base_checkpoint.json")))
    assert pointer["content_hash"] == content_hash(tiny_hf_checkpoint)
    a.train(1, _batch(1))
    want_adapter, _ = a.get_lora_adapter()
    want_opt = a._optimizer_tensors()

    b = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    assert b.load()["rollout_id"] == 0
    b_opt = b._optimizer_tensors()
    assert b_opt.keys() == {k for k in b_opt if ".lora_" in k} and b_opt  # adapter state only
    b.train(1, _batch(1))
    got_adapter, _ = b.get_lora_adapter()
    assert all(torch.equal(want_adapter[k], got_adapter[k]) for k in want_adapter)
    got_opt = b._optimizer_tensors()
    assert got_opt.keys() == want_opt.keys() and all(torch.equal(want_opt[k], got_opt[k]) for k in want_opt)


def test_resume_refuses_another_base(tiny_hf_checkpoint, tmp_path):
    from miles_platform.models.tiny import save_tiny_checkpoint

    save = str(tmp_path / "ck")
    a = TrainerActor(_cfg(tiny_hf_checkpoint, save))
    a.save(0, {"weight_version": 0})
    other = save_tiny_checkpoint(tmp_path / "other")
    cfg = json.loads(open(os.path.join(other, "config.json")).read())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 2  # a different base (content hash)
    open(os.path.join(other, "config.json"), "w").write(json.dumps(cfg))
    b = TrainerActor(_cfg(other, save))
    with pytest.raises(ValueError, match="adapter trained on base"):
        b.load()


def test_peft_export_loads_in_peft_and_merged_export_matches(tiny_hf_checkpoint, tmp_path):
    from peft import PeftModel

    actor = TrainerActor(_cfg(tiny_hf_checkpoint, target_modules="attn,mlp,lm_head"))
    for r in range(2):
        actor.train(r, _batch(r))
    state, conf = actor.get_lora_adapter()
    out = write_adapter_dir(
        str(tmp_path / "adapter"), state, conf, tiny_hf_checkpoint, content_hash(tiny_hf_checkpoint)
    )
    ids = torch.tensor([[5, 9, 17, 33, 41, 7]])
    pos = torch.arange(ids.shape[1])[None]
    actor.model.eval()
    with torch.no_grad():
        want = actor.backend.logits(ids, pos)
        peft_model = PeftModel.from_pretrained(load_hf_model(tiny_hf_checkpoint), out).eval()
        got = peft_model(input_ids=ids).logits
        merged_dir = export_merged_hf_dir(tiny_hf_checkpoint, out, str(tmp_path / "merged"))
        merged = load_hf_model(merged_dir)(input_ids=ids).logits
    assert not torch.allclose(want, load_hf_model(tiny_hf_checkpoint)(input_ids=ids).logits, atol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, want, atol=1e-4, rtol=0)


def test_start_from_an_adapter_path(tiny_hf_checkpoint, tmp_path):
    a = TrainerActor(_cfg(tiny_hf_checkpoint))
    a.train(0, _batch(0))
    state, conf = a.get_lora_adapter()
    path = write_adapter_dir(str(tmp_path / "ad"), state, conf, tiny_hf_checkpoint, "h")
    b = TrainerActor(_cfg(tiny_hf_checkpoint, lora_adapter_path=path))
    got, _ = b.get_lora_adapter()
    assert all(torch.equal(state[k], got[k]) for k in state)
    assert [p.requires_grad for g in b.opt.param_groups for p in g["params"]] and b.opt.param_groups[0][
        "params"
    ]
    with pytest.raises(ConfigError, match="does not match"):
        TrainerActor(_cfg(tiny_hf_checkpoint, lora_adapter_path=path, lora_rank=8))


def test_an_adapter_peft_saved_with_shortened_target_names_matches(tiny_hf_checkpoint, tmp_path):
    """PEFT writes `target_modules` as leaf names once they cover 20+ modules; --lora-adapter-path
    matches an adapter by the modules its tensors adapt (Miles: targets from the tensor keys)."""
    from peft import LoraConfig, get_peft_model

    from miles_platform.models.tiny import save_layout_checkpoint
    from miles_platform.training.lora import check_adapter_matches

    hf = save_layout_checkpoint(tiny_hf_checkpoint, tmp_path / "l4")  # 4 layers: 28 default targets
    targets = resolve_target_modules(load_hf_model(hf), None, None)
    peft = get_peft_model(load_hf_model(hf), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    peft.save_pretrained(str(tmp_path / "ad"))
    assert (
        len(targets) == 28
        and "q_proj" in json.load(open(tmp_path / "ad" / "adapter_config.json"))["target_modules"]
    )
    check_adapter_matches(str(tmp_path / "ad"), _cfg(hf), targets)
    with pytest.raises(ConfigError, match="targets: adapter"):
        check_adapter_matches(str(tmp_path / "ad"), _cfg(hf), targets[1:])
