"""The flag machinery every run-config dataclass shares (`train`'s RunConfig, `train-diffusion`'s
DiffusionRunConfig): a field is a flag (`flag(default, group, help, choices)`), its Miles name is
`flag_name(field)`, its argparse action is `add_flag`, its range a `(low, high, low excluded, what)`
tuple checked by `check_ranges`, and a YAML file is read by `load_yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from miles_platform.errors import ConfigError


def flag(
    default: Any,
    group: str,
    help: str,
    choices: tuple | None = None,
    nargs: str | None = None,
    const: Any = None,
):
    """A dataclass field that is a flag: its argparse group, help, choices and nargs in `metadata`
    (the `--help` text, the Launchpad description and the choices check all read them)."""
    meta = {"group": group, "help": help, "choices": choices, "nargs": nargs, "const": const}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def flag_name(name: str) -> str:
    """`lora_rank` -> `--lora-rank`: the field's Miles flag, as errors and `--help` name it."""
    return "--" + name.replace("_", "-")


def field_default(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls` (a fresh copy for list and dict fields)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def changed_flags(cfg: Any, names: Iterable[str]) -> list[str]:
    """The flags among `names` that `cfg` sets to something other than their default, as `--name`s."""
    return [flag_name(n) for n in names if getattr(cfg, n) != field_default(type(cfg), n)]


# ranges: flag -> (low, high, low excluded, what the error says); None values are skipped
POSITIVE = (1, None, False, "an integer >= 1")
NON_NEGATIVE = (0, None, False, ">= 0")
FRACTION = (0, 1, True, "in (0, 1]")
UNIT = (0, 1, False, "in [0, 1]")
FINITE = (-math.inf, None, True, "a finite number")


def check_ranges(cfg: Any, ranges: Mapping[str, tuple]) -> None:
    """Every numeric flag in `ranges` within its range (NaN and inf included), with the flag named."""
    for name, (lo, hi, lo_open, what) in ranges.items():
        v = getattr(cfg, name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(f"{flag_name(name)} {v!r}: expected a number")
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            raise ConfigError(f"{flag_name(name)} {v}: must be {what}")


def check_choices(cfg: Any) -> None:
    """Every field with `choices` holds one of them (for YAML, Dagster and Python callers too)."""
    for f in dataclasses.fields(cfg):
        choices, v = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and v is None and f.default is not None and f.default is not dataclasses.MISSING:
            # a flag with a default that YAML, Dagster or Python set to null: not one of its choices
            raise ConfigError(f"{flag_name(f.name)} None: must be one of {', '.join(map(str, choices))}")
        if (
            choices
            and v is not None
            and not (v in choices if not isinstance(v, list) else set(v) <= set(choices))
        ):
            raise ConfigError(f"{flag_name(f.name)} {v!r}: must be one of {', '.join(map(str, choices))}")


def add_flag(
    group: Any,
    f: dataclasses.Field,
    default: Any,
    shown: bool = False,
    refused: bool = False,
    aliases: Sequence[str] = (),
) -> None:
    """One flag field as an argparse flag (its Miles name plus `aliases`, other field names).
    `shown`: help shows the default; `refused`: help says the build refuses it."""
    meta, text = f.metadata, f.metadata["help"]
    text += " [not supported by this build: refused if set]" if refused else ""
    text += " (default: %(default)s)" if shown else ""
    kw: dict[str, Any] = {"help": text, "dest": f.name, "default": default}
    if f.type in ("bool", bool):
        group.add_argument(flag_name(f.name), action="store_true", **kw)
        return
    if f.type == "bool | None":  # --flag / --no-flag; unset: None (a default that depends on others)
        group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kw)
        return
    if meta["nargs"]:
        kw["nargs"] = meta["nargs"]
        if meta.get("const") is not None:  # a bare `--flag` (nargs "?") means this value
            kw["const"] = meta["const"]
        kw["type"] = int if "int" in str(f.type) else str
    else:
        kw["type"] = scalar_type(str(f.type))
    if meta["choices"]:
        kw["choices"] = meta["choices"]
    group.add_argument(flag_name(f.name), *[flag_name(a) for a in aliases], **kw)


def scalar_type(t: str):
    """The argparse `type` of a field annotated `t` (`int | None` -> int)."""
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str


def load_yaml(path: str, cls: type, aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A `--config` YAML file of flags for the dataclass `cls`: a mapping, each known key of its
    field's type (bool, int, number). Unknown keys are left for `cls.from_dict` to name."""
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag -> value, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = aliases or {}
    for key, value in data.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        f = fields.get(name)
        if f is None or value is None:
            continue  # unknown keys: from_dict names them
        t = str(f.type)
        want = (
            bool if t.startswith("bool")
            else (int,) if t.startswith("int")
            else (int, float) if t.startswith("float")
            else None
        )  # fmt: skip
        bad = want is not None and (
            not isinstance(value, want) or (want is not bool and isinstance(value, bool))
        )
        if bad:
            kind = {bool: "true/false", (int,): "an integer", (int, float): "a number"}[want]
            raise ConfigError(f"--config {path}: {key}: expected {kind}, got {value!r}")
    return data


def parser_groups(parser: argparse.ArgumentParser, groups: Sequence[str]) -> dict[str, Any]:
    """One argparse group per flag group, in `--help` order."""
    return {g: parser.add_argument_group(f"{g} arguments") for g in groups}


def json_flag(value: Any, flag: str, expected: type, what: str) -> Any:
    """A flag given as JSON text (or as the value itself, from YAML or the Launchpad), checked to be
    `expected` (dict, list): a ConfigError naming the flag and `what` it takes otherwise."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: not JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(value, expected):
        raise ConfigError(f"{flag}: expected {what}, got {type(value).__name__}")
    return value
