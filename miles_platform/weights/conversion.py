"""HF <-> Megatron torch_dist conversion (`miles-platform convert ...`).

    miles-platform convert hf-to-torch-dist --hf-checkpoint DIR --save DIR [--tensor-model-parallel-size N]
        [--pipeline-model-parallel-size N] [--expert-model-parallel-size N] [--expert-tensor-parallel-size N]
    miles-platform convert torch-dist-to-hf --load DIR --hf-checkpoint DIR --save DIR

hf-to-torch-dist builds megatron-core's GPTModel, loads the bridged weights and writes
`dist_checkpointing.save(model.sharded_state_dict())`: the real torch_dist format. Layout, as
Megatron/Miles write a converted checkpoint:

    <save>/release/                          torch_dist (metadata.json, .metadata, *.distcp, common.pt)
    <save>/latest_checkpointed_iteration.txt "release"  (written last)

With a layout (Miles' flags: TP, PP, EP, expert TP), lcm(TP, expert TP x EP) x PP gloo ranks
(forks of the stdlib fork server) each save their shards (a pipeline stage's layers, an expert-parallel rank's
experts, TP slices); torch_dist reshards on load, so any layout reads it back. Everything is written under a temp
dir next to --save and renamed, so --save never holds a half-written checkpoint.

torch-dist-to-hf loads (TP=1) a torch_dist dir or a save root with the tracker file, maps
names back through the bridge and writes model.safetensors + the config/tokenizer files of
--hf-checkpoint, atomically. dist_checkpointing forks writer processes: run this module as
`python -m miles_platform.weights.conversion` (it has the `__main__` guard) or via the CLI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from miles_platform.errors import CheckpointError
from miles_platform.progress import Progress
from miles_platform.store.atomic import write_atomic

RELEASE = "release"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


@dataclass
class ConversionResult:
    path: str
    tensors: int
    bytes: int
    seconds: float
    content_hash: str = ""  # sha256 over (name, dtype, shape, bytes) of the converted tensors


def read_hf_state_dict(hf_checkpoint: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, all tensors of every *.safetensors file), validated and unconverted."""
    from miles_platform.models.checkpoint import read_safetensors_dir, validate_hf_dir

    cfg = validate_hf_dir(hf_checkpoint, need_tokenizer=False)
    return cfg, read_safetensors_dir(hf_checkpoint)


def tensors_hash(sd: dict[str, torch.Tensor]) -> str:
    """Deterministic content hash of a state dict (the Dagster data version of a conversion)."""
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _state_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype most of a state's floating-point elements have (the model is built in it; a tensor
    stored in another dtype, e.g. Qwen3.5's fp32 A_log beside bf16 weights, keeps its own: _keep_dtypes)."""
    count: dict[torch.dtype, int] = {}
    for t in sd.values():
        if t.is_floating_point():
            count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=count.get) if count else torch.float32


def _keep_dtypes(chunks, dtype_of) -> None:
    """Each parameter in the dtype its source has (`dtype_of(global name)`, None: the model's): a conversion
    writes every tensor in the dtype it read it in, so both ways are bit for bit, dtypes included."""
    from miles_platform.training.megatron_weights import global_names

    for model in chunks:
        params = dict(model.named_parameters())
        for local, name in global_names(model).items():
            p, want = params.get(local), dtype_of(name)
            if p is not None and want is not None and p.dtype != want:
                p.data = p.data.to(want)


def _convert_rank(
    rank: int, world: int, port: int | None, layout, hf_checkpoint: str, out_dir: str, errors,
    bar: Progress | None = None,
) -> None:  # fmt: skip
    """One rank of the layout: build its GPTModel chunks, load its shards of the bridged HF
    weights, save torch_dist. `bar` (rank 0 only): a step per phase."""
    from miles_platform.training import megatron_backend as mb
    from miles_platform.training import megatron_shims
    from miles_platform.training.megatron_parallel import build_model_chunks

    step = bar.update if bar is not None else lambda *a, **k: None

    try:
        torch.set_num_threads(1)
        cfg, hf_sd = read_hf_state_dict(hf_checkpoint)
        megatron_shims.init_process_group(
            rank, world, master_port=port, layout=layout, num_layers=cfg["num_hidden_layers"]
        )
        chunks, bridge = build_model_chunks(cfg, layout, _state_dtype(hf_sd), mb.te_available())
        step(stage="loading the weights")
        full = bridge.hf_to_megatron(
            hf_sd,
            cfg,
            fused_norms=mb.uses_fused_norms(chunks[0]),
            padded_vocab_size=bridge.gpt_model_kwargs(cfg, layout.tp)["vocab_size"],
        )
        _keep_dtypes(chunks, lambda name: full[name].dtype if name in full else None)
        mb.load_full_state(chunks, full)
        step(stage="saving torch_dist")
        mb.save_torch_dist(chunks, out_dir)
        step(stage="finishing")
    except Exception as e:
        if errors is None:
            raise
        errors.put(f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e))
    finally:
        megatron_shims.destroy_process_group()


def _run_ranks(world: int, layout, hf_checkpoint: str, out_dir: str, bar: Progress | None = None) -> None:
    """Rank 0 runs here, ranks 1..world-1 as multiprocessing Processes (cluster/forkserver.py
    `rank_context`): forks of this process when it is single-threaded, else of the stdlib fork
    server (with what a rank imports preloaded, started once per process, so a later conversion in
    the same process forks from it again)."""
    import torch.distributed as dist

    from miles_platform.cluster.ports import free_port

    if dist.is_initialized():
        raise CheckpointError("hf-to-torch-dist: run it in a process without a torch.distributed group")
    if world == 1:
        _convert_rank(0, 1, None, layout, hf_checkpoint, out_dir, None, bar)
        return
    from miles_platform.cluster.forkserver import rank_context

    ctx = rank_context()
    errors = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_convert_rank, args=(r, world, port, layout, hf_checkpoint, out_dir, errors))
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        _convert_rank(0, world, port, layout, hf_checkpoint, out_dir, errors, bar)
    finally:
        for p in procs:
            p.join()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    if msgs or any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        raise CheckpointError(
            f"hf-to-torch-dist failed (exit codes of ranks 1..: {codes}): {'; '.join(msgs)}"
        )


def _temp_sibling(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"


def _finish(tmp: Path, dest: Path, data_dir: Path, t0: float) -> ConversionResult:
    from miles_platform.models.checkpoint import checkpoint_bytes
    from miles_platform.store.atomic import fsync_tree, replace_dir

    fsync_tree(tmp)
    replace_dir(tmp, dest)
    final = dest / data_dir.relative_to(tmp)
    tensors = _count_tensors(final)
    return ConversionResult(str(dest), tensors, checkpoint_bytes(dest), time.perf_counter() - t0)


def _count_tensors(path: Path) -> int:
    if (path / ".metadata").exists():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return sum(isinstance(v, TensorStorageMetadata) for v in md.values())
    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            n += len(list(fh.keys()))
    return n


def hf_to_torch_dist(
    hf_checkpoint: str | os.PathLike, save: str | os.PathLike, tensor_model_parallel_size: int = 1,
    progress: bool = False, pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ConversionResult:  # fmt: skip
    """HF dir -> <save>/release/ (torch_dist) + latest_checkpointed_iteration.txt, atomically, saved
    by the ranks of the layout (module docstring). `progress`: a line on stderr every interval
    (phase, ETA; miles_platform/progress.py)."""
    from miles_platform.training.megatron_parallel import Layout

    layout = Layout(tp=int(tensor_model_parallel_size), pp=int(pipeline_model_parallel_size),
                    ep=int(expert_model_parallel_size), etp=expert_tensor_parallel_size)  # fmt: skip
    with Progress("convert hf-to-torch-dist", 5, enabled=progress) as bar:
        return _hf_to_torch_dist(hf_checkpoint, save, layout, bar)


def _check_layout(layout, cfg: dict) -> int:
    """The layout's world size; CheckpointError names the flag the model does not split by."""
    for flag, v in (("--tensor-model-parallel-size", layout.tp), ("--pipeline-model-parallel-size", layout.pp),
                    ("--expert-model-parallel-size", layout.ep),
                    ("--expert-tensor-parallel-size", layout.etp or 1)):  # fmt: skip
        if v < 1:
            raise CheckpointError(f"{flag} {v}: must be >= 1")
    groups = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if groups % layout.tp:
        raise CheckpointError(
            f"--tensor-model-parallel-size {layout.tp}: must divide num_key_value_heads ({groups})"
        )
    layers = int(cfg["num_hidden_layers"])
    if layers % layout.pp:
        raise CheckpointError(
            f"--pipeline-model-parallel-size {layout.pp}: must divide num_hidden_layers ({layers})"
        )
    from miles_platform.models.families import routed_experts
    from miles_platform.training.megatron_parallel import layout_refusal

    experts = routed_experts(cfg)
    if why := layout_refusal(cfg, layout, step=False):
        raise CheckpointError(why)
    if (layout.ep > 1 or layout.etp) and not experts:
        raise CheckpointError(
            "--expert-model-parallel-size / --expert-tensor-parallel-size: the model has no experts"
        )
    if experts % layout.ep:
        raise CheckpointError(
            f"--expert-model-parallel-size {layout.ep}: must divide num_experts ({experts})"
        )
    etp = layout.etp or layout.tp
    ffn = int(cfg.get("moe_intermediate_size") or 0)
    if experts and ffn % etp:
        raise CheckpointError(
            f"--expert-tensor-parallel-size {etp}: must divide moe_intermediate_size ({ffn})"
        )
    return math.lcm(layout.tp, etp * layout.ep) * layout.pp


def _hf_to_torch_dist(hf_checkpoint, save, layout, bar: Progress) -> ConversionResult:
    from miles_platform.models.bridge import get_bridge

    t0 = time.perf_counter()
    # validate names and shapes here, before any process group or temp dir exists
    bar.update(0, stage="reading the HF weights")
    cfg, hf_sd = read_hf_state_dict(hf_checkpoint)
    world = _check_layout(layout, cfg)
    digest = tensors_hash(get_bridge(cfg).hf_to_megatron(hf_sd, cfg))
    del hf_sd
    dest = Path(save)
    tmp = _temp_sibling(dest)
    try:
        data_dir = tmp / RELEASE
        data_dir.mkdir(parents=True)
        bar.update(stage="building the megatron model")
        _run_ranks(world, layout, str(hf_checkpoint), str(data_dir), bar)
        write_atomic(tmp / TRACKER_FILE, RELEASE)  # pointer last
        res = _finish(tmp, dest, data_dir, t0)
        bar.update(stage="")
        res.content_hash = digest
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_dtype(ckpt_dir: Path, cfg: dict) -> torch.dtype:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    meta = md.get("embedding.word_embeddings.weight")
    if meta is not None and hasattr(meta, "properties"):
        return meta.properties.dtype
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, name)


def _stored_dtypes(ckpt_dir: Path):
    """global name -> the dtype a torch_dist checkpoint stores it in (a tensor megatron shards by parts,
    GatedDeltaNet's in_proj, is stored as `<name>.<part>` entries of one dtype), else None."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in md.items() if hasattr(v, "properties")}

    def dtype_of(name: str):
        if name in dtypes:
            return dtypes[name]
        return next((d for k, d in dtypes.items() if k.startswith(name + ".")), None)

    return dtype_of


def torch_dist_to_hf(
    load: str | os.PathLike, hf_checkpoint: str | os.PathLike, save: str | os.PathLike, progress: bool = False
) -> ConversionResult:
    """torch_dist (dir or save root) -> HF dir with --hf-checkpoint's config and tokenizer, atomically.
    `progress`: a line on stderr every interval (phase, ETA; miles_platform/progress.py)."""
    with Progress("convert torch-dist-to-hf", 4, enabled=progress) as bar:
        return _torch_dist_to_hf(load, hf_checkpoint, save, bar)


def _torch_dist_to_hf(load, hf_checkpoint, save, bar: Progress) -> ConversionResult:
    from safetensors.torch import save_file

    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.training import megatron_backend as mb
    from miles_platform.training import megatron_shims

    t0 = time.perf_counter()
    cfg = validate_hf_dir(hf_checkpoint, need_tokenizer=False)
    ckpt_dir = mb.check_torch_dist_dir(load)
    bar.update(0, stage="building the megatron model")
    megatron_shims.init_single_process_group()
    try:
        model, bridge = mb.build_gpt_model(cfg, 1, params_dtype=_checkpoint_dtype(ckpt_dir, cfg))
        _keep_dtypes([model], _stored_dtypes(ckpt_dir))
        bar.update(stage="loading torch_dist")
        mb.load_torch_dist(model, ckpt_dir)
        bar.update(stage="mapping to HF names")
        hf_sd = bridge.checkpoint_layout(bridge.megatron_to_hf(mb.gather_full_state(model), cfg), cfg)
    finally:
        megatron_shims.destroy_process_group()
    dest = Path(save)
    tmp = _temp_sibling(dest)
    try:
        tmp.mkdir()
        for f in Path(hf_checkpoint).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(f, tmp / f.name)
        bar.update(stage="writing model.safetensors")
        save_file(hf_sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        res = _finish(tmp, dest, tmp, t0)
        bar.update(stage="")
        res.content_hash = tensors_hash(hf_sd)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform convert", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-torch-dist", help="HF safetensors -> Megatron torch_dist")
    a.add_argument("--hf-checkpoint", required=True)
    a.add_argument("--save", required=True)
    a.add_argument("--tensor-model-parallel-size", type=int, default=1)
    a.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    a.add_argument("--expert-model-parallel-size", type=int, default=1)
    a.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: TP")
    b = sub.add_parser("torch-dist-to-hf", help="Megatron torch_dist -> HF safetensors")
    b.add_argument("--load", required=True, help="torch_dist dir, or a save root with the tracker file")
    b.add_argument("--hf-checkpoint", required=True, help="HF dir to take config and tokenizer from")
    b.add_argument("--save", required=True)
    return p


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.direction == "hf-to-torch-dist":
        res = hf_to_torch_dist(
            args.hf_checkpoint, args.save, args.tensor_model_parallel_size, progress=True,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        )  # fmt: skip
    else:
        res = torch_dist_to_hf(args.load, args.hf_checkpoint, args.save, progress=True)
    print(json.dumps(asdict(res)))
    return 0


if __name__ == "__main__":
    import sys

    from miles_platform.cli import main

    sys.exit(main(["convert", *sys.argv[1:]]))
