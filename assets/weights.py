"""Weights domain: `weight_publications` (disk-delta per policy version) and `quantized_weights`.

`weight_publications[<run>.vNNNNNN]` publishes that version's HF export into
`StoragePaths.publications(run)` (weight_vNNNNNN/ + LATEST) with `miles_platform.weights.disk_delta`:
a snapshot for the first version and every keyframe, else a delta against the latest published
version. Re-materializing a version already published with identical final checksums reports it
instead of failing; publications are append-only, so an older version than LATEST that is not
there already fails with a message. The `publish_on_new_policy` sensor requests it.

`quantized_weights[<run>.vNNNNNN|fp8|int4]` writes an fp8 (128x128 block) or int4 (pack-quantized)
checkpoint next to the export (`<hf_export>-<fmt>`), reloads it the way engines do
(`load_dequantized_state_dict`) and checks the block/group error against the format's bound. It
then scores greedy pass@1 of the version and of the weights engines will serve, on the same eval
prompts with one in-process engine (the version, then the dequantized weights swapped in): `<dataset>/pass@1` (quantized), `<dataset>/pass@1_full_precision` and
`<dataset>/pass@1_delta` (keyed like eval_results' metadata).
"""

import time

import dagster as dg

from assets.evals import (
    EvalConfig,
    resolve_datasets,
    resolve_hf_path,
    reward_settings,
    run_config_for_version,
)
from assets.partitions import policy_version_partitions, quantized_partitions
from miles_platform.errors import CheckpointError, PublicationError
from miles_platform.store.lineage_identity import Edge, write_edges
from miles_platform.store.paths import parse_partition_key
from resources.storage import StorageRootResource

PUBLICATION_CHECK = "matches_hf_export"
QUANT_CHECK = "dequant_error_within_bound"


class PublicationConfig(dg.Config):
    """Miles disk-delta flags (snake_case)."""

    disk_delta_encoding: str = "xor"  # xor | overwrite
    disk_delta_checksum: str = "xxh3-128"  # xxh3-128 | blake3 | adler32
    disk_delta_keyframe_interval: int = 10
    lock_wait_s: float = 300.0  # wait for a concurrent publication run of the same run
    disk_delta_encode_workers: int = 1  # threads encoding tensors in parallel (same bytes as one)


class QuantizeConfig(dg.Config):
    group_size: int = 128  # int4 group size (clamped to the smallest in_features)
    # greedy pass@1 of the quantized weights next to the version's own, on the first N prompts of
    # each eval dataset (the run's eval settings); 0: no eval
    eval_max_prompts: int = 100


def _local(paths_root: str, what: str) -> None:
    if "://" in paths_root:
        raise dg.Failure(f"{what} needs a POSIX storage root (atomic rename); got {paths_root}")


@dg.asset(
    partitions_def=policy_version_partitions,
    deps=["policy_versions"],
    group_name="weights",
    kinds={"safetensors"},
    pool="disk_delta_publish",
    check_specs=[dg.AssetCheckSpec(PUBLICATION_CHECK, asset="weight_publications")],
    description="Disk-delta publication (Miles --update-weight-transfer-mode disk-delta) of a policy "
    "version: compressed changed bytes + index with final-state checksums, committed by LATEST.",
)
def weight_publications(
    context: dg.AssetExecutionContext, storage: StorageRootResource, config: PublicationConfig
) -> dg.MaterializeResult:
    from miles_platform.weights import disk_delta as dd
    from miles_platform.weights.checksum import checksum
    from miles_platform.weights.cli import load_hf_state

    partition = context.partition_key
    run, version = parse_partition_key(partition)
    paths = storage.paths
    _local(paths.root, "weight_publications")
    hf = resolve_hf_path(context.instance, paths, partition)
    pub_dir = paths.publications(run)
    state = load_hf_state(hf)
    latest = dd.read_latest(pub_dir)
    reused = latest is not None and version <= latest
    if reused:
        if version not in dd.committed_versions(pub_dir):
            raise dg.Failure(
                f"{partition}: LATEST in {pub_dir} is already v{latest} and v{version} was never "
                "published there; publications are append-only (publish versions in order)"
            )
        seconds = encode_seconds = 0.0
    else:
        pub = dd.DeltaPublisher(
            pub_dir,
            encoding=config.disk_delta_encoding,
            checksum=config.disk_delta_checksum,
            keyframe_interval=config.disk_delta_keyframe_interval,
            lock_wait_s=config.lock_wait_s,
            workers=config.disk_delta_encode_workers,
        )
        try:
            st = pub.publish(state, version=version)
            seconds, encode_seconds = st.seconds, st.encode_seconds
        except PublicationError as e:
            raise dg.Failure(f"{partition}: {e}") from e
    idx = dd.read_index(pub_dir, version)
    s = idx["stats"]
    mismatched = [t["name"] for t in idx["tensors"]
                  if t["name"] not in state or checksum(state[t["name"]], idx["checksum"]) != t["checksum"]]  # fmt: skip
    mismatched += sorted(set(state) - {t["name"] for t in idx["tensors"]})
    check = dg.AssetCheckResult(
        check_name=PUBLICATION_CHECK,
        passed=not mismatched,
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "mismatched_tensors": len(mismatched),
            "first_mismatch": mismatched[0] if mismatched else "",
        },
        description="every final-state checksum in the index equals the HF export's tensor",
    )
    write_edges(paths, run, [Edge(f"publication:{partition}", "publication", partition, "policy_version",
                                  "published_as", idx["kind"])])  # fmt: skip
    return dg.MaterializeResult(
        metadata={
            "version": version,
            "base_version": -1 if idx["base_version"] is None else idx["base_version"],
            "kind": idx["kind"],
            "encoding": idx["encoding"],
            "checksum": idx["checksum"],
            "wire_bytes": s["wire_bytes"],
            "full_bytes": s["full_bytes"],
            "wire_fraction": s["wire_bytes"] / max(s["full_bytes"], 1),
            "density": float(s["density"]),
            "encode_seconds": float(encode_seconds),
            "publish_seconds": float(seconds),
            "reused_existing": reused,
            "publication_path": dg.MetadataValue.path(f"{pub_dir}/{dd.version_dir_name(version)}"),
            "hf_path": dg.MetadataValue.path(hf),
        },
        check_results=[check],
    )


def quantized_vs_full_precision(
    instance: dg.DagsterInstance, partition: str, hf: str, served: dict, max_prompts: int
) -> dict:
    """Greedy pass@1 of the version (`hf`) and of its dequantized weights (`served`), per eval
    dataset, as metadata; {"eval_skipped": why} when there is no eval dataset."""
    from miles_platform.rollout.engine_core import EngineCore
    from miles_platform.rollout.evaluate import evaluate

    config = (
        run_config_for_version(instance, partition).get("ops", {}).get("eval_results", {}).get("config", {})
    )
    config = EvalConfig(**{**config, "n_samples_per_eval_prompt": 1, "max_prompts": max_prompts})
    try:
        datasets = resolve_datasets(instance, config)
    except dg.Failure as e:
        return {"eval_skipped": e.description or str(e)}
    kw = dict(n_samples_per_eval_prompt=1, temperature=0.0, max_new_tokens=config.eval_max_response_len,
              rewards=reward_settings(config), seed=config.seed, input_key=config.input_key,
              label_key=config.label_key, metadata_key=config.metadata_key,
              apply_chat_template=config.apply_chat_template, max_prompts=max_prompts)  # fmt: skip
    core = EngineCore(hf)  # full precision, then the dequantized weights swapped in (as an engine would)
    t0 = time.perf_counter()
    try:
        ref = evaluate(core, datasets, **kw)
        try:
            core.update_weights_from_tensors(served, core.weight_version + 1)
        except CheckpointError as e:
            raise dg.Failure(f"the quantized checkpoint does not fit the model: {e}") from e
        got = evaluate(core, datasets, **kw)
    finally:
        core.stop()
    out: dict = {"eval_seconds": time.perf_counter() - t0}
    rows = [
        "| dataset | pass@1 quantized | pass@1 full precision | delta | prompts |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in got:
        q, f = got[name]["pass@1"], ref[name]["pass@1"]
        out |= {
            f"{name}/pass@1": q,
            f"{name}/pass@1_full_precision": f,
            f"{name}/pass@1_delta": q - f,
        }
        rows.append(f"| {name} | {q:.3f} | {f:.3f} | {q - f:+.3f} | {got[name]['num_prompts']} |")
    out["eval"] = dg.MetadataValue.md("\n".join(rows))
    return out


def quantized_path(hf_export: str, fmt: str) -> str:
    """`<export>-<fmt>`: where a run from a quantized --hf-checkpoint writes each served version too."""
    from miles_platform.store.paths import served_path

    return served_path(hf_export, fmt)


@dg.asset(
    partitions_def=quantized_partitions,
    deps=["policy_versions"],
    group_name="weights",
    kinds={"safetensors"},
    check_specs=[dg.AssetCheckSpec(QUANT_CHECK, asset="quantized_weights")],
    description="fp8 (128x128 blocks, fp32 scales) or int4 W4A16 (compressed-tensors pack-quantized) "
    "checkpoint of a policy version for quantized rollout engines.",
)
def quantized_weights(
    context: dg.AssetExecutionContext, storage: StorageRootResource, config: QuantizeConfig
) -> dg.MaterializeResult:
    from miles_platform.weights.cli import load_hf_state
    from miles_platform.weights.quantize import (
        MAX_REL_ERROR,
        block_rel_error,
        load_dequantized_state_dict,
        quantize_checkpoint,
    )

    keys = context.partition_key.keys_by_dimension
    partition, fmt = keys["policy_version"], keys["format"]
    paths = storage.paths
    _local(paths.root, "quantized_weights")
    hf = resolve_hf_path(context.instance, paths, partition)
    out = quantized_path(hf, fmt)
    st = quantize_checkpoint(hf, out, fmt, config.group_size)
    # the check reads back what engines will load, not the in-memory result
    t0 = time.perf_counter()
    original, served = load_hf_state(hf), load_dequantized_state_dict(out)
    group = st.group_size
    worst, worst_name = 0.0, ""
    for name, w in original.items():
        if (
            name in served
            and w.dim() == 2
            and w.is_floating_point()
            and not served[name].equal(w.to(served[name].dtype))
        ):
            err = block_rel_error(w, served[name], fmt, group)
            if err > worst:
                worst, worst_name = err, name
    bound = MAX_REL_ERROR[fmt]
    check = dg.AssetCheckResult(
        check_name=QUANT_CHECK,
        passed=bool(worst <= bound + 1e-3),
        severity=dg.AssetCheckSeverity.ERROR,
        metadata={
            "max_rel_error": worst,
            "bound": bound,
            "worst_tensor": worst_name,
            "check_seconds": time.perf_counter() - t0,
        },  # fmt: skip
        description=f"max |w - dequant| / block amax of every quantized tensor <= {bound:.4f} ({fmt})",
    )
    evals = (
        quantized_vs_full_precision(context.instance, partition, hf, served, config.eval_max_prompts)
        if config.eval_max_prompts > 0
        else {"eval_skipped": "eval_max_prompts is 0"}
    )
    run, _ = parse_partition_key(partition)
    write_edges(paths, run, [Edge(f"quantized:{partition}:{fmt}", "quantized_weights", partition, "policy_version",
                                  "quantized_as", fmt)])  # fmt: skip
    return dg.MaterializeResult(
        metadata={
            "format": fmt,
            "path": dg.MetadataValue.path(out),
            "hf_path": dg.MetadataValue.path(hf),
            "bytes": st.bytes_out,
            "bytes_in": st.bytes_in,
            "compression_ratio": st.compression_ratio,
            "seconds": st.seconds,
            "max_rel_error": worst,
            "tensors_quantized": st.tensors_quantized,
            "group_size": group if fmt == "int4" else 128,
            **evals,
        },
        check_results=[check],
    )
