"""Nested wrap units under real FSDP2 on 2 gloo ranks (CPU).

Asserts the dtype every module's parameters carry in the forward (wrap units and a per-parameter
map both honoured), that master weights and grads stay fp32 DTensors, and that an AdamW step runs.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
from loop_helpers import spawn_ranks
from precision_probe import forward_param_dtypes

from miles_platform.cluster.ports import free_port

RULES = (
    "module:model.layers.1=bf16;"  # a whole layer in bf16 ...
    "param:model.layers.1.self_attn.o_proj.bias=fp32;"  # ... except one bias: map entry, up-cast
    "param:model.layers.0.self_attn.q_proj.bias=bf16"  # one bias of an fp32 module: map entry, down-cast
)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, attention_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)


def _scenario(cfg_kwargs: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from miles_platform.config import RunConfig
    from miles_platform.training.fsdp import forward_autocast, shard_model, wrap_units

    cfg = RunConfig(**cfg_kwargs)
    model = shard_model(_tiny_qwen3(), cfg)
    plan = model.precision_plan
    ids = torch.randint(
        0, 64, (2, 8), generator=torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    )

    def run():
        with forward_autocast(cfg):
            return model(input_ids=ids, labels=ids, use_cache=False)

    forward, out = forward_param_dtypes(model, run)
    out.loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    opt.step()
    moved = sum(not torch.equal(before[n], p.detach().full_tensor()) for n, p in model.named_parameters())
    return {
        "units": wrap_units(model),
        "plan_units": [[u.fqn, u.param_dtype, dict(u.param_dtype_map)] for u in plan.units],
        "forward": forward,
        "expected": plan.param_dtype,
        "master": sorted({str(p.dtype) for p in model.parameters()}),
        "master_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "n_grads": sum(p.grad is not None for p in model.parameters()),
        "n_params": sum(1 for _ in model.parameters()),
        "loss": float(out.loss.detach()),
        "moved": moved,
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {
            "default": _scenario({}),
            "rules": _scenario(
                dict(train_forward_dtype="bf16", rollout_dtype="bf16", fsdp_precision_rules=RULES)
            ),
        }
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_nested_wrap_units_on_two_gloo_ranks(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        assert "error" not in res, res.get("error")

        default = res["default"]  # no rules, fp32: the plain per-layer + root wrap
        assert sorted(default["units"]) == ["", "model.layers.0", "model.layers.1"]
        assert set(default["forward"].values()) == {"fp32"}

        r = res["rules"]
        # model rules (embedding + RMSNorms at the compute dtype) + the operator rules
        assert sorted(r["units"]) == sorted(u[0] for u in r["plan_units"])
        assert ["model.layers.0", "fp32", {"self_attn.q_proj.bias": "bf16"}] in r["plan_units"]
        assert ["model.layers.1", "bf16", {"self_attn.o_proj.bias": "fp32"}] in r["plan_units"]
        assert r["forward"] == r["expected"]  # every parameter, as its module saw it in the forward
        f = r["forward"]
        assert (
            f["model.layers.0.self_attn.q_proj.bias"] == "bf16"
            and f["model.layers.0.self_attn.q_proj.weight"] == "fp32"
        )
        assert (
            f["model.layers.1.self_attn.o_proj.bias"] == "fp32"
            and f["model.layers.1.self_attn.o_proj.weight"] == "bf16"
        )
        assert (
            f["model.embed_tokens.weight"] == "bf16" and f["model.layers.0.input_layernorm.weight"] == "bf16"
        )
        assert f["model.layers.0.mlp.up_proj.weight"] == "fp32" and f["lm_head.weight"] == "fp32"

        for scenario in (default, r):  # masters and grads stay fp32 DTensors; the optimizer steps them
            assert scenario["master"] == ["torch.float32"] and scenario["master_dtensor"]
            assert scenario["grads"] == ["torch.float32"] and scenario["n_grads"] == scenario["n_params"]
            assert scenario["moved"] == scenario["n_params"]
            assert torch.isfinite(torch.tensor(scenario["loss"]))
