"""The user-facing surface of the run flags, as JSON.

Compact (the default; tests/unit/config/test_flag_surface.py compares it with
tests/unit/config/flag_surface.json, so no flag's name, default, type, choices or group changes by
accident): every argparse action of `miles-platform train` / `train-diffusion` / `eval`, one line
each, every RunConfig / DiffusionRunConfig field's default, and the Launchpad fields of
`rl_training` with their defaults.

--full adds the help texts, the whole `--help` output, every RunConfig / DiffusionRunConfig field's
metadata, the Launchpad JSON schema and the public tables of `miles_platform.config`: diff two runs
of it around a refactoring of the config package.

Usage: python scripts/flag_surface.py [--full] [--write]   (--write refreshes the golden file after
a deliberate change: a new flag, a changed default)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "unit" / "config" / "flag_surface.json"
# this checkout's package, not the one the venv installed (editable from another worktree)
sys.path.insert(0, str(REPO))


def _value(v):
    if v is argparse.SUPPRESS:
        return "==SUPPRESS=="
    if isinstance(v, type):
        return v.__name__
    if isinstance(v, tuple | list):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _value(x) for k, x in v.items()}
    if isinstance(v, frozenset | set):
        return sorted(map(str, v))
    if v is None or isinstance(v, bool | int | str):
        return v
    return repr(v)


def parser_surface(parser: argparse.ArgumentParser, full: bool) -> dict:
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    actions = [
        {
            "option_strings": a.option_strings,
            "dest": a.dest,
            "default": _value(a.default),
            **({"help": a.help} if full else {}),
            "type": _value(a.type),
            "choices": _value(a.choices),
            "nargs": _value(a.nargs),
            "const": _value(a.const),
            "required": a.required,
            "action": type(a).__name__,
            "group": group_of.get(id(a)),
        }
        for a in parser._actions
    ]
    if not full:  # compact: leave out what is unset
        actions = [
            {k: v for k, v in a.items() if k in ("dest", "default") or v not in (None, False)}
            for a in actions
        ]
    return {"actions": actions, "help": parser.format_help().splitlines()} if full else {"actions": actions}


def fields_surface(cls) -> list[dict]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(
            {
                "name": f.name,
                "type": str(f.type),
                "default": _value(default),
                "metadata": _value(dict(f.metadata)),
            }
        )
    return out


def surface(full: bool = False) -> dict:
    os.environ["COLUMNS"] = "120"  # argparse wraps --help to the terminal width
    from miles_platform import config
    from miles_platform.diffusion import config as dconfig
    from miles_platform.rollout import evaluate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ops.training import RLTrainingConfig

    tables = {
        name: _value(getattr(config, name))
        for name in ("GROUPS", "REFUSED", "RESUMABLE", "LOGGING", "LORA_FLAGS", "MIS_FLAGS", "ALIASES",
                     "DATASET_FLAGS", "REWARD_FLAGS", "WANDB_MODES", "OPD_TYPES", "OPD_TOP_K_STRATEGIES",
                     "OPD_REWARD_WEIGHT_MODES")
    }  # fmt: skip
    schema = RLTrainingConfig.model_json_schema()
    compact = {
        "train": parser_surface(config.build_parser(), full),
        "train_diffusion": parser_surface(dconfig.build_parser(), full),
        "eval": parser_surface(evaluate.build_parser(), full),
        "run_config_defaults": {f["name"]: f["default"] for f in fields_surface(config.RunConfig)},
        "diffusion_run_config_defaults": {
            f["name"]: f["default"] for f in fields_surface(dconfig.DiffusionRunConfig)
        },
        "launchpad_defaults": {k: v.get("default") for k, v in schema["properties"].items()},
    }
    if not full:
        return compact
    return {
        **compact,
        "run_config_fields": fields_surface(config.RunConfig),
        "diffusion_run_config_fields": fields_surface(dconfig.DiffusionRunConfig),
        "launchpad_schema": schema,
        "tables": tables,
        "default_config_hash": config.RunConfig(rollout_batch_size=2).validate().config_hash(),
    }


def dumps(data: dict) -> str:
    """JSON with one line per action / field, so a diff shows the flag that changed."""
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        end = "," if i < len(data) - 1 else ""
        if key in ("train", "train_diffusion", "eval") and "help" not in value:
            rows = [json.dumps(a, default=str) for a in value["actions"]]
            lines.append(f' "{key}": {{"actions": [\n  ' + ",\n  ".join(rows) + f"\n ]}}{end}")
        elif key.endswith("_defaults"):
            rows = [f"{json.dumps(k)}: {json.dumps(v, default=str)}" for k, v in value.items()]
            lines.append(f' "{key}": {{\n  ' + ",\n  ".join(rows) + f"\n }}{end}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, indent=1, default=str)}{end}")
    return "\n".join(lines) + "\n}\n"


def main() -> int:
    data = surface(full="--full" in sys.argv)
    text = dumps(data) if "--full" not in sys.argv else json.dumps(data, indent=1, default=str) + "\n"
    if "--write" in sys.argv:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
