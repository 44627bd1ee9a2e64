"""A LoRA run end to end on Ray: real trainer actor (PEFT), embedded engines over HTTP with the
adapter-only sync, --ci-test's log-prob agreement, --check-lora-weight-equal after every sync,
versions that point at adapter + base, and a resume that continues the adapter."""

import json
import os

import pytest
from loop_helpers import small_run_config
from safetensors import safe_open

from miles_platform.loop import train
from miles_platform.models.checkpoint import content_hash
from miles_platform.store.catalog import Catalog
from miles_platform.store.paths import StoragePaths


def _cfg(ckpt, tmp_path, **kw):
    return small_run_config(ckpt, tmp_path, **{"ci_test": True, "save_interval": 1, "lora_rank": 4,
                                               "lora_alpha": 8, "check_lora_weight_equal": True, **kw})  # fmt: skip


# the disk transport (SGLang's /load_lora_adapter over HTTP) runs in tests/e2e/test_lora_multi_run.py,
# against a shared engine with --ci-test and every rollout re-scored against PEFT
@pytest.mark.parametrize("mode", ["tensor"])
def test_lora_run_syncs_adapters_only_and_resumes(tiny_hf_checkpoint, tmp_path, mode):
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, eval_interval=2,
               eval_prompt_data=["heldout", str(tmp_path / "train.jsonl")], save_hf=str(tmp_path / "hf" / "iter_{rollout_id}"))  # fmt: skip
    res = train(cfg)
    assert res.final_version == 2 and len(res.versions) == 2
    # --ci-test: trainer (PEFT) and engine (unmerged adapter) agree on the rollout log-probs
    assert res.ci_checks["step0_ppo_kl"] < 1e-9
    assert res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-3
    assert "eval/heldout/pass@1" in res.metrics[1]
    paths = StoragePaths(cfg.storage_root)
    for v in res.versions:
        assert v["hf_path"] is None and v["base_checkpoint"] == tiny_hf_checkpoint
        ad = v["adapter_path"]
        with safe_open(os.path.join(ad, "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
        base = json.load(open(os.path.join(ad, "base_checkpoint.json")))
        assert base["content_hash"] == content_hash(tiny_hf_checkpoint) == v["base_data_version"]
    assert not os.path.exists(paths.hf_export("t", 1)), "a LoRA version is never a merged copy"
    assert os.path.exists(tmp_path / "hf" / "iter_1" / "model.safetensors")  # --save-hf: merged on demand
    m = res.metrics[0]
    wire, full = m["perf/update_weights_wire_bytes"], m["perf/update_weights_full_bytes"]
    assert 0 < wire < 0.5 * full and m["perf/update_weights_density"] == pytest.approx(wire / full)
    _, pv = Catalog(paths).query("select version, adapter_path, hf_path from policy_versions order by 1")
    assert [(r[0], r[2]) for r in pv] == [(1, None), (2, None)] and all(r[1] for r in pv)
    _, edges = Catalog(paths).query("select distinct parent_kind from lineage where relation = 'adapter'")
    assert edges == [("lora_adapter",)]
    # the same command with one more rollout resumes from the adapter checkpoint (the engines get it
    # again first, checked by --check-lora-weight-equal) and continues the version numbers
    res2 = train(_cfg(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, num_rollout=3))
    assert res2.start_rollout_id == 2 and res2.final_version == 3
