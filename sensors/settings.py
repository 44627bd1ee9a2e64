"""Sensor settings read from the environment when the code location loads (`make ui`, Reload)."""

import os


def env_int(var: str, default: int, minimum: int, meaning: str) -> int:
    """`$var` as an integer >= `minimum`, else `default`; a bad value fails the load, naming `var`."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{var}={raw!r}: must be an integer >= {minimum} ({meaning})")
    return int(raw)
