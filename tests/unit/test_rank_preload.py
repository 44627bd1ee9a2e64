"""The gloo-rank tests' ranks fork from a server that has loaded loop_helpers.SPAWN_PRELOAD, all of
it: a preload the server cannot import is skipped silently, and then every rank imports it itself."""

import sys

from loop_helpers import SPAWN_PRELOAD, spawn_ranks


def _report(rank: int, out: str) -> None:
    with open(out, "w") as f:
        f.write(
            "\n".join(
                m for m in SPAWN_PRELOAD + ["transformers.models.qwen3.modeling_qwen3"] if m in sys.modules
            )
        )


def test_every_preload_is_loaded_in_a_rank_before_it_starts(tmp_path):
    out = tmp_path / "loaded.txt"
    spawn_ranks(_report, (str(out),), nprocs=1)
    loaded = out.read_text().split("\n")
    assert loaded == [*SPAWN_PRELOAD, "transformers.models.qwen3.modeling_qwen3"], loaded
