import json
import os

import dagster as dg
import pytest

from assets.datasets import eval_dataset, prompt_dataset, prompt_dataset_checks
from miles_platform.data.dataset import content_hash, read_normalized_dataset
from miles_platform.store.paths import StoragePaths
from resources.storage import StorageRootResource

ROWS = [{"question": f"{i}+{i}=", "answer": str(2 * i), "metadata": {"i": i}} for i in range(6)]


def resources(root):
    return {"storage": StorageRootResource(root=str(root))}


def write_jsonl(path, rows, extra=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + extra)
    return str(path)


def run_config(asset_name, **cfg):
    from assets.datasets import DatasetConfig

    return dg.RunConfig(ops={asset_name: DatasetConfig(**cfg)})


def files_under(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_prompt_dataset_materializes_with_metadata_version_and_passing_checks(tmp_path):
    src = write_jsonl(tmp_path / "src.jsonl", ROWS)
    root = tmp_path / "store"
    result = dg.materialize(
        [prompt_dataset, prompt_dataset_checks],
        resources=resources(root),
        run_config=run_config("prompt_dataset", path=src, input_key="question", label_key="answer"),
    )
    assert result.success
    path = StoragePaths(str(root)).dataset("prompt_dataset")
    records = read_normalized_dataset(path)
    assert [r.label for r in records] == [str(2 * i) for i in range(6)]

    (mat,) = result.asset_materializations_for_node("prompt_dataset")
    md = mat.metadata
    assert md["rows"].value == 6 and md["path"].value == path and md["bytes"].value == os.path.getsize(path)
    assert md["content_hash"].value == content_hash(records)
    assert "| 0+0= | 0 |" in md["preview"].value
    assert mat.tags["dagster/data_version"] == content_hash(records)

    checks = result.get_asset_check_evaluations()
    assert {c.check_name: c.passed for c in checks} == {
        "schema": True,
        "unique_ids": True,
        "non_empty_prompt": True,
        "label_present": True,
    }
    assert all(c.blocking for c in checks)


def test_same_data_same_version_changed_data_new_version(tmp_path):
    root = tmp_path / "store"
    versions = []
    for rows in (ROWS, ROWS, ROWS[:3]):
        src = write_jsonl(tmp_path / "src.jsonl", rows)
        cfg = run_config("eval_dataset", path=src, input_key="question", label_key="answer")
        result = dg.materialize([eval_dataset], resources=resources(root), run_config=cfg)
        (mat,) = result.asset_materializations_for_node("eval_dataset")
        versions.append(mat.tags["dagster/data_version"])
    assert versions[0] == versions[1] != versions[2]


@pytest.mark.parametrize(
    "rows,extra,cfg,message",
    [
        (ROWS, b'{"question": "x"\n', {"input_key": "question"}, "src.jsonl:7: malformed JSON"),
        (ROWS, b"", {"input_key": "question", "label_key": "label"}, "missing key 'label'"),
        ([], b"", {"input_key": "question"}, "dataset is empty"),
    ],
)
def test_bad_data_materializes_nothing(tmp_path, rows, extra, cfg, message):
    src = write_jsonl(tmp_path / "src.jsonl", rows, extra)
    root = tmp_path / "store"
    result = dg.materialize(
        [prompt_dataset, prompt_dataset_checks],
        resources=resources(root),
        run_config=run_config("prompt_dataset", path=src, **cfg),
        raise_on_error=False,
    )
    assert not result.success
    assert result.asset_materializations_for_node("prompt_dataset") == []
    failure = result.failure_data_for_node("prompt_dataset")
    assert message in failure.error.cause.message or message in failure.error.message
    assert files_under(root) == []  # no partial file under the storage root


def test_blocking_checks_catch_a_bad_file(tmp_path):
    """The checks read what is on disk: a tampered file (duplicate ids, no label) fails them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assets.datasets import _check_results

    root = tmp_path / "store"
    path = StoragePaths(str(root)).dataset("prompt_dataset")
    os.makedirs(os.path.dirname(path))
    table = pa.table({"id": ["a", "a"], "prompt": ["p", " "], "label": ["1", None], "metadata": ["{}", "{}"]})
    pq.write_table(table.replace_schema_metadata({b"miles.label_key": b"answer"}), path)
    got = {c.check_name: c.passed for c in _check_results(prompt_dataset.key, path)}
    assert got == {"schema": True, "unique_ids": False, "non_empty_prompt": False, "label_present": False}


def test_default_is_the_builtin_task(tmp_path):
    pytest.importorskip("miles_platform.data.tasks")
    root = tmp_path / "store"
    result = dg.materialize([prompt_dataset, eval_dataset], resources=resources(root))
    assert result.success
    paths = StoragePaths(str(root))
    train, evals = (read_normalized_dataset(paths.dataset(n)) for n in ("prompt_dataset", "eval_dataset"))
    assert train and evals and all(r.label is not None for r in train + evals)
    assert not {r.prompt for r in train} & {r.prompt for r in evals}
    assert files_under(root) == sorted([paths.dataset("prompt_dataset"), paths.dataset("eval_dataset")])


def test_schema_check_fails_on_foreign_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assets.datasets import _check_results

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["p"]}), path)
    got = {c.check_name: c.passed for c in _check_results(prompt_dataset.key, str(path))}
    assert got == {"schema": False, "unique_ids": False, "non_empty_prompt": False, "label_present": False}
