"""Gloo ranks (the tests', a conversion's) fork from a server that has loaded
cluster/forkserver.RANK_PRELOAD, all of it: the server skips a preload it cannot import without a
word, and then every rank imports it itself (a module in tests/ was never loaded in `make test`)."""

import sys

from loop_helpers import spawn_ranks

from miles_platform.cluster.forkserver import RANK_PRELOAD


def _report(rank: int, out: str) -> None:
    with open(out, "w") as f:
        f.write("\n".join(m for m in RANK_PRELOAD if m in sys.modules))


def test_every_preload_is_loaded_in_a_rank_before_it_starts(tmp_path):
    out = tmp_path / "loaded.txt"
    spawn_ranks(_report, (str(out),), nprocs=1)
    assert out.read_text().split("\n") == RANK_PRELOAD
