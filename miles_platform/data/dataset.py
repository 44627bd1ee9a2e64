"""Prompt datasets: JSONL or Parquet at any fsspec URI -> PromptRecords -> normalized Parquet.

Miles keys: `--input-key` (Sample.prompt, default "input"), `--label-key` (Sample.label),
`--metadata-key` (Sample.metadata, default "metadata"), `--apply-chat-template` (wrap the
prompt as one user message, or take a messages list as is, and render it with the
tokenizer's chat template, add_generation_prompt=True).

`--multimodal-keys '{"image": KEY}'` (data/images.py): the row's images, read and checked here;
each `<image>` placeholder of the prompt becomes the Qwen-VL vision tokens (models/vlm.py).

Normalized Parquet has columns (id, prompt, label, metadata JSON), and `images` (a list of encoded
image bytes per row) when the dataset has images. Its content hash is over canonical JSON rows (and
the images' content hashes), not Parquet bytes, so it only changes when the data does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from miles_platform.data.images import from_data_uri, image_hash, load_row_images, parts_text, to_data_uri
from miles_platform.errors import DataError

NORMALIZED_SCHEMA = pa.schema(
    [("id", pa.string()), ("prompt", pa.string()), ("label", pa.string()), ("metadata", pa.string())]
)
HASH_KEY = b"miles.content_hash"
LABEL_KEY = b"miles.label_key"


@dataclass
class PromptRecord:
    id: str
    prompt: str
    label: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)  # data URIs (SGLang's image_data), data/images.py


@dataclass(frozen=True)
class NormalizedDataset:
    path: str
    rows: int
    bytes: int
    content_hash: str


# ---------------------------------------------------------------- reading
def _format(uri: str, head: bytes) -> str:
    lower = uri.lower().split("?")[0]
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "parquet" if head.startswith(b"PAR1") else "jsonl"


def _jsonl_rows(uri: str) -> Iterator[tuple[str, dict]]:
    with fsspec.open(uri, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{uri}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _parquet_rows(uri: str, required: list[str]) -> Iterator[tuple[str, dict]]:
    try:
        with fsspec.open(uri, "rb") as f:
            table = pq.read_table(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{uri}: not a readable Parquet file ({e})") from None
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DataError(
            f"{uri}: Parquet schema lacks column(s) {missing}; columns present: {table.column_names} "
            "(check --input-key / --label-key)"
        )
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{uri}: row {i}", row


def _render_prompt(
    value: Any, where: str, input_key: str, tokenizer: Any | None, chat: bool, keep_messages: bool = False,
    chat_kwargs: dict | None = None,
) -> str:  # fmt: skip
    if keep_messages and isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        if not all(isinstance(m.get("role"), str) for m in value):
            raise DataError(f"{where}: key {input_key!r}: every message needs a role")
        return json.dumps(value, ensure_ascii=False)  # an OpenAI messages list, as JSON text
    if chat:
        if tokenizer is None:
            raise DataError("--apply-chat-template needs a tokenizer with a chat template")
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
            messages = value
        else:
            raise DataError(f"{where}: key {input_key!r} must be a string or a messages list")
        value = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(chat_kwargs or {})
        )
    if isinstance(value, list):
        raise DataError(f"{where}: key {input_key!r} is a messages list; pass --apply-chat-template")
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: key {input_key!r} must be a non-empty string, got {value!r:.60}")
    return value


def _metadata(value: Any, where: str, metadata_key: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise DataError(f"{where}: key {metadata_key!r} is a string but not JSON") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: key {metadata_key!r} must be an object, got {type(value).__name__}")
    return value


def _label(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _canonical(prompt: str, label: str | None, metadata: dict) -> str:
    return json.dumps([prompt, label, metadata], sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def load_prompt_dataset(
    uri: str,
    input_key: str = "input",
    label_key: str | None = None,
    metadata_key: str = "metadata",
    apply_chat_template: bool = False,
    tokenizer: Any | None = None,
    keep_messages: bool = False,
    chat_template_kwargs: dict | None = None,
    multimodal_keys: dict[str, str] | None = None,
) -> list[PromptRecord]:
    """Read a JSONL or Parquet prompt dataset (local path or fsspec URI) into records.

    `chat_template_kwargs`: extra arguments of apply_chat_template (--apply-chat-template-kwargs).
    `keep_messages`: a messages-list prompt stays messages, as its JSON text (the agentic wrapper
    hands it to the agent; the session server renders the template).

    `multimodal_keys`: {"image": KEY} (--multimodal-keys): the row's images (data/images.py), one
    per `<image>` placeholder of the prompt, which becomes the Qwen-VL vision tokens.

    Ids: the row's `id` if it has one (must be unique), else a hash of the row content
    (duplicates of the same row get `-1`, `-2`, ... suffixes so ids stay unique).
    """
    try:
        with fsspec.open(uri, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        raise DataError(f"{uri}: dataset file not found (check --prompt-data)") from None
    except IsADirectoryError:
        raise DataError(
            f"{uri}: is a directory; give a JSONL or Parquet file (check --prompt-data)"
        ) from None
    if _format(uri, head) == "parquet":
        rows = _parquet_rows(uri, [input_key] + ([label_key] if label_key else []))
    else:
        rows = _jsonl_rows(uri)

    records: list[PromptRecord] = []
    given_ids: dict[str, str] = {}
    derived: dict[str, int] = {}
    for where, row in rows:
        for key, flag in ((input_key, "--input-key"), (label_key, "--label-key")):
            if key is not None and row.get(key) is None:
                raise DataError(f"{where}: missing key {key!r} ({flag}); keys present: {sorted(row)}")
        value = row[input_key]
        if multimodal_keys and isinstance(value, list):  # messages whose content has image parts
            value = _image_parts_as_placeholders(value, where, input_key)
        prompt = _render_prompt(
            value,
            where,
            input_key,
            tokenizer,
            apply_chat_template,
            keep_messages,
            chat_template_kwargs,
        )
        label = _label(row[label_key]) if label_key else None
        metadata = _metadata(row.get(metadata_key), where, metadata_key)
        images = _images(row, where, prompt, uri, multimodal_keys) if multimodal_keys else []
        if images:
            prompt = _vision_prompt(prompt)
        if row.get("id") is not None:
            rid = str(row["id"])
            if rid in given_ids:
                raise DataError(f"{where}: duplicate id {rid!r} (first at {given_ids[rid]})")
            given_ids[rid] = where
        else:
            canon = _canonical(prompt, label, metadata) + "".join(map(image_hash, images))
            base = hashlib.sha256(canon.encode()).hexdigest()[:16]
            n = derived.get(base, 0)
            derived[base] = n + 1
            rid = base if n == 0 else f"{base}-{n}"
        records.append(PromptRecord(id=rid, prompt=prompt, label=label, metadata=metadata, images=images))
    if not records:
        raise DataError(f"{uri}: dataset is empty (no records)")
    if given_ids and derived:
        ids = [r.id for r in records]
        if len(set(ids)) != len(ids):
            raise DataError(f"{uri}: derived ids collide with given ids; give every row an 'id'")
    return records


def _image_parts_as_placeholders(messages: list, where: str, input_key: str) -> list:
    """Messages whose content is a list of parts (OpenAI / HF style: `{"type": "text", "text": ...}`,
    `{"type": "image"}` or `{"type": "image_url", ...}`) as text messages with Miles' `<image>`
    placeholder where each image part stands (`images.parts_text`, as the chat routes read parts): the
    row's images (--multimodal-keys) fill them in order, as for a text prompt. The part's own URL is
    not read: the images are the row's."""
    from miles_platform.models.vlm import IMAGE_PLACEHOLDER

    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image", "image_url"):
                raise DataError(f"{where}: key {input_key!r}: a content part of type {kind!r}; "
                                "text, image and image_url parts are read (--multimodal-keys)")  # fmt: skip
        out.append({**m, "content": parts_text(content, IMAGE_PLACEHOLDER)})
    return out


def _images(row: dict, where: str, prompt: str, uri: str, multimodal_keys: dict[str, str]) -> list[str]:
    from miles_platform.models.vlm import IMAGE_PLACEHOLDER

    key = multimodal_keys["image"]
    images = load_row_images(row, where, key, uri)
    n = prompt.count(IMAGE_PLACEHOLDER)
    if n != len(images):
        raise DataError(
            f"{where}: the prompt has {n} {IMAGE_PLACEHOLDER} placeholder(s) for {len(images)} image(s) "
            f"under key {key!r} (--multimodal-keys): one placeholder per image, in order"
        )
    return images


def _placeholder_prompt(prompt: str) -> str:
    """`_vision_prompt` undone: each image's vision tokens back to Miles' `<image>`."""
    from miles_platform.models.vlm import IMAGE_PAD, IMAGE_PLACEHOLDER, VISION_END, VISION_START

    return prompt.replace(VISION_START + IMAGE_PAD + VISION_END, IMAGE_PLACEHOLDER)


def _vision_prompt(prompt: str) -> str:
    from miles_platform.models.vlm import IMAGE_PAD, IMAGE_PLACEHOLDER, VISION_END, VISION_START

    return prompt.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)


# ---------------------------------------------------------------- normalizing
def content_hash(records: list[PromptRecord]) -> str:
    """sha256 over canonical JSON rows (id, prompt, label, metadata): independent of Parquet encoding."""
    h = hashlib.sha256()
    for r in records:
        h.update(
            json.dumps([r.id, r.prompt, r.label, r.metadata], sort_keys=True, ensure_ascii=False).encode()
        )
        for im in r.images:  # text-only datasets keep their hash
            h.update(image_hash(im).encode())
        h.update(b"\n")
    return h.hexdigest()


def records_to_table(records: list[PromptRecord], label_key: str | None = None) -> pa.Table:
    with_images = any(r.images for r in records)
    schema = (
        NORMALIZED_SCHEMA.append(pa.field("images", pa.list_(pa.binary())))
        if with_images
        else NORMALIZED_SCHEMA
    )
    table = pa.Table.from_pylist(
        [
            {
                "id": r.id,
                # an image prompt as its source wrote it (Miles' <image>): read back with --multimodal-keys
                "prompt": _placeholder_prompt(r.prompt) if r.images else r.prompt,
                "label": r.label,
                "metadata": json.dumps(r.metadata, sort_keys=True),
                **({"images": [from_data_uri(im) for im in r.images]} if with_images else {}),
            }
            for r in records
        ],
        schema=schema,
    )
    meta = {HASH_KEY: content_hash(records).encode(), LABEL_KEY: (label_key or "").encode()}
    return table.replace_schema_metadata(meta)


def write_normalized_dataset(
    records: list[PromptRecord], uri: str, label_key: str | None = None
) -> NormalizedDataset:
    """Write records as normalized Parquet (id, prompt, label, metadata JSON), atomically."""
    from miles_platform.store.shards import write_parquet_atomic

    if not records:
        raise DataError(f"{uri}: refusing to write an empty dataset")
    size = write_parquet_atomic(records_to_table(records, label_key), uri)
    return NormalizedDataset(path=uri, rows=len(records), bytes=size, content_hash=content_hash(records))


def read_normalized_dataset(uri: str) -> list[PromptRecord]:
    """Records of a normalized dataset written by `write_normalized_dataset`."""
    rows = _parquet_rows(uri, list(NORMALIZED_SCHEMA.names))
    return [
        PromptRecord(
            id=r["id"],
            prompt=_vision_prompt(r["prompt"]) if r.get("images") else r["prompt"],
            label=r["label"],
            metadata=json.loads(r["metadata"] or "{}"),
            images=[to_data_uri(b) for b in r.get("images") or []],
        )  # fmt: skip
        for _, r in rows
    ]


def normalized_label_key(uri: str) -> str | None:
    """The --label-key a normalized dataset was built with (None if none)."""
    with fsspec.open(uri, "rb") as f:
        meta = pq.read_schema(f).metadata or {}
    return meta.get(LABEL_KEY, b"").decode() or None
