"""Megatron layouts: step time and per-rank memory of one GRPO step at each layout vs TP1 (1 rank).

Dense tiny Qwen3 (hidden 256, 4 layers, 8 heads in 4 query groups): TP2, TP2 + SP, PP2 and CP2 on 2
gloo ranks against the same step on 1 rank; tiny Qwen3-MoE (4 experts, top-2): EP2 and TP2 + SP +
EP2 at expert TP 1 against its EP1 (1 rank). Same checkpoint, same 128 samples (the quickstart's
rollout shape), 4 micro-batches of 32, AdamW; each layout's ranks are fresh processes
(TrainerActor in-process on its rank, as the Ray actor runs it).

Per layout, four rows, each a ratio against the 1-rank run measured in this run:
- step s: the fastest of 3 timed `TrainerActor.train` calls after a warm-up, slowest rank;
- peak RSS MiB/rank: the process's VmHWM during the timed steps (reset after the warm-up and a
  malloc_trim) minus its VmRSS before the actor was built, the trainer's modules imported: what the
  trainer holds (model, grads, optimizer state, communication buffers, what the build imports or
  allocates lazily) plus a step's transients (activations, logits), largest rank. RSS, not an allocator count: torch has no allocator statistics on CPU;
- step RSS MiB/rank: the same VmHWM minus the VmRSS after the warm-up: what a step adds on top of
  the warmed-up trainer (activations, logits, gathered tensors), largest rank;
- model state MiB/rank: bytes of this rank's parameters, main grads and AdamW state, counted.

On CPU the point is per-rank memory and that the layouts run, not speed: the 2 ranks share the
host's cores with each other (and here with whatever else runs), gloo's collectives are memcpy
through TCP loopback, and a step this small is dominated by per-op overhead, so the step-time ratio
says little about GPUs, where model parallelism is how a model that does not fit one device trains at
all. Correctness is the tests' (tests/unit/training/test_megatron_layouts.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import error_row, main, row

REPEATS = 3
DENSE = {
    "TP2": dict(tensor_model_parallel_size=2),
    "TP2+SP": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "PP2": dict(pipeline_model_parallel_size=2),
    "CP2": dict(context_parallel_size=2),
}
MOE = {
    "EP2": dict(expert_model_parallel_size=2),
    "TP2+SP+EP2 (expert TP 1)": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ),  # fmt: skip
}


def make_checkpoints(root: str) -> tuple[str, str]:
    """The dense tiny Qwen3 and the tiny Qwen3-MoE, each every layout above can split."""
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.families import build_model, tiny_config
    from miles_platform.models.tokenizer import build_task_tokenizer

    tok = build_task_tokenizer()
    shape = dict(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_hidden_layers=4
    )
    dense = tiny_config("qwen3", len(tok), intermediate_size=768, **shape)
    moe = tiny_config("qwen3_moe", len(tok), moe_intermediate_size=384, **shape)
    paths = os.path.join(root, "dense"), os.path.join(root, "moe")
    for cfg, path in zip((dense, moe), paths, strict=True):
        save_hf_checkpoint(build_model(cfg, seed=0), tok, path)
    return paths


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model_state_bytes(actor) -> int:
    import torch

    seen, total = set(), 0
    for p in actor.backend.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        total += 0 if g is None else g.numel() * g.element_size()
    for st in actor.opt.state.values():
        total += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return total


def _worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from bench.bench_train import make_batch
    from miles_platform.config import RunConfig
    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.recipes import DEMO_RL
    from miles_platform.training import megatron_backend, megatron_shims  # noqa: F401 (imported before rss0)
    from miles_platform.training.actor import TrainerActor

    try:
        recipe = {k: DEMO_RL[k] for k in ("lr", "eps_clip", "weight_decay", "calculate_per_token_loss",
                                          "advantage_estimator")}  # fmt: skip
        cfg = RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=16, n_samples_per_prompt=8,
                        num_steps_per_rollout=1, micro_batch_size=32, actor_num_gpus_per_node=world,
                        storage_root=f"{out}/root", **recipe, **overrides).validate()  # fmt: skip
        batch = make_batch(int(validate_hf_dir(ckpt)["vocab_size"]))
        rss0 = _rss_kib("VmRSS")
        actor = TrainerActor(cfg, rank, world, f"tcp://127.0.0.1:{port}")
        actor.train(0, batch)  # warm-up: first-call allocations, optimizer state
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap the build and warm-up freed goes back to the OS
        rss1 = _rss_kib("VmRSS")  # the warmed-up trainer: model, grads, optimizer state, buffers
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        times = []
        for i in range(REPEATS):
            t0 = time.perf_counter()
            actor.train(i + 1, batch)
            times.append(time.perf_counter() - t0)
        hwm = _rss_kib("VmHWM")
        res = dict(step_s=min(times), peak_rss_mib=(hwm - rss0) / 1024, step_rss_mib=(hwm - rss1) / 1024,
                   state_mib=_model_state_bytes(actor) / 2**20)  # fmt: skip
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    except Exception:
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


def measure(ckpt: str, out: str, world: int, overrides: dict) -> dict:
    """The slowest rank's step and the largest rank's memory of one layout."""
    import torch.multiprocessing as mp

    from miles_platform.cluster.ports import free_port

    os.makedirs(out)
    mp.start_processes(
        _worker, args=(world, free_port(), ckpt, out, overrides), nprocs=world, start_method="spawn"
    )
    errors = sorted(Path(out).glob("*.error"))
    if errors:
        raise RuntimeError(errors[0].read_text().strip().splitlines()[-1])
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


UNITS = {
    "step_s": "s per GRPO step, slowest rank (ratio vs 1 rank; on CPU not a speed measure, see docstring)",
    "peak_rss_mib": "MiB peak RSS growth per rank, VmHWM over the steps - VmRSS before the actor (ratio vs 1 rank)",
    "step_rss_mib": "MiB RSS a step adds per rank, VmHWM over the steps - VmRSS after the warm-up (ratio vs 1 rank)",
    "state_mib": "MiB params + main grads + AdamW state per rank, counted (ratio vs 1 rank)",
}


def run() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_layouts_") as d:
        dense, moe = make_checkpoints(d)
        for model, ckpt, base_name, layouts in (
            ("qwen3", dense, "TP1", DENSE),
            ("qwen3-moe", moe, "EP1", MOE),
        ):
            try:
                base = measure(ckpt, f"{d}/{model}-1", 1, {})
            except Exception as e:
                rows += [
                    error_row(f"layouts {model}: {n}", f"{base_name} failed: {e}"[:200]) for n in layouts
                ]
                continue
            for name, flags in layouts.items():
                try:
                    got = measure(ckpt, f"{d}/{model}-{name}", 2, flags)
                except Exception as e:
                    rows.append(error_row(f"layouts {model}: {name}", str(e)[:200]))
                    continue
                for key, unit in UNITS.items():
                    rows.append(
                        row(f"layouts {model}: {name} vs {base_name}, {key}", got[key], base[key], unit)
                    )
    return rows


if __name__ == "__main__":
    main(run)
