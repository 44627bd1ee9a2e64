"""`miles-platform train`'s command line: the argparse parser generated from RunConfig's fields,
YAML via --config, the `--sglang-*` passthrough, the flags a custom generate / rollout function
registers (Miles' `add_arguments` hook), and `add_flags` for other commands sharing train's flags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from miles_platform.config.compat import add_compat_flags
from miles_platform.config.flags import add_flag, field_default, load_yaml, parser_groups
from miles_platform.config.run_config import GROUPS, REFUSED, RunConfig
from miles_platform.config.weights import ALIASES
from miles_platform.errors import ConfigError

_DICT_FIELDS = ("sglang_args", "custom_function_args", "compat_flags")  # filled by parse_run_config
COMPAT_GROUP = "Miles / megatron flags without a field here (same result, or refused: docs/miles_flags.md)"


def build_parser(prog: str = "miles-platform train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Miles-style RL training (GRPO and friends).", allow_abbrev=False
    )
    parser.add_argument(
        "--config", help="YAML file of flags (snake_case or kebab-case keys); CLI overrides it"
    )
    parser.add_argument(
        "--custom-config-path",
        help="Miles' YAML (a path, or base64:<payload>) applied after the CLI: a key naming a flag "
        "overrides it, any other key reaches the run's custom functions as args.<key>",
    )
    groups = parser_groups(parser, GROUPS)
    for f in dataclasses.fields(RunConfig):
        if f.name not in _DICT_FIELDS:
            _add_run_flag(groups[f.metadata["group"]], f, argparse.SUPPRESS)
    add_compat_flags(parser.add_argument_group(COMPAT_GROUP))
    return parser


def add_flags(parser: argparse.ArgumentParser, names: Sequence[str], **defaults: Any) -> None:
    """Add RunConfig fields `names` to another command's parser with train's flag name, type,
    choices and help. `defaults` replaces a field's default for that command; help then shows it."""
    for name in names:
        f = RunConfig.__dataclass_fields__[name]
        _add_run_flag(parser, f, defaults.get(name, field_default(RunConfig, name)), shown=name in defaults)


def _add_run_flag(group, f: dataclasses.Field, default: Any, shown: bool = False) -> None:
    """One RunConfig field as an argparse flag (its Miles name plus any ALIASES)."""
    aliases = [a for a, n in ALIASES.items() if n == f.name]
    add_flag(group, f, default, shown=shown, refused=f.name in REFUSED, aliases=aliases)


def parse_run_config(
    argv: list[str] | None = None, prog: str = "miles-platform train", train_async: bool = False
) -> RunConfig:
    """Parse CLI flags (YAML via --config first, CLI overrides) into a validated RunConfig.

    `train_async`: the argv of Miles' train_async.py (`miles-platform train-async`), whose loop
    generates the next rollout while this one trains (--train-async; with --fully-async the fully
    async worker), but for a run that does not both generate and train (Miles' SFT goes through
    train_async.py with --debug-train-only), which has nothing to overlap: the plain loop."""
    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    sglang, leftover = _split_passthrough(rest)
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        data.update({k.replace("-", "_"): v for k, v in load_yaml(args.config, RunConfig, ALIASES).items()})
    given = vars(args)
    compat = {k.split(":", 1)[1]: v for k, v in given.items() if k.startswith("compat:") and v is not None}
    data.update(
        {
            k: v
            for k, v in given.items()
            if k not in ("config", "custom_config_path") and not k.startswith("compat:")
        }
    )
    extra, leftover = _function_flags(data, leftover)
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    data.setdefault("sglang_args", {}).update(sglang)
    data["compat_flags"] = {**_yaml_compat(data), **compat}
    data.setdefault("custom_function_args", {}).update(extra)
    if getattr(args, "custom_config_path", None):
        _apply_custom_config(data, args.custom_config_path)
    if train_async and not any(
        data.get(k) for k in ("debug_train_only", "load_debug_rollout_data", "debug_rollout_only")
    ):
        data["train_async"] = True
    return RunConfig.from_dict(data).validate()


def _apply_custom_config(data: dict[str, Any], source: str) -> None:
    """Miles' --custom-config-path: the YAML's keys set after the CLI (as Miles' setattr on args): a
    RunConfig flag (or a Miles flag of config/compat.py) takes the value, any other key goes to the
    custom functions' args."""
    import base64

    import yaml

    from miles_platform.config.compat import COMPAT

    try:
        text = base64.b64decode(source[7:]).decode() if source.startswith("base64:") else open(source).read()
        values = yaml.safe_load(text) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"--custom-config-path {source[:80]}: cannot read it as YAML ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--custom-config-path {source[:80]}: expected a mapping of name -> value")
    for key, value in values.items():
        name = ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in RunConfig.__dataclass_fields__:
            data[name] = value
        elif name in COMPAT:
            data["compat_flags"][name] = value
        else:
            data["custom_function_args"][name] = value


def _yaml_compat(data: dict[str, Any]) -> dict[str, Any]:
    """The compat flags a --config YAML gives (popped from `data`; the CLI's override them)."""
    from miles_platform.config.compat import COMPAT

    out = dict(data.pop("compat_flags", None) or {})
    out.update(
        {k: data.pop(k) for k in list(data) if k in COMPAT and k not in RunConfig.__dataclass_fields__}
    )
    return out


def _function_flags(data: dict[str, Any], argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Miles' `add_arguments` hook: flags that --custom-generate-function-path / --rollout-function-path
    register, from `argv` (CLI) or `data` (YAML keys, popped), CLI first. Returns (values, argv left).
    A flag that is already a RunConfig field stays that field (a copy of Miles' multi_turn registering
    --generate-max-turns means ours)."""
    from miles_platform.plugins import GENERATE_FLAG, ROLLOUT_FLAG, function_flags_parser

    paths = {
        GENERATE_FLAG: data.get("custom_generate_function_path"),
        ROLLOUT_FLAG: data.get("rollout_function_path"),
    }
    extra = function_flags_parser(paths)
    if extra is None:
        return {}, argv
    actions = [a for a in extra._actions if a.dest not in RunConfig.__dataclass_fields__]
    defaults = {a.dest: a.default for a in actions}
    for a in extra._actions:  # tell given flags from defaults
        a.default = argparse.SUPPRESS
    given, left = extra.parse_known_args(argv)
    values = {}
    for dest, default in defaults.items():
        values[dest] = getattr(given, dest) if hasattr(given, dest) else data.pop(dest, default)
        data.pop(dest, None)
    return values, left


def function_flag_values(data: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The values of a generate/rollout function's own flags given as CLI tokens (the Dagster
    Launchpad's `custom_function_flags`); a token no function registered is a ConfigError."""
    try:
        values, left = _function_flags(data, list(argv))
    except SystemExit:  # argparse's own error (a bad value), already printed to stderr
        raise ConfigError(f"custom_function_flags {argv}: a value the function's parser refuses") from None
    if left:
        raise ConfigError(
            f"custom_function_flags: {' '.join(left)} not registered by the add_arguments of "
            "--custom-generate-function-path / --rollout-function-path"
        )
    return values


def _split_passthrough(rest: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--sglang-foo-bar 1` -> {"foo-bar": "1"}; a multi-value flag (`--sglang-cuda-graph-bs 1 2 4`)
    -> a list of its values, as SGLang's own `nargs="+"` flags take them; bare `--sglang-flag` -> True."""
    out: dict[str, Any] = {}
    leftover: list[str] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--sglang-"):
            key = tok[len("--sglang-") :]
            if "=" in key:
                key, val = key.split("=", 1)
                out[key] = val
            else:
                values = []
                while i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                    values.append(rest[i + 1])
                    i += 1
                out[key] = True if not values else values[0] if len(values) == 1 else values
        else:
            leftover.append(tok)
        i += 1
    return out, leftover
