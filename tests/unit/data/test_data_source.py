import json
import os

import pytest

from miles_platform.data.dataset import PromptRecord
from miles_platform.data.source import RolloutDataSource

RECORDS = [PromptRecord(id=str(i), prompt=f"p{i}") for i in range(7)]


def ids(batch):
    return [r.id for r in batch]


def test_in_order_walks_epochs():
    src = RolloutDataSource(RECORDS)
    assert ids(src.get_samples(5)) == ["0", "1", "2", "3", "4"]
    assert ids(src.get_samples(5)) == ["5", "6", "0", "1", "2"]
    assert src.state_dict() == {"epoch": 1, "offset": 3}
    assert len(src.get_samples(16)) == 16  # more than one epoch in one call


def test_shuffle_is_a_seeded_permutation_per_epoch():
    a = RolloutDataSource(RECORDS, rollout_shuffle=True, rollout_seed=3)
    e0, e1 = ids(a.get_samples(7)), ids(a.get_samples(7))
    assert sorted(e0) == sorted(e1) == sorted(ids(RECORDS))
    assert e0 != e1  # a fresh order each epoch
    b = RolloutDataSource(RECORDS, rollout_shuffle=True, rollout_seed=3)
    assert ids(b.get_samples(14)) == e0 + e1
    c = RolloutDataSource(RECORDS, rollout_shuffle=True, rollout_seed=4)
    assert ids(c.get_samples(7)) != e0


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_resume_after_k_batches_matches_uninterrupted(shuffle, k):
    full = RolloutDataSource(RECORDS, rollout_shuffle=shuffle, rollout_seed=11)
    expected = [ids(full.get_samples(3)) for _ in range(8)]

    first = RolloutDataSource(RECORDS, rollout_shuffle=shuffle, rollout_seed=11)
    for _ in range(k):
        first.get_samples(3)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as JSON

    resumed = RolloutDataSource(RECORDS, rollout_shuffle=shuffle, rollout_seed=11)
    resumed.load_state_dict(state)
    assert [ids(resumed.get_samples(3)) for _ in range(8 - k)] == expected[k:]


def test_bad_state_and_empty_records():
    with pytest.raises(ValueError, match="offset 99"):
        RolloutDataSource(RECORDS).load_state_dict({"epoch": 0, "offset": 99})
    with pytest.raises(ValueError, match="at least one"):
        RolloutDataSource([])


def test_unfinished_prompts_are_checkpointed_and_served_first():
    from miles_platform.data.dataset import PromptRecord
    from miles_platform.data.source import RolloutDataSource

    recs = [PromptRecord(id=str(i), prompt=f"{i}+{i}=", label=str(2 * i)) for i in range(5)]
    ds = RolloutDataSource(recs)
    taken = ds.get_samples(3)
    state = ds.state_dict(unfinished=taken[1:])  # prompts 1 and 2 were in flight at the checkpoint
    assert state["offset"] == 3 and [r["id"] for r in state["pending"]] == ["1", "2"]
    resumed = RolloutDataSource(recs)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [r.id for r in resumed.get_samples(4)] == ["1", "2", "3", "4"]
    assert resumed.state_dict() == {"epoch": 0, "offset": 5}  # old format when nothing is pending
    resumed.put_back([recs[0]])  # --async-unused-samples-handler retry
    assert [r.id for r in resumed.get_samples(2)] == ["0", "0"]  # then the next epoch starts


def test_a_data_source_class_is_adapted_with_miles_contract(tmp_path):
    """--data-source-path: cls(args); its groups become prompts, unfinished prompts go back through
    add_samples after load(rollout_id), a checkpoint calls save(rollout_id); a broken class is refused."""
    import hook_fns
    from loop_helpers import write_prompts

    from miles_platform.config import ConfigError, RunConfig
    from miles_platform.data.custom_source import CustomDataSource

    root = str(tmp_path / "root")
    kw = dict(rollout_batch_size=2, n_samples_per_prompt=2, prompt_data=write_prompts(tmp_path), storage_root=root,
              data_source_path="hook_fns.JsonlDataSource")  # fmt: skip
    src = CustomDataSource(RunConfig(**kw).validate())
    assert isinstance(src.inner, hook_fns.JsonlDataSource) and len(src) == len(src.inner.dataset)
    first = src.get_samples(2)
    assert [r.prompt for r in first] == [row["prompt"] for row in src.inner.dataset[:2]]
    src.saving_rollout_id = 0
    state = src.state_dict(first[1:])  # the second prompt was taken and not trained
    again = CustomDataSource(RunConfig(**kw).validate())
    again.load_state_dict(state)
    assert again.inner.offset == 2 and again.get_samples(1)[0].prompt == first[1].prompt  # from the buffer
    assert len(again.inner.buffer) == 0
    logged = [json.loads(x) for x in open(os.path.join(root, "hooks.jsonl"))]
    assert [(x["hook"], x["rollout_id"]) for x in logged] == [
        ("data_source_save", 0),
        ("data_source_load", 0),
    ]
    for bad, needle in (
        ("hook_fns.two_args", "must be a class with get_samples"),
        ("hook_fns.nope", "no attribute"),
    ):
        with pytest.raises(ConfigError, match=needle):
            CustomDataSource(RunConfig(**{**kw, "data_source_path": bad}))


def test_disable_rollout_global_dataset_reads_no_prompts(tmp_path):
    from loop_helpers import write_prompts

    from miles_platform.config import ConfigError, parse_run_config
    from miles_platform.loop import data_source

    base = ["--rollout-batch-size", "2", "--disable-rollout-global-dataset"]
    with pytest.raises(ConfigError, match="needs --rollout-function-path and --num-rollout"):
        parse_run_config(base)
    fn = ["--rollout-function-path", "generate_fns.generate_rollout", "--num-rollout", "3"]
    with pytest.raises(ConfigError, match="--prompt-data would not be read"):
        parse_run_config([*base, *fn, "--prompt-data", write_prompts(tmp_path)])
    with pytest.raises(ConfigError, match="replays rollouts and reads no prompts"):
        parse_run_config(
            [
                "--rollout-batch-size",
                "2",
                "--data-source-path",
                "x.Y",
                "--load-debug-rollout-data",
                "/r_{rollout_id}",
            ]
        )
    cfg = parse_run_config([*base, *fn])
    assert (
        not cfg.uses_global_dataset and data_source(cfg, None) is None
    )  # the rollout function brings its data
