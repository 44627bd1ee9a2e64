"""Prompt datasets with images (--multimodal-keys, data/images.py): bytes in Parquet, paths in
JSONL, checked at load (before Ray starts) with the file and row of a bad image named."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_platform.data.dataset import (
    content_hash,
    load_prompt_dataset,
    read_normalized_dataset,
    write_normalized_dataset,
)
from miles_platform.data.images import from_data_uri, image_hash, parse_multimodal_keys
from miles_platform.errors import ConfigError, DataError
from miles_platform.models.vlm import IMAGE_PAD, VISION_END, VISION_START

KEYS = {"image": "images"}


def _png(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (value, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def test_parquet_image_bytes_load_and_round_trip(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [{"input": "How many? <image>", "label": "1", "images": [_png(1)]},
            {"input": "<image> vs <image>", "label": "2", "images": [_png(2), _png(1)]}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs = load_prompt_dataset(str(path), label_key="label", multimodal_keys=KEYS)
    assert recs[0].prompt == f"How many? {VISION_START}{IMAGE_PAD}{VISION_END}"
    assert [from_data_uri(u) for u in recs[1].images] == [_png(2), _png(1)]
    assert image_hash(recs[0].images[0]) == image_hash(recs[1].images[1])  # content-addressed
    out = write_normalized_dataset(recs, str(tmp_path / "norm.parquet"))
    back = read_normalized_dataset(out.path)
    assert [r.images for r in back] == [r.images for r in recs]
    assert content_hash(back) == content_hash(recs) == out.content_hash
    other = load_prompt_dataset(str(path), label_key="label", multimodal_keys=KEYS)
    other[1].images = other[1].images[::-1]
    assert content_hash(other) != content_hash(recs)  # the images are part of the data version


def test_jsonl_image_paths_relative_to_the_dataset(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(3))
    (tmp_path / "d.jsonl").write_text(json.dumps({"input": "<image>?", "images": "img/a.png"}) + "\n")
    (rec,) = load_prompt_dataset(str(tmp_path / "d.jsonl"), multimodal_keys=KEYS)
    assert from_data_uri(rec.images[0]) == _png(3)


@pytest.mark.parametrize(
    ("image", "match"),
    [
        ("bad.png", r"d\.jsonl:2: key 'images' image 1: not a readable image"),
        ("gone.png", r"d\.jsonl:2: key 'images' image 1: image file .*gone\.png not found"),
    ],
)
def test_bad_or_missing_image_names_file_row_and_image(tmp_path, image, match):
    (tmp_path / "ok.png").write_bytes(_png(4))
    (tmp_path / "bad.png").write_bytes(_png(4)[:20])  # a truncated PNG
    rows = [
        {"input": "<image>", "images": ["ok.png"]},
        {"input": "<image><image>", "images": ["ok.png", image]},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=match):
        load_prompt_dataset(str(tmp_path / "d.jsonl"), multimodal_keys=KEYS)


def test_placeholders_must_match_images(tmp_path):
    pq.write_table(
        pa.Table.from_pylist([{"input": "no placeholder", "images": [_png(5)]}]), tmp_path / "d.parquet"
    )
    with pytest.raises(DataError, match=r"row 1: the prompt has 0 <image> placeholder\(s\) for 1 image"):
        load_prompt_dataset(str(tmp_path / "d.parquet"), multimodal_keys=KEYS)


def test_multimodal_keys_flag_parsing():
    assert parse_multimodal_keys('{"image": "image_file"}') == {"image": "image_file"}
    with pytest.raises(ConfigError, match="video and audio"):
        parse_multimodal_keys('{"video": "clips"}')
    with pytest.raises(ConfigError, match="--multimodal-keys: not JSON"):
        parse_multimodal_keys("images")


def test_a_persisted_buffer_group_keeps_its_images():
    """The fully async buffer saves groups as shard rows (image hashes only); restored, each sample
    gets its prompt's images back."""
    from miles_platform.data.dataset import PromptRecord
    from miles_platform.data.images import to_data_uri
    from miles_platform.data.sample import Sample
    from miles_platform.rollout.data_buffer import DataBufferInput, entry_from_json, entry_to_json

    uri = to_data_uri(_png(7))
    rec = PromptRecord(id="p", prompt="x", images=[uri])
    entry = DataBufferInput(prompt=rec, group=[Sample(prompt="x", image_data=[uri])], uid=3)
    saved = json.loads(json.dumps(entry_to_json(entry)))
    assert (
        saved["samples"][0]["image_hashes"] == [image_hash(uri)] and "image_data" not in saved["samples"][0]
    )
    assert entry_from_json(saved).group[0].image_data == [uri]


def test_messages_with_image_parts_take_the_rows_images_in_order(tmp_path):
    """Miles' chat prompts with image content parts: each image part becomes the placeholder the
    row's images fill (as `<image>` in text), rendered through the chat template."""

    class Template:  # the part of a tokenizer _render_prompt uses
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    parts = [{"type": "image"}, {"type": "text", "text": " vs "},
             {"type": "image_url", "image_url": {"url": "ignored"}}, {"type": "text", "text": "?"}]  # fmt: skip
    (tmp_path / "a.png").write_bytes(_png(4))
    (tmp_path / "b.png").write_bytes(_png(5))
    row = {"messages": [{"role": "system", "content": "count"}, {"role": "user", "content": parts}],
           "images": ["a.png", "b.png"]}  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (rec,) = load_prompt_dataset(str(path), input_key="messages", apply_chat_template=True,
                                 tokenizer=Template(), multimodal_keys=KEYS)  # fmt: skip
    pad = f"{VISION_START}{IMAGE_PAD}{VISION_END}"
    assert rec.prompt == f"<system>count<user>{pad} vs {pad}?<assistant>"
    assert [from_data_uri(u) for u in rec.images] == [_png(4), _png(5)]
    bad = {"messages": [{"role": "user", "content": [{"type": "audio"}]}], "images": ["a.png"]}
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match="content part of type 'audio'"):
        load_prompt_dataset(str(path), input_key="messages", apply_chat_template=True,
                            tokenizer=Template(), multimodal_keys=KEYS)  # fmt: skip
