"""Dataset assets: prompt_dataset and eval_dataset as normalized Parquet under the storage root.

Each reads JSONL or Parquet (any fsspec URI) with the Miles keys, or generates the built-in
arithmetic task when no path is given, and writes `<root>/datasets/<asset>/data.parquet`
atomically. With `multimodal_keys` (Miles' --multimodal-keys) the rows' images are read and
checked, stored in the normalized Parquet's `images` column, and the asset page shows the first
ones as thumbnails; runs then read it with `--multimodal-keys '{"image": "images"}'`. The data version is the content hash of the rows. Blocking checks (schema,
unique ids, non-empty prompts, labels) gate everything downstream.
"""

import json
import tempfile

import dagster as dg
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from miles_platform.data.dataset import (
    NORMALIZED_SCHEMA,
    PromptRecord,
    load_prompt_dataset,
    normalized_label_key,
    write_normalized_dataset,
)
from miles_platform.data.images import parse_multimodal_keys
from resources.storage import StorageRootResource

PREVIEW_ROWS = 5
THUMBNAILS = 16


class DatasetConfig(dg.Config):
    path: str | None = None  # JSONL / Parquet path or fsspec URI; None = built-in arithmetic task
    input_key: str = "input"  # --input-key (the built-in task uses "prompt")
    label_key: str | None = None  # --label-key (the built-in task uses "label")
    metadata_key: str = "metadata"  # --metadata-key
    seed: int = 0  # seed of the built-in task generator
    multimodal_keys: str | None = None  # --multimodal-keys, e.g. '{"image": "images"}': image prompts


def _builtin_task(split: str, out_dir: str, seed: int) -> str:
    from miles_platform.data.tasks import write_task_datasets

    return str(write_task_datasets(out_dir, seed=seed)[split])


def _preview(records: list[PromptRecord]) -> str:
    def cell(v: object, width: int = 80) -> str:
        s = "" if v is None else (v if isinstance(v, str) else json.dumps(v))
        s = s.replace("|", "\\|").replace("\n", "⏎")
        return s if len(s) <= width else s[: width - 1] + "…"

    lines = ["| id | prompt | label | metadata |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {cell(r.id)} | {cell(r.prompt)} | {cell(r.label)} | {cell(r.metadata)} |"
        for r in records[:PREVIEW_ROWS]
    ]
    return "\n".join(lines)


def _image_metadata(records: list[PromptRecord]) -> dict:
    """Image datasets: the distinct images' count and the first THUMBNAILS as a grid (the labels in
    the caption), as the vlm_prompt_dataset page shows them."""
    from assets.metadata import image_markdown
    from miles_platform.data.images import from_data_uri, image_hash, thumbnail_grid

    with_images = [r for r in records if r.images]
    if not with_images:
        return {}
    first = with_images[:THUMBNAILS]
    caption = f"first {len(first)} rows' first images; labels: {' '.join(str(r.label) for r in first)}"
    return {
        "images": dg.MetadataValue.int(len({image_hash(u) for r in with_images for u in r.images})),
        "thumbnails": image_markdown(thumbnail_grid([from_data_uri(r.images[0]) for r in first]), caption),
    }


def _build(
    name: str, split: str, config: DatasetConfig, storage: StorageRootResource
) -> dg.MaterializeResult:
    # the built-in task is generated outside the storage root: a failure leaves nothing there
    with tempfile.TemporaryDirectory(prefix="miles-task-") as tmp:
        if config.path:
            source, input_key, label_key = config.path, config.input_key, config.label_key
        else:
            source, input_key, label_key = _builtin_task(split, tmp, config.seed), "prompt", "label"
        keys = parse_multimodal_keys(config.multimodal_keys)
        records = load_prompt_dataset(source, input_key, label_key, config.metadata_key, multimodal_keys=keys)
    info = write_normalized_dataset(records, storage.paths.dataset(name), label_key)
    return dg.MaterializeResult(
        metadata={
            **_image_metadata(records),
            "rows": dg.MetadataValue.int(info.rows),
            "bytes": dg.MetadataValue.int(info.bytes),
            "path": dg.MetadataValue.path(info.path),
            "source": dg.MetadataValue.text(
                source if config.path else f"built-in task ({split}, seed {config.seed})"
            ),
            "content_hash": dg.MetadataValue.text(info.content_hash),
            "preview": dg.MetadataValue.md(_preview(records)),
        },
        data_version=dg.DataVersion(info.content_hash),
    )


@dg.asset(group_name="datasets", kinds={"parquet"})
def prompt_dataset(config: DatasetConfig, storage: StorageRootResource) -> dg.MaterializeResult:
    """Training prompts (--prompt-data), normalized to (id, prompt, label, metadata JSON)."""
    return _build("prompt_dataset", "train", config, storage)


@dg.asset(group_name="datasets", kinds={"parquet"})
def eval_dataset(config: DatasetConfig, storage: StorageRootResource) -> dg.MaterializeResult:
    """Held-out eval prompts (--eval-prompt-data), normalized like prompt_dataset."""
    return _build("eval_dataset", "eval", config, storage)


# ------------------------------------------------------------------ checks
CHECKS = ("schema", "unique_ids", "non_empty_prompt", "label_present")


def _check_results(asset_key: dg.AssetKey, path: str) -> list[dg.AssetCheckResult]:
    with fsspec.open(path, "rb") as f:
        table = pq.read_table(f)
    label_key = normalized_label_key(path)

    def result(name: str, passed: bool, **metadata) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(
            asset_key=asset_key, check_name=name, passed=bool(passed), metadata=metadata
        )

    expected = {f.name: str(f.type) for f in NORMALIZED_SCHEMA}
    actual = {f.name: str(f.type) for f in table.schema}
    if "images" in actual:  # an image dataset (multimodal_keys): a list of encoded images per row
        t = table.schema.field("images").type
        expected["images"] = actual["images"] if pa.types.is_list(t) and pa.types.is_binary(t.value_type) else (
            "list<binary>"
        )  # fmt: skip
    out = [result("schema", actual == expected, columns=json.dumps(actual))]
    if actual != expected:  # the remaining checks cannot read a malformed file
        return out + [result(n, False, reason="schema check failed") for n in CHECKS[1:]]
    ids = table.column("id").to_pylist()
    dupes = sorted({i for i in ids if ids.count(i) > 1})[:5] if len(set(ids)) != len(ids) else []
    out.append(result("unique_ids", not dupes and None not in ids, duplicates=json.dumps(dupes)))
    prompts = table.column("prompt").to_pylist()
    empty = sum(1 for p in prompts if p is None or not p.strip())
    out.append(result("non_empty_prompt", empty == 0, empty_prompts=empty))
    missing = sum(1 for v in table.column("label").to_pylist() if v is None) if label_key else 0
    out.append(result("label_present", missing == 0, label_key=label_key or "(none)", missing_labels=missing))
    return out


def _checks_for(asset_def: dg.AssetsDefinition, name: str) -> dg.AssetChecksDefinition:
    specs = [dg.AssetCheckSpec(check, asset=asset_def, blocking=True) for check in CHECKS]

    @dg.multi_asset_check(specs=specs, name=f"{name}_checks")
    def _checks(storage: StorageRootResource):
        yield from _check_results(asset_def.key, storage.paths.dataset(name))

    return _checks


prompt_dataset_checks = _checks_for(prompt_dataset, "prompt_dataset")
eval_dataset_checks = _checks_for(eval_dataset, "eval_dataset")
