"""Load user code named by a flag: `--custom-rm-path my_pkg.rewards.score` -> the function.

Every extension point (rewards, filters, losses, rollout functions) goes through
`load_function`, so a typo in a flag fails at startup with the flag's name in the message
instead of deep inside a Ray actor. `load_generate_function` / `load_rollout_function` also
check the signature Miles documents and adapt the old generate form.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from miles_platform.errors import ConfigError

GENERATE_FLAG = "--custom-generate-function-path"
ROLLOUT_FLAG = "--rollout-function-path"
EVAL_FLAG = "--eval-function-path"
# Miles' built-in functions, as a Miles launch script names them -> this build's equivalents
MILES_BUILTINS = (
    {
        f"miles.rollout.generate_hub.{m}.generate": f"miles_platform.rollout.generate_hub.{m}.generate"
        for m in ("single_turn", "multi_turn", "agentic_tool_call")
    }
    | {
        f"miles.rollout.filter_hub.dynamic_sampling_filters.{f}": (
            f"miles_platform.rollout.filter_hub.dynamic_sampling_filters.{f}"
        )
        for f in ("check_reward_nonzero_std", "check_no_aborted")
    }
    | {  # SFT: a finished conversation per record, no engine (--debug-train-only --loss-type sft_loss)
        "miles.rollout.sft_rollout.generate_rollout": "miles_platform.rollout.sft_rollout.generate_rollout",
        "miles.rollout.data_source.pop_first": "miles_platform.rollout.filter_hub.pop_first",
    }
    | {  # Miles' MIS example (docs/algorithms.md): one function here, no context parallelism
        f"examples.infra_features.train_infer_mismatch_helper.mis.compute_mis_weights_{v}": (
            "miles_platform.training.mis.compute_mis_weights_with_cp"
        )
        for v in ("with_cp", "fsdp")
    }
)
# (Miles' OPD reward function and reward post-process are what --use-opd does: config/opd.py)
AGENTIC = "miles_platform.rollout.generate_hub.agentic_tool_call.generate"


def load_function(path: str, flag: str, required_params: int | None = None) -> Callable[..., Any]:
    """Import `<module>.<fn>` for `flag` (e.g. "--custom-rm-path").

    `required_params`: the number of positional arguments the caller will pass; the function
    must accept exactly that many (extra parameters need defaults, *args is fine).
    Raises ConfigError naming the flag on any problem.
    """
    fn = load_object(path, flag)
    if not callable(fn):
        raise ConfigError(
            f"{flag} {path!r}: {path.rpartition('.')[2]!r} is a {type(fn).__name__}, not a function"
        )
    if required_params is not None:
        _check_arity(fn, path, flag, required_params)
    return fn


def load_object(path: str, flag: str) -> Any:
    """Import `<module>.<attr>` for `flag`, any kind of object (a tool-spec list, a class, a function)."""
    path = MILES_BUILTINS.get(path, path)
    if not path or "." not in path:
        raise ConfigError(f"{flag} {path!r}: expected a dotted path <module>.<function>")
    if path.split(".")[0] == "miles":
        known = ", ".join(sorted(MILES_BUILTINS))
        raise ConfigError(
            f"{flag} {path!r}: a built-in of Miles this build has no equivalent of (the ones it maps: "
            f"{known}); port the function into your own module and name that"
        )
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
    return getattr(module, attr)


def load_hook(cfg: Any, name: str) -> Callable[..., Any] | None:
    """The customization hook in field `name` of `cfg` (config/hooks.py HOOKS), checked to take the
    arguments Miles passes; None when not given. --rollout-data-postprocess-path takes Miles' `(args)`
    or `(args, rollout_data)`."""
    from miles_platform.config.hooks import HOOKS

    path = getattr(cfg, name, None)  # a duck-typed `args` (a test's, a user's) may lack the field
    if not path or (hasattr(cfg, "is_opd_hook") and cfg.is_opd_hook(name)):  # --use-opd's own
        return None
    flag, (arity, signature) = "--" + name.replace("_", "-"), HOOKS[name]
    fn = load_function(path, flag)
    try:
        try:
            _check_arity(fn, path, flag, arity)
        except ConfigError:
            if name != "rollout_data_postprocess_path":
                raise
            _check_arity(fn, path, flag, 2)
    except ConfigError as e:
        raise ConfigError(f"{e}; Miles calls it as {signature}") from None
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


def _positional(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool, inspect.Signature]:
    sig = inspect.signature(fn)
    pos = [
        p
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return pos, any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()), sig


_NEW_FORM = "`async def generate(input: GenerateFnInput) -> GenerateFnOutput` (new form)"
_OLD_FORM = "`async def generate(args, sample, sampling_params) -> Sample` (old form)"


def load_generate_function(path: str, flag: str = GENERATE_FLAG) -> Callable[..., Any]:
    """The generate function `path` names, as `async fn(GenerateFnInput) -> GenerateFnOutput`.

    Accepts Miles' two forms, told apart by their signature: one required positional parameter is
    the new form; three (args, sample, sampling_params; an `evaluation` keyword optional) the old
    one, wrapped in an adapter here. A class is instantiated without arguments and its instances
    called. Not async, or any other signature: ConfigError naming the flag.
    """
    obj = load_object(path, flag)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:
            raise ConfigError(
                f"{flag} {path!r}: cannot instantiate the class: {type(e).__name__}: {e}"
            ) from e
    if not callable(obj):
        raise ConfigError(f"{flag} {path!r}: a {type(obj).__name__}, not a function")
    target = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else getattr(obj, "__call__", obj)  # noqa: B004
    try:
        pos, varargs, sig = _positional(target)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {path!r}: has no inspectable signature; write {_NEW_FORM}") from None
    if not inspect.iscoroutinefunction(target):
        raise ConfigError(
            f"{flag} {path!r}: {path.rpartition('.')[2]}{sig} is not async; write {_NEW_FORM} or {_OLD_FORM}"
        )
    required = [p for p in pos if p.default is inspect.Parameter.empty]
    if len(required) == 1 and not varargs:
        return obj
    if len(required) <= 3 and (len(pos) >= 3 or varargs):
        return OldFormGenerate(obj, "evaluation" in sig.parameters)
    raise ConfigError(
        f"{flag} {path!r}: {path.rpartition('.')[2]}{sig} takes {len(required)} required positional argument(s); "
        f"write {_NEW_FORM} or {_OLD_FORM}"
    )


class OldFormGenerate:
    """Miles' old generate form `fn(args, sample, sampling_params) -> Sample`, called as the new one."""

    def __init__(self, fn: Callable[..., Any], takes_evaluation: bool):
        self.fn, self.takes_evaluation = fn, takes_evaluation

    async def __call__(self, input):
        from miles_platform.rollout.base_types import GenerateFnOutput

        kw = {"evaluation": input.evaluation} if self.takes_evaluation else {}
        out = await self.fn(input.args, input.sample, input.sampling_params, **kw)
        return out if isinstance(out, GenerateFnOutput) else GenerateFnOutput(samples=out)


class RolloutFunction:
    """A checked `--rollout-function-path`: `bind(args, data_source)` gives `fn(rollout_id) -> output`
    (RolloutFnTrainOutput or list[list[Sample]], possibly awaitable)."""

    def __init__(self, obj: Any, takes_evaluation: bool):
        self.obj, self.takes_evaluation = obj, takes_evaluation

    def bind(self, args: Any, data_source: Any, evaluation: bool = False) -> Callable[[int], Any]:
        """`evaluation`: the eval rollout (--eval-function-path): RolloutFnEvalInput, or evaluation=True."""
        from miles_platform.rollout.base_types import (
            RolloutFnConstructorInput,
            RolloutFnEvalInput,
            RolloutFnTrainInput,
        )

        if inspect.isclass(self.obj):
            inst = self.obj(RolloutFnConstructorInput(args=args, data_source=data_source))
            make = RolloutFnEvalInput if evaluation else RolloutFnTrainInput
            return lambda rollout_id: inst(make(rollout_id=rollout_id))
        if evaluation and not self.takes_evaluation:
            raise ConfigError(
                f"{EVAL_FLAG}: the function takes no `evaluation` argument; Miles calls it as "
                "generate_rollout(args, rollout_id, data_source, evaluation=True)"
            )
        kw = {"evaluation": evaluation} if self.takes_evaluation else {}
        return lambda rollout_id: self.obj(args, rollout_id, data_source, **kw)


def load_rollout_function(path: str, flag: str = ROLLOUT_FLAG) -> RolloutFunction:
    """Miles' rollout function: `generate_rollout(args, rollout_id, data_source, evaluation=False)`,
    sync or async, or a class built from RolloutFnConstructorInput and called with RolloutFnTrainInput."""
    obj = load_object(path, flag)
    if inspect.isclass(obj):
        if not callable(getattr(obj, "__call__", None)):  # noqa: B004
            raise ConfigError(f"{flag} {path!r}: the class defines no __call__(self, input)")
        _check_arity(obj, path, flag, 1)  # __init__(self, input: RolloutFnConstructorInput)
        _check_arity(obj.__call__, path, flag, 2)  # __call__(self, input: RolloutFnTrainInput)
        return RolloutFunction(obj, False)
    if not callable(obj):
        raise ConfigError(f"{flag} {path!r}: a {type(obj).__name__}, not a function")
    try:
        _check_arity(obj, path, flag, 3)
    except ConfigError:
        raise ConfigError(
            f"{flag} {path!r}: must be `def generate_rollout(args, rollout_id, data_source, evaluation=False)`"
            f" -> RolloutFnTrainOutput | list[list[Sample]]; it is {path.rpartition('.')[2]}{inspect.signature(obj)}"
        ) from None
    return RolloutFunction(obj, "evaluation" in inspect.signature(obj).parameters)


def function_flags_parser(paths: dict[str, str | None]) -> argparse.ArgumentParser | None:
    """Miles' `fn.add_arguments(parser)` hook: the parser of the extra flags that the functions named
    by `paths` ({flag: dotted path}) register, or None when none registers any."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    hooked = False
    for flag, path in paths.items():
        if not path:
            continue
        obj = load_object(path, flag)
        hook = getattr(obj, "add_arguments", None)
        if callable(hook):
            try:
                hook(parser)
            except (argparse.ArgumentError, TypeError, ValueError) as e:
                raise ConfigError(f"{flag} {path!r}: its add_arguments hook failed: {e}") from e
            hooked = True
    return parser if hooked else None
