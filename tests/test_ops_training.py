"""The `rl_training` job run in process: where it writes."""

import dagster as dg
import pytest
from loop_helpers import small_run_kwargs

from miles_platform.store.paths import StoragePaths
from miles_platform.store.tables import read_rows
from ops.training import rl_training
from resources.storage import StorageRootResource


def _execute(kwargs: dict, root, instance=None, raise_on_error=True):
    return rl_training.execute_in_process(
        run_config={"ops": {"rl_training_op": {"config": kwargs}}},
        instance=instance or dg.DagsterInstance.ephemeral(),
        resources={"storage": StorageRootResource(root=str(root))},
        raise_on_error=raise_on_error,
    )


def _job_kwargs(ckpt: str, tmp_path, **overrides) -> dict:
    kw = small_run_kwargs(ckpt, tmp_path, **overrides)
    kw.pop("storage_root")  # the resource's, not the run config's
    return kw


@pytest.fixture(scope="module")
def short_run(tiny_hf_checkpoint, tmp_path_factory):
    """Two rollouts of the small run, launched from a working dir that is not the storage root."""
    tmp = tmp_path_factory.mktemp("job")
    root, elsewhere = tmp / "root", tmp / "elsewhere"
    elsewhere.mkdir()
    instance = dg.DagsterInstance.ephemeral()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)
        result = _execute(_job_kwargs(tiny_hf_checkpoint, tmp), root, instance)
    return result, instance, root, elsewhere


def test_job_writes_under_the_storage_resource_root_from_any_working_dir(short_run):
    result, _, root, elsewhere = short_run
    assert result.success
    paths = StoragePaths(str(root))
    versions = read_rows(paths, "policy_versions", "t")
    assert [r["version"] for r in versions] == [1, 2]
    assert all(r["hf_path"].startswith(str(root)) for r in versions)
    assert {r["rollout_id"] for r in read_rows(paths, "metrics", "t")} == {0, 1}
    assert list(elsewhere.iterdir()) == []  # nothing under the working dir's .miles
    assert result.output_for_node("rl_training_op")["final_hf_path"].startswith(str(root))
