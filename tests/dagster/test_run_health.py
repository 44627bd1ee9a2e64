"""Run-health asset checks, executed by Dagster on real stores: green on a healthy run, red with
the run and version named on a store broken on purpose (one breakage per check)."""

import json
import os
import shutil
from pathlib import Path

import dagster as dg
import pytest
from store_builders import build_run, save_tiny_pipeline

import definitions
from miles_platform.store.paths import StoragePaths
from miles_platform.store.run_health import CHECKS, hf_export_sanity
from resources.storage import StorageRootResource


def run_checks(root) -> dict[str, dg.AssetCheckEvaluation]:
    job = definitions.defs.get_repository_def().get_job("check_run_health")
    res = job.execute_in_process(
        instance=dg.DagsterInstance.ephemeral(), resources={"storage": StorageRootResource(root=str(root))}
    )
    assert res.success
    return {e.check_name: e for e in res.get_asset_check_evaluations()}


def prompt_file(path: Path, n: int) -> str:
    """The builder's prompts `i+i=` for i < n, as --prompt-data."""
    path.write_text("".join(json.dumps({"input": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture
def healthy(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    data = prompt_file(tmp_path / "train.jsonl", 4)  # each rollout is one epoch of the 4 prompts
    build_run(paths, "ok", tiny_hf_checkpoint, 3, fully_async=True, max_weight_staleness=1, staleness=1,
              prompt_data=data, rollout_batch_size=4, n_samples_per_prompt=1, global_batch_size=4)  # fmt: skip
    return paths


def test_a_healthy_store_is_green(healthy):
    results = run_checks(healthy.root)
    assert set(results) == set(CHECKS)
    assert {name: e.passed for name, e in results.items()} == dict.fromkeys(CHECKS, True)
    assert "| ok | 3 | 2 | 0 |" in results["contiguous_rollout_ids"].metadata["per_run"].value
    assert "| ok | 4 | 4 | 3.0 | 3 |  |" in results["prompt_coverage"].metadata["per_run"].value


def _break(paths: StoragePaths, how: str, tiny_hf_checkpoint: str) -> str:
    if how == "contiguous_rollout_ids":  # a shard lost from the middle
        shutil.rmtree(paths.rollout_shard_dir("ok", 1))
        return "run ok: rollout shards missing for rollout ids [1]"
    if how == "expected_version_count":  # the run's record of v2 lost: a gap, and rollout 1 untrained
        d = Path(paths.table_dir("policy_versions", "ok"))
        part = sorted(d.glob("part-*.parquet"))[1]
        part.unlink()
        return "run ok: versions [2] missing"
    if how == "prompt_coverage":  # the data grew a prompt the run never trained in 3 epochs
        f = Path(paths.checkpoints("ok")) / "run_config.json"
        data = prompt_file(Path(paths.root).parent / "train5.jsonl", 5)
        f.write_text(json.dumps(json.loads(f.read_text()) | {"prompt_data": data}))
        return "run ok: 1 of 5 prompts never trained after 12 groups drawn from 5 prompts (0 dropped by filters): ['4+4=']"
    if how == "async_staleness":  # the same samples, judged by a tighter bound
        f = Path(paths.checkpoints("ok")) / "run_config.json"
        f.write_text(json.dumps(json.loads(f.read_text()) | {"max_weight_staleness": 0}))
        return "ok.v000002: rollout 1 has samples 1 versions stale"
    # hf_export_sanity: a version exported with a tensor missing
    from safetensors.numpy import load_file, save_file

    hf = paths.hf_export("ok", 3)
    (st,) = Path(hf).glob("*.safetensors")
    tensors = load_file(str(st))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(st), metadata={"format": "pt"})
    return f"ok.v000003: key set differs from the base checkpoint {tiny_hf_checkpoint}: missing ['{dropped}']"


@pytest.mark.parametrize("check", list(CHECKS))
def test_a_store_broken_on_purpose_turns_its_check_red(healthy, tiny_hf_checkpoint, check):
    needle = _break(healthy, check, tiny_hf_checkpoint)
    results = run_checks(healthy.root)
    e = results[check]
    assert not e.passed and e.severity == dg.AssetCheckSeverity.ERROR
    assert needle in e.metadata["details"].value, e.metadata["details"].value
    others = {n: r.passed for n, r in results.items() if n != check}
    if check == "expected_version_count":
        assert others == dict.fromkeys(others, True)  # the shards and exports are all there


def test_finished_run_with_too_few_versions_and_unreadable_export(tmp_path, tiny_hf_checkpoint):
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "short", tiny_hf_checkpoint, 2, update_weights_interval=1)
    f = Path(paths.checkpoints("short")) / "run_config.json"
    f.write_text(json.dumps(json.loads(f.read_text()) | {"num_rollout": 2}))
    # the last version's record lost: rollout 1 was due a weight update and trained none
    d = Path(paths.table_dir("policy_versions", "short"))
    sorted(d.glob("part-*.parquet"))[-1].unlink()
    (st,) = Path(paths.hf_export("short", 1)).glob("*.safetensors")
    st.write_bytes(st.read_bytes()[:100])  # truncated
    results = run_checks(paths.root)
    details = results["expected_version_count"].metadata["details"].value
    assert "rollouts [1] were due a weight update but trained no version" in details
    assert "finished (2 rollouts) with 1 trained versions, expected 2" in details
    assert "short.v000001: HF export" in results["hf_export_sanity"].metadata["details"].value
    assert os.path.exists(paths.hf_export("short", 1))


def test_prompt_coverage_sees_a_replayed_epoch_and_forgives_filtered_prompts(tmp_path, tiny_hf_checkpoint):
    """A run over 8 prompts that trained the first 4 in each of 3 rollouts (an epoch replayed from the
    start, twice) is red on both counts; the same groups with 4 prompts dropped by the dynamic
    filter each rollout are green; a run without readable prompt data is listed as not checked."""
    paths = StoragePaths(str(tmp_path / "root"))
    data = prompt_file(tmp_path / "train8.jsonl", 8)
    kw = dict(prompt_data=data, rollout_batch_size=4, n_samples_per_prompt=1, global_batch_size=4)
    build_run(paths, "replay", tiny_hf_checkpoint, 3, **kw)
    build_run(paths, "filtered", tiny_hf_checkpoint, 3, **kw)
    from miles_platform.store.tables import append_rows

    drops = [
        {"rollout_id": r, "step": r, "name": "rollout/dynamic_filter/drop_zero_std", "value": 4.0}
        for r in range(3)
    ]
    append_rows(paths, "metrics", "filtered", drops)
    build_run(paths, "nodata", tiny_hf_checkpoint, 2)  # prompt_data "train.jsonl": not here
    e = run_checks(paths.root)["prompt_coverage"]
    details, table = e.metadata["details"].value, e.metadata["per_run"].value
    assert not e.passed
    assert "run replay: 4 of 8 prompts never trained after 12 groups drawn from 8 prompts" in details
    assert (
        "run replay: prompt '0+0=' trained 3 times, but at most 2 epochs of the data were started" in details
    )
    assert "run filtered" not in details
    assert "| filtered | 8 | 4 | 3.0 | 3 |  |" in table
    assert "| nodata | None | None | None | None | --prompt-data train.jsonl unreadable here |" in table


@pytest.fixture
def three_kinds(tmp_path, tiny_hf_checkpoint):
    """`make demo && make demo-diffusion` and a LoRA run in one store: an LLM run (HF exports), a
    diffusion run (diffusers pipelines) and a LoRA run (PEFT adapters), two versions each."""
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "llm", tiny_hf_checkpoint, 2)
    build_run(paths, "dit", save_tiny_pipeline(tmp_path / "dit_base"), 2)
    build_run(paths, "lora", tiny_hf_checkpoint, 2, lora_rank=2)
    return paths


def test_each_model_kind_is_checked_as_what_it_is(three_kinds, tiny_hf_checkpoint):
    """A diffusion version has model_index.json and transformer/config.json, no config.json; a LoRA
    version is an adapter dir: neither is a broken LLM export."""
    e = run_checks(three_kinds.root)["hf_export_sanity"]
    assert e.passed, e.metadata["details"].value
    table = e.metadata["per_run"].value
    assert "| run | kind | exports_checked | parameters | reference |" in table
    assert f"| llm | hf_llm | 2 | 26944 | base checkpoint {tiny_hf_checkpoint} |" in table
    assert "| dit | diffusers_pipeline | 2 | 1184 | base checkpoint " in table
    assert (
        f"| lora | peft_adapter | 2 | 256 | first adapter lora.v000001, fitting base checkpoint {tiny_hf_checkpoint} |"
        in table
    )


def _details(paths: StoragePaths) -> str:
    health = hf_export_sanity(paths)
    return "\n".join(health.problems)


def _rewrite(st: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    save_file(change(load_file(str(st))), str(st), metadata={"format": "pt"})


def test_a_diffusion_export_missing_a_transformer_tensor_is_red(three_kinds, tmp_path):
    st = Path(three_kinds.hf_export("dit", 2), "transformer", "diffusion_pytorch_model.safetensors")
    _rewrite(st, lambda t: {k: v for k, v in t.items() if k != "proj_out.weight"})
    shutil.rmtree(Path(three_kinds.hf_export("dit", 1), "text_encoder"))
    details = _details(three_kinds)
    assert (
        f"dit.v000002: key set differs from the base checkpoint {tmp_path / 'dit_base'}: "
        "missing ['transformer/proj_out.weight']" in details
    ), details
    assert (
        f"dit.v000001: diffusers pipeline {three_kinds.hf_export('dit', 1)}: text_encoder/ missing" in details
    )
    assert "llm." not in details and "lora." not in details


def test_a_lora_adapter_that_does_not_fit_its_base_is_red(three_kinds, tiny_hf_checkpoint):
    import numpy as np

    q = "base_model.model.model.layers.0.self_attn.q_proj"
    st = Path(three_kinds.lora_adapter("lora", 2), "adapter_model.safetensors")
    _rewrite(st, lambda t: t | {f"{q}.lora_B.weight": np.zeros((32, 3), np.float32)})  # rank 3, config says 2
    Path(three_kinds.lora_adapter("lora", 1), "adapter_model.safetensors").unlink()
    details = _details(three_kinds)
    assert (
        f"lora.v000002: {q}: lora_A (2, 32) / lora_B (32, 3), expected (2, 32) / (32, 2) "
        f"for the base checkpoint {tiny_hf_checkpoint}" in details
    ), details
    adapter = three_kinds.lora_adapter("lora", 1)
    assert f"lora.v000001: PEFT adapter {adapter}: adapter_model.safetensors missing" in details


def test_a_version_of_an_unknown_kind_is_listed_not_failed(tmp_path, tiny_hf_checkpoint):
    """Exports in a layout no kind knows (no config.json, model_index.json or adapter_config.json:
    say a GGUF file a newer writer left) and a base no longer here: reported as not checked, never
    a red check."""
    base = shutil.copytree(tiny_hf_checkpoint, tmp_path / "gone_base")
    paths = StoragePaths(str(tmp_path / "root"))
    build_run(paths, "odd", str(base), 2)
    shutil.rmtree(base)
    for v in (1, 2):
        shutil.rmtree(paths.hf_export("odd", v))
        Path(paths.hf_export("odd", v)).mkdir()
        Path(paths.hf_export("odd", v), "model.gguf").write_bytes(b"GGUF")
    e = run_checks(paths.root)["hf_export_sanity"]
    assert e.passed, e.metadata["details"].value
    assert (
        "| odd | unknown | 0 | None | not checked: no config.json (HF export), model_index.json (diffusers "
        "pipeline) or adapter_config.json (PEFT adapter) in the base or any export |"
        in e.metadata["per_run"].value
    ), e.metadata["per_run"].value
