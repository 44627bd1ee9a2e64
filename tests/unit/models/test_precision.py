"""Precision rules, parser and the wrap-plan compiler (pure CPU, no process group).

Each compiler case draws the resulting gather dtype per node; `*` marks a wrap unit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miles_platform.training import fsdp as fsdp_mod
from miles_platform.training.precision import (
    PrecisionError,
    PrecisionPlan,
    PrecisionPolicy,
    Rule,
    WrapUnit,
    alignment_metrics,
    cast_boundary_inputs,
    compile_policy,
    compile_precision,
    parse_precision_rules,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)  # weight + bias
        self.norm = nn.LayerNorm(4)


class Toy(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, tied: bool = False, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([Block() for _ in range(n_blocks)])
        self.head = nn.Linear(4, 8, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def units(plan: PrecisionPlan) -> list[tuple[str, str, dict[str, str]]]:
    return [(u.fqn, u.param_dtype, dict(u.param_dtype_map)) for u in plan.units]


def compile_(rules: str, default: str = "fp32", model: nn.Module | None = None, **kw) -> PrecisionPlan:
    return compile_precision(model or Toy(), parse_precision_rules(rules), default, **kw)


DEFAULT_UNITS = [("blocks.0", "fp32", {}), ("blocks.1", "fp32", {}), ("", "fp32", {})]


def test_no_rules_is_the_default_per_layer_plus_root_wrap():
    """<root>* fp32 > embed fp32, blocks.0* fp32, blocks.1* fp32, head fp32"""
    plan = compile_("")
    assert units(plan) == DEFAULT_UNITS
    assert set(plan.node_dtype.values()) == {"fp32"}


def test_module_rule_makes_one_unit_per_module_whose_dtype_differs():
    """<root>* fp32 > blocks.0* fp32 > lin fp32, norm* bf16; blocks.1* fp32"""
    plan = compile_("module:blocks.0.norm=bf16")
    assert units(plan) == [("blocks.0.norm", "bf16", {})] + DEFAULT_UNITS
    assert (
        plan.param_dtype["blocks.0.norm.bias"] == "bf16" and plan.param_dtype["blocks.0.lin.weight"] == "fp32"
    )


def test_module_rule_makes_one_unit_per_subtree_not_per_leaf():
    """no default units: <root>* fp32 > blocks.0* bf16 > lin bf16, norm bf16; blocks.1 fp32"""
    plan = compile_("module:blocks.0=bf16", wrap_classes=())
    assert units(plan) == [("blocks.0", "bf16", {}), ("", "fp32", {})]


def test_default_unit_takes_the_dtype_most_of_its_weights_want():
    """blocks.0* bf16 (lin: 20 of 28 weights) > lin bf16, norm* fp32 -- same unit count either way"""
    plan = compile_("module:blocks.0.lin=bf16")
    assert units(plan) == [("blocks.0.norm", "fp32", {}), ("blocks.0", "bf16", {})] + DEFAULT_UNITS[1:]


def test_whole_block_rule_reuses_the_block_unit():
    """blocks.*: the default unit already sits there, so no extra unit: blocks.0* bf16, blocks.1* bf16"""
    plan = compile_("module:blocks.*=bf16")
    assert units(plan) == [("blocks.0", "bf16", {}), ("blocks.1", "bf16", {}), ("", "fp32", {})]
    assert plan.node_dtype["blocks.1.norm"] == "bf16"


def test_later_rule_overrides_earlier_and_carves_out():
    """<root>* fp32 > blocks.0* bf16 > lin bf16, norm* fp32; blocks.1* bf16 > lin bf16, norm bf16"""
    plan = compile_("module:blocks.*=bf16;module:blocks.0.norm=fp32")
    assert units(plan) == [
        ("blocks.0.norm", "fp32", {}),
        ("blocks.0", "bf16", {}),
        ("blocks.1", "bf16", {}),
        ("", "fp32", {}),
    ]
    # reversed order: the broad rule wins everywhere
    assert units(compile_("module:blocks.0.norm=fp32;module:blocks.*=bf16"))[0] == ("blocks.0", "bf16", {})


def test_class_and_module_globs_combine():
    """class:LayerNorm only inside blocks.1: blocks.1* fp32 > norm* bf16; blocks.0.norm stays fp32"""
    plan = compile_("module:blocks.1.*&class:LayerNorm=bf16")
    assert units(plan) == [("blocks.1.norm", "bf16", {})] + DEFAULT_UNITS
    assert plan.node_dtype["blocks.0.norm"] == "fp32"


def test_assignment_equal_to_default_compiles_to_nothing():
    """class:*Norm*=fp32 under an fp32 default: every node fp32, only the default units"""
    assert units(compile_("class:*Norm*=fp32;param:head.weight=fp32")) == DEFAULT_UNITS


def test_rule_matching_nothing_is_an_error():
    with pytest.raises(PrecisionError, match=r"module:blocks\.9=bf16 matches nothing"):
        compile_("module:blocks.9=bf16")
    with pytest.raises(PrecisionError, match="param:head.bias"):
        compile_("param:head.bias=bf16")


def test_param_rule_expressible_by_a_unit_becomes_a_unit():
    """head has one parameter: <root>* fp32 > head* bf16 (no per-parameter map)"""
    plan = compile_("param:head.weight=bf16")
    assert units(plan) == [
        ("blocks.0", "fp32", {}),
        ("blocks.1", "fp32", {}),
        ("head", "bf16", {}),
        ("", "fp32", {}),
    ]
    assert not plan.needs_param_maps


def test_two_params_of_one_module_compile_to_a_wrap_local_map():
    """blocks.0* fp32 > lin fp32 (weight fp32, bias -> bf16 via map {'lin.bias': bf16})"""
    plan = compile_("param:blocks.0.lin.bias=bf16")
    assert units(plan) == [
        ("blocks.0", "fp32", {"lin.bias": "bf16"}),
        ("blocks.1", "fp32", {}),
        ("", "fp32", {}),
    ]
    assert plan.needs_param_maps


def test_map_lands_in_the_enclosing_unit_with_root_relative_names_at_root():
    """no default units: <root>* bf16 > blocks.0.lin weight bf16, bias -> fp32 via root map"""
    plan = compile_("param:blocks.0.lin.bias=fp32", default="bf16", wrap_classes=())
    assert units(plan) == [("", "bf16", {"blocks.0.lin.bias": "fp32"})]


def test_minimal_cover_picks_the_majority_dtype_for_a_parent():
    """no default units, 3 blocks: <root>* fp32 > blocks* bf16 > blocks.0 bf16, blocks.1 bf16,
    blocks.2 bf16 > lin bf16, norm* fp32 -- 2 units instead of blocks.0, blocks.1, blocks.2.lin"""
    plan = compile_("module:blocks=bf16;module:blocks.2.norm=fp32", model=Toy(n_blocks=3), wrap_classes=())
    assert units(plan) == [("blocks.2.norm", "fp32", {}), ("blocks", "bf16", {}), ("", "fp32", {})]
    # a carve-out that leaves one leaf is one unit at that leaf
    assert units(compile_("module:blocks.0=bf16;module:blocks.0.norm=fp32", wrap_classes=())) == [
        ("blocks.0.lin", "bf16", {}), ("", "fp32", {})
    ]  # fmt: skip


def test_units_are_ordered_deepest_first():
    plan = compile_("module:blocks.0.lin=bf16;module:blocks.*.norm=bf16;param:head.weight=bf16")
    depths = [u.depth for u in plan.units]
    assert depths == sorted(depths, reverse=True) and plan.units[-1].fqn == ""


def test_shared_local_name_with_different_dtypes_is_rejected():
    """`_orig_mod` is stripped from wrap-local names: blocks.0.lin and blocks.0._orig_mod.lin collide"""
    model = Toy()
    model.blocks[0]._orig_mod = nn.Module()
    model.blocks[0]._orig_mod.lin = nn.Linear(4, 4)
    model.blocks[0]._orig_mod.lin.__class__ = type("Special", (nn.Linear,), {})
    with pytest.raises(PrecisionError, match="share the wrap-local name 'lin.weight'"):
        compile_("class:Special=bf16;param:blocks.0.lin.bias=fp32", model=model)


def test_tied_parameter_belongs_to_the_common_ancestor():
    """embed.weight is head.weight: the root holds it, so the embed rule moves the root's own dtype"""
    plan = compile_("module:embed=bf16", model=Toy(tied=True))
    assert units(plan) == [("blocks.0", "fp32", {}), ("blocks.1", "fp32", {}), ("", "bf16", {})]
    assert plan.param_dtype == {**dict.fromkeys(plan.param_dtype, "fp32"), "embed.weight": "bf16"}


def test_two_down_casts_in_one_group_are_rejected():
    with pytest.raises(PrecisionError, match="FSDP2 casts a group to one dtype"):
        compile_(
            "param:blocks.0.lin.weight=bf16;param:blocks.0.lin.bias=fp16", master="fp32", wrap_classes=()
        )


def test_qwen_model_rules_activate_only_under_autocast():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    plain = compile_policy(model, PrecisionPolicy())
    assert [u.fqn for u in plain.units] == ["model.layers.0", "model.layers.1", ""]
    aligned = compile_policy(model, PrecisionPolicy(compute="bf16"))
    assert aligned.param_dtype["model.embed_tokens.weight"] == "bf16"
    assert {d for n, d in aligned.param_dtype.items() if "norm" in n} == {"bf16"}
    assert {d for n, d in aligned.param_dtype.items() if "proj" in n or "lm_head" in n} == {"fp32"}
    assert not aligned.needs_param_maps
    # under a bf16 gather the same rules equal the default and compile to nothing
    assert units(compile_policy(model, PrecisionPolicy(gather="bf16", compute="bf16"))) == [
        ("model.layers.0", "bf16", {}), ("model.layers.1", "bf16", {}), ("", "bf16", {})
    ]  # fmt: skip


# ---------------------------------------------------------------------------- parser


def test_parse_rules_grammar():
    rules = parse_precision_rules(
        " module:model.layers.*.mlp=fp32; class:*RMSNorm=bf16 ;param:lm_head.weight=fp32;"
    )
    assert rules == [
        Rule("fp32", module="model.layers.*.mlp"),
        Rule("bf16", cls="*RMSNorm"),
        Rule("fp32", param="lm_head.weight"),
    ]
    assert parse_precision_rules("module:model.layers.0.*&class:*Norm=fp16") == [
        Rule("fp16", module="model.layers.0.*", cls="*Norm")
    ]
    assert parse_precision_rules(None) == [] and parse_precision_rules("") == []


@pytest.mark.parametrize(
    "text,match",
    [
        ("module:x=fp64", "unknown dtype 'fp64'"),
        ("layer:x=fp32", "module:GLOB, class:GLOB or param:GLOB"),
        ("module:x", "expected SELECTOR=DTYPE"),
        ("param:a&module:b=fp32", "not both"),
        ("module:a&module:b=fp32", "each once"),
    ],
)
def test_parse_rules_rejects_with_the_flag_named(text, match):
    with pytest.raises(PrecisionError, match=match) as e:
        parse_precision_rules(text)
    assert "--fsdp-precision-rules rule 1" in str(e.value)


def test_policy_from_run_config_and_cast_forward_inputs():
    from miles_platform.config import RunConfig

    cfg = RunConfig(train_forward_dtype="bf16", rollout_dtype="bf16", fsdp_precision_rules="class:*Norm=fp32")
    pol = PrecisionPolicy.from_config(cfg)
    assert (pol.master, pol.gather, pol.compute, pol.reduce) == ("fp32", "fp32", "bf16", "fp32")
    assert pol.autocast and not pol.cast_forward_inputs and pol.rules == (Rule("fp32", cls="*Norm"),)
    default = PrecisionPolicy.from_config(RunConfig())
    assert not default.autocast and default.cast_forward_inputs


def test_param_maps_are_gated_on_the_pinned_torch(monkeypatch):
    plan = PrecisionPlan([WrapUnit("", "fp32", {"w": "bf16"})], {}, {})
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    with pytest.raises(PrecisionError, match=r"torch==2\.13\.0, found 2\.99\.0"):
        fsdp_mod.apply_precision_plan(nn.Linear(2, 2), plan, PrecisionPolicy())


# ---------------------------------------------------------------------------- boundary inputs


def test_input_dtype_policy_casts_float_inputs_only():
    x = torch.randn(2, 3)
    ids = torch.arange(3)
    policy = {"latents": "default", "cond": "fp16", "timestep": None, "input_ids": "fp32"}
    out = cast_boundary_inputs({"latents": x, "cond": x, "timestep": x, "input_ids": ids}, policy, "bf16")
    assert out["latents"].dtype == torch.bfloat16 and out["cond"].dtype == torch.float16
    assert out["timestep"] is x and out["input_ids"].dtype == torch.int64
    with pytest.raises(PrecisionError, match="input_dtype_policy value 'fp8'"):
        cast_boundary_inputs({"latents": x}, {"latents": "fp8"}, "bf16")


# ---------------------------------------------------------------------------- alignment metrics


def test_alignment_metrics_over_masked_tokens():
    train = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5])]
    rollout = [torch.tensor([-1.0, -2.1, -9.0]), torch.tensor([-0.7])]
    masks = [[1, 1, 0], [1]]  # the -9.0 token is masked out
    m = alignment_metrics(train, rollout, masks)
    assert m["train/log_prob_mean_abs_diff"] == pytest.approx((0.0 + 0.1 + 0.2) / 3)
    assert m["train/log_prob_max_abs_diff"] == pytest.approx(0.2)
    expected_ratio = (0.0 + abs(torch.exp(torch.tensor(0.1)) - 1) + abs(torch.exp(torch.tensor(0.2)) - 1)) / 3
    assert m["train/ratio_abs_minus_1"] == pytest.approx(float(expected_ratio))
    assert alignment_metrics(torch.zeros(3), torch.zeros(3), torch.ones(3)) == dict.fromkeys(m, 0.0)
    with pytest.raises(PrecisionError, match="must be equal"):
        alignment_metrics(torch.zeros(3), torch.zeros(2), torch.ones(3))
