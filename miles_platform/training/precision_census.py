"""Dtype census: run one forward under a precision policy and record every module's input/output dtypes.

    miles-platform dtype-census --hf-checkpoint DIR --forward-dtype bf16 [--master-dtype fp32]
                                [--gather-dtype fp32] [--fsdp-precision-rules RULES] [--unaligned] [--json]

Float activations (module inputs and outputs) should all be in the compute dtype; any module that
sees or emits another float dtype is an offender. Master weights and integer ids are reported apart.
The model is sharded with FSDP2 exactly as the trainer does (a one-rank gloo group if none exists).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles_platform.training.precision import DTYPES, PrecisionPolicy, dtype_name, parse_precision_rules


@dataclass
class Census:
    activations: Counter  # float dtype -> module inputs/outputs in it
    other: Counter  # non-float dtype (ids, masks) -> count
    master_weights: Counter  # dtype of the resident (sharded) parameters
    offenders: list[str]  # modules with a float input/output outside the expected dtype
    modules: dict[str, dict[str, list[str]]]  # module -> {"in": [...], "out": [...]}
    expected: str

    def to_json(self) -> dict[str, Any]:
        return {
            "activations": dict(self.activations),
            "offenders": self.offenders,
            "other": dict(self.other),
            "master_weights": dict(self.master_weights),
            "expected": self.expected,
        }


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def dtype_census(model: nn.Module, run_forward, expected: str) -> Census:
    """Hook every module, call `run_forward()`, and tally the dtypes seen at module boundaries."""
    seen: dict[str, dict[str, list[str]]] = {}

    def hook(name):
        def fn(_mod, args, kwargs, output):
            entry = seen.setdefault(name, {"in": [], "out": []})
            entry["in"] += [dtype_name(t.dtype) for t in _tensors((args, kwargs))]
            entry["out"] += [dtype_name(t.dtype) for t in _tensors(output)]

        return fn

    handles = [
        m.register_forward_hook(hook(n or "<root>"), with_kwargs=True) for n, m in model.named_modules()
    ]
    # before the forward: FSDP2 leaves the root unit unsharded after it (in the gather dtype)
    master = Counter(dtype_name(p.dtype) for p in model.parameters())
    try:
        run_forward()
    finally:
        for h in handles:
            h.remove()
    floats = set(DTYPES)
    activations, other, offenders = Counter(), Counter(), []
    for name, io in seen.items():
        dts = io["in"] + io["out"]
        activations.update(d for d in dts if d in floats)
        other.update(d for d in dts if d not in floats)
        if any(d in floats and d != expected for d in dts):
            offenders.append(name)
    return Census(activations, other, master, offenders, seen, expected)


def census_checkpoint(
    hf_checkpoint: str, policy: PrecisionPolicy, aligned: bool = True, batch: int = 2, seq_len: int = 16
) -> Census:
    """Load an HF checkpoint at the master dtype, shard it per `policy`, census one forward."""
    from transformers import AutoModelForCausalLM

    from miles_platform.training.fsdp import forward_autocast, shard_model

    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=DTYPES[policy.master])
    model.config.use_cache = False
    policy = replace(policy, aligned=aligned)
    created = not dist.is_initialized()
    try:
        shard_model(model, policy)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)

        def run():
            with torch.no_grad(), forward_autocast(policy):
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)

        return dtype_census(model, run, expected=policy.compute)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform dtype-census", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--hf-checkpoint", required=True, help="HF model dir (config.json + safetensors)")
    p.add_argument("--forward-dtype", required=True, choices=tuple(DTYPES), help="compute (autocast) dtype")
    p.add_argument("--master-dtype", default="fp32", choices=("fp32", "bf16"), help="resident dtype")
    p.add_argument(
        "--gather-dtype", default=None, choices=tuple(DTYPES), help="default gather dtype (= master)"
    )
    p.add_argument("--reduce-dtype", default="fp32", choices=("fp32", "bf16"), help="grad reduce dtype")
    p.add_argument("--fsdp-precision-rules", default=None, help="operator rules, e.g. 'class:*RMSNorm=fp32'")
    p.add_argument(
        "--unaligned", action="store_true", help="pre-fix policy: no model rules, cast_forward_inputs"
    )
    p.add_argument("--seq-len", type=int, default=16, help="synthetic tokens per row")
    p.add_argument("--json", action="store_true", help="print {activations, offenders, ...} as JSON")
    return p


def cli_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (Path(args.hf_checkpoint) / "config.json").is_file():
        from miles_platform.errors import CheckpointError

        raise CheckpointError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there")
    policy = PrecisionPolicy(
        master=args.master_dtype,
        gather=args.gather_dtype or args.master_dtype,
        compute=args.forward_dtype,
        reduce=args.reduce_dtype,
        rules=tuple(parse_precision_rules(args.fsdp_precision_rules)),
    )
    census = census_checkpoint(args.hf_checkpoint, policy, aligned=not args.unaligned, seq_len=args.seq_len)
    if args.json:
        print(json.dumps(census.to_json(), sort_keys=True))
        return 0
    total = sum(census.activations.values())
    print(
        f"policy: master={policy.master} gather={policy.gather} compute={policy.compute} "
        f"{'(unaligned)' if args.unaligned else ''}"
    )
    print(
        f"float activations: {total}  " + "  ".join(f"{d}={n}" for d, n in census.activations.most_common())
    )
    print("other tensors:     " + "  ".join(f"{d}={n}" for d, n in census.other.most_common()))
    print("master weights:    " + "  ".join(f"{d}={n}" for d, n in census.master_weights.most_common()))
    print(f"offenders ({len(census.offenders)} modules outside {census.expected}):")
    for name in census.offenders:
        io = census.modules[name]
        print(f"  {name}: in={io['in']} out={io['out']}")
    return 0
