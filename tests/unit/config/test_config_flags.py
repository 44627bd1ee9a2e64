"""Flags mean what they say: contradictions are refused up front, and no RunConfig field is dead."""

import ast
import dataclasses
import os
import pathlib

import pytest
from loop_helpers import small_run_kwargs

import miles_platform
from miles_platform.config import REFUSED, ConfigError, RunConfig, parse_run_config
from miles_platform.loop import train

PKG = pathlib.Path(miles_platform.__file__).parent
FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}

# RunConfig fields nothing outside the config package reads because they are another field under a second
# name that Miles documents too: field -> the field it stands for, and why. None today; the
# spelling-only aliases (--update-weight-delta-*) are config.ALIASES, folded in before a field exists.
DOCUMENTED_ALIASES: dict[str, str] = {}


def _model_args_checked() -> set[str]:
    """The model flags (config/model_args.py) are read as a table: preflight checks each one given
    against the checkpoint's view of it (models/architecture.py), which must have an entry for each;
    --make-vocab-size-divisible-by is honoured at 128 (the padding the megatron bridge uses) and
    refused otherwise in validate()."""
    from miles_platform.config import MODEL_ARGS
    from miles_platform.models.architecture import megatron_model_args

    view = megatron_model_args({"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 2})
    return {n for n in MODEL_ARGS if n in view} | {"make_vocab_size_divisible_by"}


def test_debug_train_only_with_nothing_to_load_is_refused_up_front(tiny_hf_checkpoint, tmp_path):
    """No engines and nothing to replay: refused at validation, not a crash on None mid-run."""
    cfg = RunConfig(**small_run_kwargs(tiny_hf_checkpoint, tmp_path, debug_train_only=True))
    with pytest.raises(ConfigError, match="--debug-train-only needs --load-debug-rollout-data"):
        train(cfg)
    assert not os.path.exists(cfg.storage_root)
    with pytest.raises(ConfigError, match="--debug-train-only needs --load-debug-rollout-data"):
        parse_run_config(["--rollout-batch-size", "2", "--debug-train-only"])


@pytest.mark.parametrize("template", ["/tmp/rollouts.parquet", "/tmp/r_{rank}_{rollout_id}.parquet"])
def test_save_debug_rollout_data_template_must_name_each_rollout(template):
    """A template without {rollout_id} would overwrite one file every rollout; a stray field would crash."""
    with pytest.raises(ConfigError, match="--save-debug-rollout-data"):
        parse_run_config(["--rollout-batch-size", "2", "--save-debug-rollout-data", template])
    for ok in ("/tmp/r_{rollout_id}.parquet", "/tmp/r_{rollout_id:06d}.parquet"):
        assert parse_run_config(["--rollout-batch-size", "2", "--save-debug-rollout-data", ok])


def _fields_read_outside_config() -> set[str]:
    """Field names used as `.name` or getattr(x, "name") anywhere in miles_platform/ except the config
    package, plus the fields read by RunConfig accessors (eval_settings ...) that code outside calls."""
    config_dir, read = PKG / "config", set()
    for path in PKG.rglob("*.py"):
        if config_dir in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None)
                in ("getattr", "hasattr", "load_hook")  # load_hook(cfg, "field")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                read.add(node.args[1].value)
    # RunConfig's methods live on its capability classes (config/*.py); validate() and the _check_*
    # methods read fields to check them, which is not honouring them
    methods = [
        fn
        for path in config_dir.glob("*.py")
        for cls in ast.parse(path.read_text()).body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name != "validate" and not fn.name.startswith("_check")
    ]
    grew = True
    while grew:  # an accessor another accessor calls counts as called
        before = len(read)
        for fn in methods:
            if fn.name in read:
                read |= {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"}  # fmt: skip
        grew = len(read) > before
    return read & set(FIELDS)


def test_every_run_config_field_is_honoured_or_refused():
    read = _fields_read_outside_config() | _model_args_checked()
    dead = sorted(set(FIELDS) - read - set(REFUSED) - set(DOCUMENTED_ALIASES))
    assert not dead, (
        f"RunConfig fields read by nothing outside miles_platform/config/: {dead}. Wire each one, refuse it in "
        "config.REFUSED (with the reason) or remove it."
    )
    assert set(DOCUMENTED_ALIASES) <= set(FIELDS) and set(DOCUMENTED_ALIASES.values()) <= set(FIELDS)


def _non_default(name: str):
    f = FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    return "some.module.fn"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_flag_set_is_an_error_naming_it(name):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=flag):
        RunConfig(rollout_batch_size=2, **{name: _non_default(name)}).validate()
    RunConfig(rollout_batch_size=2).validate()  # at its default it is fine


def test_train_async_is_the_one_step_overlap_and_refuses_what_cannot_overlap(tiny_hf_checkpoint, tmp_path):
    """`miles-platform train-async` is Miles' train_async.py: the one-step overlap loop unless --fully-async;
    what it cannot run is refused before Ray, naming why (Miles' colocate assert, async PPO correction)."""
    argv = ["--hf-checkpoint", tiny_hf_checkpoint, "--prompt-data", "p.jsonl", "--rollout-batch-size", "2"]
    cfg = parse_run_config(argv, train_async=True)
    assert cfg.train_async and not cfg.fully_async
    assert parse_run_config([*argv, "--fully-async"], train_async=True).fully_async
    assert not parse_run_config(argv).train_async
    for extra, match in (
        (["--colocate"], "Miles asserts `not args.colocate`"),
        (["--data-source-path", "m.Source"], "a resume would skip them"),
        (["--advantage-estimator", "ppo"], "--use-rollout-logprobs .* or --use-tis"),
        (["--max-weight-staleness", "1"], "add --fully-async"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_run_config([*argv, *extra], train_async=True)
    assert parse_run_config(
        [*argv, "--advantage-estimator", "ppo", "--use-tis"], train_async=True
    ).train_async
    with pytest.raises(ConfigError, match="--fully-async with --advantage-estimator ppo"):
        parse_run_config([*argv, "--fully-async", "--advantage-estimator", "ppo"])
    with pytest.raises(ConfigError, match="nothing to overlap"):
        RunConfig(
            **small_run_kwargs(tiny_hf_checkpoint, tmp_path, train_async=True, debug_rollout_only=True)
        ).validate()
