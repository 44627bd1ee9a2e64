"""converted_checkpoint: the base HF checkpoint as a Megatron torch_dist checkpoint.

The conversion runs in a subprocess (`python -m miles_platform.weights.conversion`, a fork of this
process's warm server when one runs: cluster/forkserver.py `warm_python`): megatron's
dist_checkpointing forks writer processes and initializes torch.distributed, neither of which
belongs in Dagster's run process. The check `round_trip_bit_exact` converts back to HF and
compares every tensor with the base checkpoint, byte for byte.
"""

import json
import subprocess
import tempfile
from pathlib import Path

import dagster as dg

from assets.metadata import latest_path
from miles_platform.store.lineage_identity import Edge, write_edges

BASE_CHECKPOINT = dg.AssetKey("base_checkpoint")
CONVERTED_NAME = "base_torch_dist"


def _base_hf_path(context) -> str:
    """The base checkpoint's latest materialization metadata "path", else the storage convention."""
    return latest_path(context.instance, "base_checkpoint") or context.resources.storage.paths.model("base")


def _convert(*args: str) -> dict:
    from miles_platform.cluster import forkserver

    # a fork of this process's warm server when one runs (a run worker that trained, a test): torch
    # and co. already imported (~6 s of a conversion process otherwise); else the interpreter
    module = ["miles_platform.weights.conversion", *args]
    proc = subprocess.run([*forkserver.warm_python(), "-m", *module], capture_output=True, text=True)
    if proc.returncode != 0:
        raise dg.Failure(
            description=f"`{' '.join(module)}` failed (exit {proc.returncode})",
            metadata={"stderr": dg.MetadataValue.md(f"```\n{proc.stderr[-4000:]}\n```")},
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dg.asset(
    deps=[BASE_CHECKPOINT],
    required_resource_keys={"storage"},
    group_name="checkpoints",
    kinds={"megatron"},
    description="Base HF checkpoint converted to Megatron torch_dist (release/ + tracker), for --ref-load.",
)
def converted_checkpoint(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    hf = _base_hf_path(context)
    save = context.resources.storage.paths.model(CONVERTED_NAME)
    res = _convert("hf-to-torch-dist", "--hf-checkpoint", hf, "--save", save)
    write_edges(context.resources.storage.paths, "checkpoints",
                [Edge(save, "checkpoint", hf, "checkpoint", "converted_from", res["content_hash"])])  # fmt: skip
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(save),
            "source_hf_checkpoint": dg.MetadataValue.path(hf),
            "format": "torch_dist",
            "tensor_count": res["tensors"],
            "bytes": res["bytes"],
            "seconds": round(res["seconds"], 3),
            "content_hash": res["content_hash"],
        },
        data_version=dg.DataVersion(res["content_hash"]),
    )


@dg.asset_check(asset=converted_checkpoint, required_resource_keys={"storage"}, blocking=True)
def round_trip_bit_exact(context) -> dg.AssetCheckResult:
    """HF -> torch_dist -> HF gives back every base tensor bit for bit."""
    from safetensors.torch import load_file

    hf = Path(_base_hf_path(context))
    save = context.resources.storage.paths.model(CONVERTED_NAME)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        _convert("torch-dist-to-hf", "--load", save, "--hf-checkpoint", str(hf), "--save", str(out))
        back = load_file(str(out / "model.safetensors"))
    base: dict = {}
    for f in sorted(hf.glob("*.safetensors")):
        base.update(load_file(str(f)))
    if json.loads((hf / "config.json").read_text()).get("tie_word_embeddings"):
        base.pop("lm_head.weight", None)
    missing = sorted(set(base) ^ set(back))
    differ = sorted(k for k in set(base) & set(back) if not _same_bits(base[k], back[k]))
    return dg.AssetCheckResult(
        passed=not missing and not differ,
        metadata={
            "tensors_compared": len(set(base) & set(back)),
            "mismatched": dg.MetadataValue.json(differ[:20]),
            "missing_or_extra": dg.MetadataValue.json(missing[:20]),
        },
    )


def _same_bits(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
