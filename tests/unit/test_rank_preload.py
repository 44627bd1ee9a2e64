"""The gloo-rank tests' ranks (and a conversion's) fork from a server that has loaded
loop_helpers.SPAWN_PRELOAD, all of it: the server skips a preload it cannot import without a word,
and then every rank imports it itself (a module in tests/ was never loaded in `make test`)."""

import sys

from loop_helpers import SPAWN_PRELOAD, spawn_ranks


def _report(rank: int, out: str) -> None:
    with open(out, "w") as f:
        f.write("\n".join(m for m in SPAWN_PRELOAD if m in sys.modules))


def test_every_preload_is_loaded_in_a_rank_before_it_starts(tmp_path):
    out = tmp_path / "loaded.txt"
    spawn_ranks(_report, (str(out),), nprocs=1)
    assert out.read_text().split("\n") == SPAWN_PRELOAD
