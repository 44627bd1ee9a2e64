"""`miles-platform weights`: disk-delta publish / apply / list for operators and external fleets.

    miles-platform weights publish --base HF_DIR --target HF_DIR --out PUB_DIR [--encoding xor|overwrite]
    miles-platform weights apply --pub PUB_DIR --checkpoint LOCAL_HF_DIR [--version N]
    miles-platform weights list [--pub PUB_DIR | --storage-root ROOT]

Verification failures raise PublicationError: the dispatcher prints one line and exits 2, and
the local checkpoint is left byte-identical.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from miles_platform.errors import PublicationError
from miles_platform.weights import disk_delta as dd
from miles_platform.weights.checksum import CHECKSUM_ALGOS, checksum


def load_hf_state(hf_dir: str) -> dict:
    """The tensors a publication of this export carries: an HF dir's weights, or a diffusers
    pipeline's DiT (disk_delta.weights_file)."""
    from miles_platform.models.checkpoint import read_safetensors_dir

    return read_safetensors_dir(dd.weights_file(hf_dir).parent)


def _print_stats(st: dd.PublishStats) -> None:
    base = "-" if st.base_version is None else f"v{st.base_version}"
    print(
        f"published v{st.version} ({st.kind}, base {base}): {st.wire_bytes} wire bytes "
        f"of {st.full_bytes} ({st.wire_bytes / max(st.full_bytes, 1):.1%}), density {st.density:.4f}, "
        f"encode {st.encode_seconds:.2f} s, publish {st.seconds:.2f} s -> {st.path}"
    )


def cmd_publish(a) -> int:
    pub = dd.DeltaPublisher(
        a.out,
        encoding=a.encoding,
        checksum=a.checksum,
        keyframe_interval=a.keyframe_interval,
        workers=a.workers,
    )
    latest = dd.read_latest(a.out)
    base, target = load_hf_state(a.base), load_hf_state(a.target)
    check_publishable(base, target, a.base, a.target)  # before anything is written
    if latest is None:
        check_publishable(base, base, a.base, a.base)
        _print_stats(pub.publish(base))
    else:  # the base must be what the dir already holds, or the delta would describe another lineage
        idx = dd.read_index(a.out, latest)
        want = {t["name"]: t["checksum"] for t in idx["tensors"]}
        got = {k: checksum(v, idx["checksum"]) for k, v in base.items()}
        if want != got:
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            raise PublicationError(
                f"--base {a.base} is not the latest publication v{latest} in {a.out} (differs at {bad[0]})"
            )
    _print_stats(pub.publish(target, version=a.version))
    return 0


def check_publishable(base: dict, target: dict, base_dir: str, target_dir: str) -> None:
    """A publication dir is one model's chain of versions: the target keeps the base's tensor names,
    shapes and dtypes, and every value is finite (a NaN version would reach every replica)."""
    for name in sorted(set(base) | set(target)):
        b, t = base.get(name), target.get(name)
        if b is None or t is None:
            where = f"--target {target_dir}" if b is None else f"--base {base_dir}"
            raise PublicationError(
                f"{name}: only in {where}; a publication continues one model's tensors, so publish "
                "a model with other tensors to a new --out"
            )
        if b.shape != t.shape or b.dtype != t.dtype:
            raise PublicationError(
                f"{name}: --target has {t.dtype} {list(t.shape)}, --base {b.dtype} {list(b.shape)}; a "
                "publication continues one model's layout, so publish another layout to a new --out"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise PublicationError(f"{name}: {bad} non-finite value(s) (NaN / inf) in --target {target_dir}")


def cmd_apply(a) -> int:
    v = dd.apply_publication(a.pub, a.checkpoint, version=a.version)
    print(f"{a.checkpoint}: at v{v} (verified)")
    return 0


def _default_publications(storage_root: str) -> list[str]:
    """Every run's publication dir under the storage root that has a LATEST."""
    from miles_platform.store.paths import StoragePaths

    runs = Path(StoragePaths(storage_root).join("runs"))
    return sorted(str(d) for d in runs.glob("*/publications") if (d / "LATEST").is_file())


def cmd_list(a) -> int:
    pubs = [a.pub] if a.pub else _default_publications(a.storage_root)
    if not pubs:
        print(f"no publications under {a.storage_root}/runs/*/publications (pass --pub DIR for another one)",
              file=sys.stderr)  # fmt: skip
        return 1
    for i, pub in enumerate(pubs):
        if i:
            print()
        _list_one(pub)
    return 0


def _list_one(pub: str) -> None:
    rows = dd.list_publications(pub)
    print(f"{pub}: LATEST v{dd.read_latest(pub)}")
    print(
        f"{'version':>8} {'kind':>8} {'base':>5} {'encoding':>9} {'wire_bytes':>12} {'full_bytes':>12} density"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['version']:>8} ERROR {r['error']}")
            continue
        base = "-" if r["base_version"] is None else r["base_version"]
        print(
            f"{r['version']:>8} {r['kind']:>8} {base:>5} {r['encoding']:>9} "
            f"{r['wire_bytes']:>12} {r['full_bytes']:>12} {r['density']:.4f}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform weights", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser(
        "publish",
        allow_abbrev=False,
        help="publish the next version (snapshot of --base first if --out is empty)",
    )
    pp.add_argument("--base", required=True, help="HF dir the previous version was published from")
    pp.add_argument("--target", required=True, help="HF dir of the new version")
    pp.add_argument("--out", required=True, help="publication dir (weight_vNNNNNN/ + LATEST)")
    pp.add_argument("--encoding", default="xor", choices=dd.ENCODINGS)
    pp.add_argument("--checksum", default="xxh3-128", choices=CHECKSUM_ALGOS)
    pp.add_argument("--keyframe-interval", type=int, default=10)
    pp.add_argument("--workers", type=int, default=1, help="threads encoding tensors in parallel")
    pp.add_argument("--version", type=int, default=None, help="version number (default: LATEST + 1)")
    pp.set_defaults(fn=cmd_publish)
    pa = sub.add_parser(
        "apply", allow_abbrev=False, help="verify and patch a local HF checkpoint to a published version"
    )
    pa.add_argument("--pub", required=True)
    pa.add_argument("--checkpoint", required=True)
    pa.add_argument("--version", type=int, default=None, help="default: LATEST")
    pa.set_defaults(fn=cmd_apply)
    pl = sub.add_parser(
        "list", allow_abbrev=False, help="committed versions with kind, base, wire bytes, density"
    )
    pl.add_argument(
        "--pub",
        default=None,
        help="publication dir (weight_vNNNNNN/ + LATEST); default: every run's under --storage-root",
    )
    pl.add_argument("--storage-root", default=os.environ.get("MILES_STORAGE_ROOT", ".miles"),
                    help="storage root whose runs/<run>/publications are listed without --pub (default: .miles)")  # fmt: skip
    pl.set_defaults(fn=cmd_list)
    return p


def cli_main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a)
