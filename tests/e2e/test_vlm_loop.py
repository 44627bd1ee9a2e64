"""A vision-language run on Ray (docs/vlm.md): image prompts (Parquet bytes, the engine's image_data,
the fsdp trainer's image step) with --ci-test on; shards name each image by hash.

`make test` runs two rollouts of the counting task from a fresh tiny Qwen3-VL: every part of the
image path through `train`. That it learns (the counting task's SFT base reads the image but counts
4 squares as 3; GRPO lifts held-out greedy accuracy: the cheapest form of `make demo-vlm`, its SFT
base, 8 prompts per rollout, the demo's 16) is `make test-extended`: the base (~30 CPU-s) and 30
rollouts (~30 s) were the largest single cost of `make test` after the crash matrix."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from background_bases import base_dir
from loop_helpers import UNTRAINED_ENTROPY_MAX

from miles_platform.config import RunConfig
from miles_platform.data.images import image_hash
from miles_platform.loop import train, validate_before_start
from miles_platform.recipes import DEMO_VLM
from miles_platform.store.paths import StoragePaths
from miles_platform.store.shards import shard_path
from miles_platform.store.tables import read_rows
from miles_platform.training.vlm_base import greedy_count_accuracy
from ops.version_events import CatalogVersions, shard_summary

# GRPO seeds 1-3 from this base (8 prompts per rollout; sampler seeded by absolute position since
# 2026-12-05): 20 rollouts 76.9 / 78.8 / 98.1% held out (one of three clears +15 points), 30
# rollouts 100 / 100 / 84.6%
ROLLOUTS = 30


def test_a_vlm_run_trains_on_image_prompts_and_names_each_image(tmp_path):
    from miles_platform.data.image_tasks import count_corpus, write_count_datasets
    from miles_platform.models.vlm import save_tiny_vlm_checkpoint

    task = write_count_datasets(tmp_path / "task", seed=0, eval_size=16, train_size=32)
    ckpt = save_tiny_vlm_checkpoint(tmp_path / "init", corpus=count_corpus(), image_size=64)
    cfg = RunConfig(
        **{**DEMO_VLM, "save_interval": None, "rollout_batch_size": 4, "ci_entropy_max": UNTRAINED_ENTROPY_MAX},
        hf_checkpoint=ckpt, prompt_data=task["train"], num_rollout=2,
        seed=1, rollout_seed=1, storage_root=str(tmp_path / "root"), num_cpus_per_actor=0.5,
    ).validate()  # fmt: skip
    validate_before_start(cfg)
    res = train(cfg)
    assert res.final_version == 2
    assert res.ci_checks["step0_ppo_kl"] < 1e-9 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-3
    _check_the_records(cfg, task, 4 * DEMO_VLM["n_samples_per_prompt"])


def _check_the_records(cfg: RunConfig, task: dict, samples: int) -> None:
    paths = StoragePaths(cfg.storage_root)
    # read back from the catalog, its versions are left to their own evals (the text eval_dataset does not apply)
    stored = CatalogVersions.read(paths, cfg.run_name, read_rows(paths, "policy_versions", cfg.run_name))
    assert stored.extra["task"] == "vlm" and stored.extra["evaluated_in_loop"] == "true"
    rows = pq.read_table(shard_path(paths, cfg.run_name, 0)).to_pylist()
    want = {image_hash(r["images"][0]) for r in pq.read_table(task["train"]).to_pylist()}
    assert len(rows) == samples and all(
        len(r["image_hashes"]) == 1 and r["image_hashes"][0] in want for r in rows
    )
    # the rollout_shards asset page names each preview sample's image and shows it (from the run's prompt data)
    summary = shard_summary(shard_path(paths, cfg.run_name, 0), cfg.run_name)
    preview, images = summary["preview"].value, summary["images"].value
    assert "| image |" in preview.splitlines()[0] and rows[0]["image_hashes"][0][:12] in preview
    assert images.count("data:image/png;base64,") == 1


@pytest.mark.extended  # the base's ~30 CPU-s and 30 rollouts; the image path itself is the test above
def test_grpo_from_a_base_that_counts_4_as_3_lifts_heldout_accuracy(tmp_path, tmp_path_factory):
    # the base trains in the background under pytest-xdist (tests/background_bases.py), else here
    d, task = base_dir("vlm", tmp_path_factory)
    base = greedy_count_accuracy(str(d / "base"), task["eval"])
    # reads the image (every other count right) and is systematically wrong on 4 squares
    assert all(base["per_count"][k] >= 0.9 for k in (1, 2, 3)), base
    assert base["per_count"][4] <= 0.25 and base["answers"][4].get("3", 0) >= 12, base

    cfg = RunConfig(
        **{**DEMO_VLM, "save_interval": None, "rollout_batch_size": 8},
        hf_checkpoint=str(d / "base"), prompt_data=task["train"], num_rollout=ROLLOUTS,
        seed=1, rollout_seed=1, storage_root=str(tmp_path / "root"), num_cpus_per_actor=0.5,
    ).validate()  # fmt: skip
    validate_before_start(cfg)
    res = train(cfg)
    assert res.ci_checks["step0_ppo_kl"] < 1e-9 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-3
    final = greedy_count_accuracy(res.final_hf_path, task["eval"])
    assert final["acc"] >= base["acc"] + 0.15, (base, final)
    _check_the_records(cfg, task, 64)
