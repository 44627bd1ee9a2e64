"""How much of Miles' own launch scripts `miles-platform train` takes: every exact argv Miles records
for its example and model scripts (its launch-script snapshots, `tests/snapshots/launch_scripts/`)
fed to our parser, each flag use counted as

  honoured     a flag of ours, with Miles' meaning
  checked      a model-architecture flag, checked against the HF checkpoint's config.json in preflight
  refused      accepted by the parser and refused by name in validation, with the reason
  owned        owned by another issue not landed yet (#47: megatron parallelism, recompute and
               precision), known to our parser or not: counted apart until it lands
  passthrough  `--sglang-*`, handed to SGLang
  unrecognized none of the above: argparse's "unrecognized arguments". The goal is 0.

and each argv as parsed whole (nothing unrecognized), validating as is (`RunConfig.validate`, no
checkpoint or data needed), and validating once its refused and owned flags are dropped.

The argv after `train.py` / `train_async.py` is taken from each snapshot's commands; a
`${MODEL_ARGS[@]}` is expanded as Miles does (`scripts/models/<model>.py`'s `model_args()`, run
from the Miles tree). `train_async.py` argvs are parsed as `miles-platform train-async` parses them.

Usage: python scripts/miles_argv_census.py [--miles REPO] [--flags] [--argvs] [--json FILE]
  REPO: a Miles checkout or bare git dir (default /work/.mirror/radixark+miles/repo)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SNAPSHOTS = "tests/snapshots/launch_scripts"
ENTRIES = {"train.py": False, "train_async.py": True}  # entry -> fully async
SHELL_OPS = {"&&", "||", "|", ";", "&"}
PASSTHROUGH = ("--sglang-",)
MODEL_ARGS_UTILS = "miles/utils/external_utils/model_args_utils.py"
MODEL_TYPE = re.compile(r"model_args_utils\.py\"?\s+([\w.-]+)")

# Flags another issue owns: counted as `owned` while our parser does not know them yet. Issue #47's
# megatron parallelism, recompute and precision flags landed (2026-12-05): parsed as ours since.
OWNED_47: list[str] = []
OWNED_47_PREFIXES: tuple[str, ...] = ()
OWNED_46: list[str] = []  # issue #46's offload and colocation flags landed (2026-12-05): parsed as ours


def owner(flag: str) -> str | None:
    if flag in OWNED_47 or flag.startswith(OWNED_47_PREFIXES):
        return "#47"
    if flag in OWNED_46:
        return "#46"
    return None


class MilesTree:
    """Read files of a Miles checkout or of a bare git mirror (HEAD)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.bare = not (self.root / SNAPSHOTS).exists()

    def _git(self, *args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={self.root}", *args], check=True, capture_output=True, text=True
        ).stdout

    def files(self, under: str) -> list[str]:
        if self.bare:
            return sorted(self._git("ls-tree", "-r", "--name-only", "HEAD", under).split())
        return sorted(str(p.relative_to(self.root)) for p in (self.root / under).rglob("*") if p.is_file())

    def read(self, path: str) -> str:
        return self._git("show", f"HEAD:{path}") if self.bare else (self.root / path).read_text()


@dataclass
class Argv:
    source: str  # snapshot file and command number
    argv: list[str]
    fully_async: bool


def snapshot_commands(text: str) -> list[list[str]]:
    """A snapshot's commands, as token lists. Two formats: one JSON-quoted token per line (shell
    scripts), or a shell command with a line break before each flag (Python launchers)."""
    blocks, cur = [], []
    for line in text.splitlines():
        if line.startswith("### "):
            blocks.append(cur)
            cur = []
        elif not line.startswith("# returncode"):
            cur.append(line)
    blocks.append(cur)
    out = []
    for lines in blocks:
        lines = [ln for ln in lines if ln.strip()]
        if not lines:
            continue
        if all(ln.startswith('"') and ln.endswith('"') for ln in lines):
            out.append([json.loads(ln) for ln in lines])
            continue
        try:
            out.append(shlex.split(" ".join(lines)))
        except ValueError:  # an unbalanced quote: keep the plain words
            out.append(" ".join(lines).split())
    return out


def model_args(tree: MilesTree, model: str, cache: dict[str, list[str]]) -> list[str]:
    """Miles' `model_args_utils.py <model>`: scripts/models/<model>.py's model_args(), its defaults,
    run from a copy of the two directories it reads (a model may load a sibling's args)."""
    if model not in cache:
        with tempfile.TemporaryDirectory() as tmp:
            for rel in [MODEL_ARGS_UTILS, *tree.files("scripts/models")]:
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / rel).write_text(tree.read(rel))
            spec = importlib.util.spec_from_file_location(
                "_miles_model_args_utils", Path(tmp) / MODEL_ARGS_UTILS
            )
            utils = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(utils)
                cache[model] = utils.load_model_args(model).split()
            finally:
                sys.modules.pop(spec.name, None)
                sys.modules.pop("model_args_utils", None)
    return cache[model]


def launch_argvs(tree: MilesTree) -> list[Argv]:
    """Every argv after a `train.py` / `train_async.py` in Miles' launch-script snapshots."""
    found, cache = [], {}
    for path in tree.files(SNAPSHOTS):
        for i, tokens in enumerate(snapshot_commands(tree.read(path))):
            model = MODEL_TYPE.search(" ".join(tokens))
            for j, tok in enumerate(tokens):
                entry = Path(tok).name
                if entry not in ENTRIES:
                    continue
                argv = []
                for t in tokens[j + 1 :]:
                    if t in SHELL_OPS or t.startswith((">", "2>", "1>")):
                        break
                    if t == "${MODEL_ARGS[@]}" and model:
                        argv += model_args(tree, model.group(1), cache)
                    else:
                        argv.append(t)
                found.append(Argv(f"{path[len(SNAPSHOTS) + 1 :]}#{i}", argv, ENTRIES[entry]))
    return found


def flag_uses(argv: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in argv if t.startswith("--") and len(t) > 2]


@dataclass
class Result:
    uses: Counter = field(default_factory=Counter)  # class -> flag uses
    flags: dict[str, Counter] = field(default_factory=dict)  # class -> flag -> uses
    parsed: int = 0
    valid: int = 0
    valid_dropped: int = 0
    valid_megatron: int = 0  # valid_dropped with --train-backend megatron (Miles' default) when not given
    errors: Counter = field(default_factory=Counter)  # first validation error (dropped argv)

    def add(self, cls: str, flag: str) -> None:
        self.uses[cls] += 1
        self.flags.setdefault(cls, Counter())[flag] += 1


def classify(argvs: list[Argv]) -> Result:
    from miles_platform.config import REFUSED, build_parser

    parser = build_parser()
    known = parser._option_string_actions
    res = Result()
    for a in argvs:
        argv = a.argv
        view = _config_view(_parse(argv))
        dropped: list[str] = []
        unknown = False
        for flag in flag_uses(a.argv):
            action = known.get(flag)
            if flag.startswith(PASSTHROUGH) and action is None:
                res.add("passthrough", flag)
                continue
            if owner(flag):  # another issue's, known to the parser or not
                cls = f"owned by {owner(flag)}"
            elif action is None:
                cls = "unrecognized"
                unknown |= cls == "unrecognized"
            else:
                cls = _verdict(action.dest, view, REFUSED)
            res.add(cls, flag)
            if cls == "refused" or cls.startswith(("owned", "unrecognized")):
                dropped.append(flag)
        strays = _stray_values(argv, known)
        for flag in sorted(set(strays)):
            res.add("unrecognized", f"{flag} (extra values)")
        res.parsed += not unknown and not strays
        res.valid += _validates(argv, a.fully_async) is None
        err = _validates(_drop(argv, set(dropped)), a.fully_async)
        if err is not None and "--train-backend" not in argv:
            err = _validates([*_drop(argv, set(dropped)), "--train-backend", "megatron"], a.fully_async)
        else:
            res.valid_dropped += err is None
        res.valid_megatron += err is None
        if err:
            res.errors[err.split("error: ")[-1][:90]] += 1
    return res


def _config_view(values: dict):
    """The run's flags as validation sees them: the given values over the defaults."""
    from types import SimpleNamespace

    from miles_platform.config import RunConfig
    from miles_platform.config.flags import field_default

    view = {n: field_default(RunConfig, n) for n in RunConfig.__dataclass_fields__}
    view.update({k: v for k, v in values.items() if not k.startswith("compat:")})
    view["compat_flags"] = {k[7:]: v for k, v in values.items() if k.startswith("compat:") and v is not None}
    return SimpleNamespace(**view)


def _verdict(dest: str, cfg, refused: dict) -> str:
    """honoured / checked / same result / refused, for a flag our parser knows, at the run's value."""
    try:
        from miles_platform.config import MODEL_ARGS
        from miles_platform.config.compat import COMPAT, SAME
        from miles_platform.config.model_args import VOCAB_PAD_MULTIPLE
    except ImportError:  # before the model and compat flags existed
        MODEL_ARGS, COMPAT, SAME, VOCAB_PAD_MULTIPLE = (), {}, None, None
    from miles_platform.config import RunConfig
    from miles_platform.config.flags import field_default

    if dest.startswith("compat:"):
        f, v = COMPAT[dest[7:]], cfg.compat_flags.get(dest[7:])
        ok = f.verdict == SAME and (not f.allowed or v in f.allowed) and (f.when is None or f.when(cfg, v))
        return "same result" if ok else "refused"
    value = getattr(cfg, dest, None)
    if dest in refused and value != field_default(RunConfig, dest):
        return "refused"
    if (dest, value) == ("update_weight_transfer_mode", "p2p"):
        return "refused"
    if dest == "make_vocab_size_divisible_by":
        return "checked" if value == VOCAB_PAD_MULTIPLE else "refused"
    return "checked" if dest in MODEL_ARGS else "honoured"


def _parse(argv: list[str]) -> dict:
    """The values our parser takes from `argv`; a flag whose value it rejects (Miles' own recorded
    `--actor-num-nodes None`) is left out, so the rest still count."""
    from miles_platform.config import build_parser

    parser = build_parser()
    for _ in range(8):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                return vars(parser.parse_known_args(argv)[0])
            except SystemExit:
                bad = re.search(r"argument (--[\w-]+)", err.getvalue())
        if bad is None:
            break
        argv = _drop(argv, {bad.group(1)})
    return {}


def _passthrough_nargs() -> str | None:
    """How many values our parser gives a `--sglang-*` flag: all that follow ("*"), or one (before
    the multi-value fix)."""
    from miles_platform.config.cli import _split_passthrough

    return "*" if isinstance(_split_passthrough(["--sglang-x", "1", "2"])[0].get("x"), list) else None


def _stray_values(argv: list[str], known: dict) -> list[str]:
    """The flags given more values than our parser takes (a multi-value flag taken as single-valued):
    argparse calls the values left over "unrecognized arguments"."""
    out, flag, taken, room = [], None, 0, 0
    passthrough_nargs = _passthrough_nargs()
    for t in argv:
        if t.startswith("--"):
            flag, taken = t.split("=", 1)[0], 0
            action = known.get(flag)
            nargs = (
                action.nargs
                if action is not None
                else (passthrough_nargs if flag.startswith(PASSTHROUGH) else "*")
            )
            room = {None: 1, "?": 1, "*": 1 << 30, "+": 1 << 30}.get(nargs, nargs)
            room = 0 if "=" in t or (action is not None and action.nargs == 0) else room
        elif flag is not None:
            taken += 1
            if taken == room + 1:
                out.append(flag)
    return out


def _validates(argv: list[str], train_async: bool = False) -> str | None:
    """None when `argv` parses and validates, else the first error."""
    from miles_platform.config import parse_run_config
    from miles_platform.errors import MilesError

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            if "train_async" in inspect.signature(parse_run_config).parameters:
                parse_run_config(argv, train_async=train_async)
            else:  # before `train-async`: Miles' train_async.py as --fully-async
                parse_run_config(["--fully-async"] * train_async + argv)
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "argparse error"
        except MilesError as e:
            return str(e)
    return None


def _drop(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` without the uses of `flags` and their values (the tokens up to the next flag)."""
    out, skip = [], False
    for t in argv:
        if t.startswith("--"):
            skip = t.split("=", 1)[0] in flags
        if not skip:
            out.append(t)
    return out


ORDER = (
    "honoured",
    "checked",
    "same result",
    "refused",
    "owned by #47",
    "passthrough",
    "unrecognized",
)


def report(argvs: list[Argv], res: Result, show_flags: bool) -> str:
    total = sum(res.uses.values())
    n = len(argvs)
    distinct = len({tuple(a.argv) for a in argvs})
    lines = [f"{n} exact argvs ({distinct} distinct, {sum(a.fully_async for a in argvs)} train_async.py), "
             f"{total} flag uses, {len({f for c in res.flags.values() for f in c})} distinct flags"]  # fmt: skip
    for cls in ORDER:
        uses, distinct = res.uses.get(cls, 0), len(res.flags.get(cls, {}))
        lines.append(f"  {cls:<14} {uses:>6} uses ({100 * uses / max(total, 1):4.1f}%)  {distinct:>4} flags")
    lines.append(f"argvs parsed whole (nothing unrecognized): {res.parsed}/{n}")
    lines.append(f"argvs validating as recorded:              {res.valid}/{n}")
    lines.append(f"argvs validating without refused/owned:    {res.valid_dropped}/{n}")
    lines.append(
        f"  the same, on Miles' default backend:      {res.valid_megatron}/{n} (--train-backend megatron "
        "added where the argv gives none: Miles' default is megatron, ours fsdp)"
    )
    for err, k in res.errors.most_common():
        lines.append(f"    {k:>3} x {err}")
    for cls in ORDER if show_flags else ("unrecognized",):
        if res.flags.get(cls):
            lines.append(f"{cls} flags (uses):")
            lines += [f"  {f} {k}" for f, k in sorted(res.flags[cls].items(), key=lambda x: (-x[1], x[0]))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--miles", default="/work/.mirror/radixark+miles/repo", help="Miles checkout or bare git dir"
    )
    p.add_argument(
        "--flags", action="store_true", help="list the flags of every class, not just unrecognized"
    )
    p.add_argument("--argvs", action="store_true", help="print each argv's source and its unrecognized flags")
    p.add_argument("--json", help="also write the counts as JSON here")
    args = p.parse_args(argv)
    argvs = launch_argvs(MilesTree(args.miles))
    res = classify(argvs)
    if args.argvs:
        for a in argvs:
            print(a.source, " ".join(shlex.quote(t) for t in a.argv))
    print(report(argvs, res, args.flags))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"argvs": len(argvs), "uses": dict(res.uses), "flags": res.flags, "parsed": res.parsed,
             "valid": res.valid, "valid_dropped": res.valid_dropped,
             "valid_megatron": res.valid_megatron}, indent=1, sort_keys=True))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
