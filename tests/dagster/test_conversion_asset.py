"""Dagster: converted_checkpoint materializes torch_dist from base_checkpoint; the round-trip check passes.

This is also the CLI's TP=1 round-trip test: the asset runs `python -m miles_platform.weights.conversion
hf-to-torch-dist` and the check `torch-dist-to-hf`, comparing every tensor bit for bit.
"""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import dagster as dg
from loop_helpers import warm_python

from assets.conversion import converted_checkpoint, round_trip_bit_exact
from miles_platform.store.paths import StoragePaths


def test_converted_checkpoint_and_round_trip_check(tiny_hf_checkpoint, tmp_path, monkeypatch):
    warm_python()  # this process's fork server is up (as in a run worker that trained)
    launched = []
    real_run = subprocess.run

    def run(cmd, *a, **kw):
        launched.append(cmd)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "run", run)
    paths = StoragePaths(str(tmp_path / "root"))
    instance = dg.DagsterInstance.ephemeral()
    # the base checkpoint's materialization points at the HF dir (not the storage convention)
    instance.report_runless_asset_event(
        dg.AssetMaterialization(
            "base_checkpoint", metadata={"path": dg.MetadataValue.path(tiny_hf_checkpoint)}
        )
    )
    result = dg.materialize(
        [converted_checkpoint, round_trip_bit_exact],
        resources={"storage": SimpleNamespace(paths=paths)},
        instance=instance,
    )
    assert result.success
    mat = result.asset_materializations_for_node("converted_checkpoint")[0]
    md = mat.metadata
    assert md["path"].value == paths.model("base_torch_dist")
    assert md["tensor_count"].value == 10 and md["bytes"].value > 0
    assert mat.tags["dagster/data_version"] == md["content_hash"].value
    saved = Path(paths.model("base_torch_dist"))
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (saved / "release" / "metadata.json").exists() and (saved / "release" / ".metadata").exists()
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    (check,) = result.get_asset_check_evaluations()
    assert check.passed, check.metadata
    assert check.metadata["tensors_compared"].value == 24  # tied: no lm_head.weight in the file
    # both conversions ran as forks of the warm server (torch & co. imported: ~0.6 s, not ~6 s each)
    from miles_platform.cluster.forkserver import FORK_EXEC

    assert [c[1:3] for c in launched] == [["-S", FORK_EXEC]] * 2, launched
    assert [c[c.index("miles_platform.weights.conversion") + 1] for c in launched] == [
        "hf-to-torch-dist", "torch-dist-to-hf",
    ]  # fmt: skip
