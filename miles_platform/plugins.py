"""Load user code named by a flag: `--custom-rm-path my_pkg.rewards.score` -> the function.

Every extension point (rewards, filters, losses, rollout functions) goes through
`load_function`, so a typo in a flag fails at startup with the flag's name in the message
instead of deep inside a Ray actor.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from miles_platform.config import ConfigError


def load_function(path: str, flag: str, required_params: int | None = None) -> Callable[..., Any]:
    """Import `<module>.<fn>` for `flag` (e.g. "--custom-rm-path").

    `required_params`: the number of positional arguments the caller will pass; the function
    must accept exactly that many (extra parameters need defaults, *args is fine).
    Raises ConfigError naming the flag on any problem.
    """
    if not path or "." not in path:
        raise ConfigError(f"{flag} {path!r}: expected a dotted path <module>.<function>")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while the module runs
        raise ConfigError(
            f"{flag} {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, attr):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(
            f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r} (callables: {public})"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"{flag} {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    if required_params is not None:
        _check_arity(fn, path, flag, required_params)
    return fn


def _check_arity(fn: Callable[..., Any], path: str, flag: str, n: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust the user
    positional = [
        p
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    if len(required) > n or (len(positional) < n and not varargs):
        raise ConfigError(
            f"{flag} {path!r}: function{sig} must take {n} positional argument(s), "
            f"it takes {len(positional)} ({len(required)} required)"
        )
