"""`miles-platform` CLI: one subcommand per capability, each a `cli_main(argv) -> int` in its module
(or the function named after a colon).

Modules are imported lazily so `miles-platform query` does not pay for torch or Ray.
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

from miles_platform.errors import MilesError

COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": (
        "ops.quickstart",
        "datasets -> SFT base -> GRPO -> evals, as Dagster materializations",
    ),
    "train": (
        "miles_platform.loop",
        "run the RL loop: Miles' train.py argv as is (docs/miles_flags.md) or --config run.yaml, no Dagster needed",
    ),
    "train-async": (
        "miles_platform.loop:cli_main_async",
        "Miles' train_async.py argv: rollout k+1 generates while k trains; --fully-async: the async worker",
    ),
    "train-diffusion": (
        "miles_platform.diffusion.loop",
        "diffusion RL (Flow-GRPO / DiffusionNFT) on a DiT pipeline, Miles-diffusion flags",
    ),
    "sft": (
        "miles_platform.training.sft",
        "supervised fine-tuning (--loss-type sft_loss) of an HF checkpoint",
    ),
    "eval": (
        "miles_platform.rollout.evaluate",
        "greedy pass@1, sampled pass@k / mean reward of an HF checkpoint on eval datasets",
    ),
    "make-data": (
        "miles_platform.data.tasks",
        "write deterministic verifiable-task datasets (train / eval / sft)",
    ),
    "serve-engine": (
        "miles_platform.rollout.engine_server",
        "start the embedded engine (SGLang HTTP API) on an HF checkpoint",
    ),
    "engine-key": (
        "miles_platform.rollout.engine_server:tenant_key_main",
        "print the key of a run sharing an engine (its LoRA adapters are its own), from the admin key",
    ),
    "serve-router": ("miles_platform.rollout.router", "start the router in front of engines"),
    "query": ("miles_platform.store.catalog", "run SQL against the DuckDB catalog"),
    "compact": (
        "miles_platform.store.compaction",
        "merge each run's small table files (metrics, lineage, ...) into one per table, rows unchanged",
    ),
    "lineage": ("miles_platform.store.lineage", "trace a policy version or checkpoint up- and downstream"),
    "viewer": (
        "miles_platform.viewer.server",
        "browse rollout samples (filters, token shading, groups) on 127.0.0.1",
    ),
    "convert": ("miles_platform.weights.conversion", "HF <-> megatron torch_dist conversion"),
    "weights": ("miles_platform.weights.cli", "disk-delta publish / apply for external fleets"),
    "quantize": ("miles_platform.weights.quantize", "fp8 / int4 quantized HF checkpoints"),
    "dtype-census": (
        "miles_platform.training.precision_census",
        "dtypes of every module input/output under a precision policy",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: miles-platform <command> [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand -> its exit status. Without `argv` this is the process's entry point (the
    console script, `python -m miles_platform.cli`): a command that returns ends the process at once
    (`exit_now`)."""
    if argv is None:
        exit_now(_main(sys.argv[1:]))
    return _main(list(argv))


def exit_now(code: int) -> NoReturn:
    """End the process with `code` as Python's own exit would, less its last step. Python's exit
    waits for non-daemon threads, runs the atexit handlers (Ray's shutdown, the fork server's stop,
    logging's flush, multiprocessing's cleanup) and then tears down every module and object; after
    torch, transformers and Ray that last part alone took ~0.7-1.3 s per `train` on a 2-core VM
    (2026-12-06), with nothing left to write. The same first steps here, stdio flushed, os._exit."""
    import atexit
    import os
    import threading

    main_thread = threading.main_thread()
    for t in threading.enumerate():
        if t is not main_thread and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(code)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"miles-platform: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _, function = COMMANDS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "cli_main")
    try:
        return int(entry(rest) or 0)
    except MilesError as e:
        print(f"miles-platform {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    main()
