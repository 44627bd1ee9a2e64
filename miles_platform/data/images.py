"""Images of a prompt dataset (Miles' `--multimodal-keys '{"image": KEY}'`).

A row's KEY holds its images (a list, or one image); each is encoded bytes (a Parquet binary
column), an HF datasets Image struct (`{"bytes": ..., "path": ...}`), a `data:image/...;base64,`
URI, or a path / fsspec URI (relative to the dataset's directory). Every image is read and decoded
when the dataset is loaded, before Ray starts: a missing or undecodable image is a DataError naming
the file, row, key and image index. The prompt text names the images in order with Miles' `<image>`
placeholder; the counts must match.

In memory and on the wire an image is the data URI SGLang's `/generate` takes as `image_data`
(Miles' `encode_image_for_rollout_engine`); its identity is `image_hash` over the encoded bytes
(content-addressed: the same picture in two rows is one hash, and one dictionary entry of the
normalized Parquet's `images` column).
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import PurePosixPath
from typing import Any

import fsspec

from miles_platform.errors import DataError

IMAGE_PLACEHOLDER = "<image>"  # Miles' MultimodalTypes image placeholder in prompt text
MULTIMODAL_TYPES = ("image",)  # Miles' MultimodalTypes that are built here (video and audio are not)


def parts_text(parts: list[dict[str, Any]], image_text: str) -> str:
    """OpenAI / HF content parts as one text: each image part (`image`, `image_url`) is `image_text`,
    text parts are joined by a space when one follows another. The chat routes' template text
    (rollout/chat.py, with the vision tokens) and a messages prompt of a dataset (with Miles'
    `<image>` placeholder) both read parts this way."""
    out, after_text = [], False
    for p in parts:
        if p.get("type") in ("image", "image_url"):
            out.append(image_text)
            after_text = False
        else:
            out.append((" " if after_text else "") + str(p.get("text", "")))
            after_text = True
    return "".join(out)


def to_data_uri(data: bytes) -> str:
    """`data:image/<format>;base64,...` of encoded image bytes (the format PIL detects)."""
    from PIL import Image

    fmt = (Image.open(io.BytesIO(data)).format or "png").lower()
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


def from_data_uri(uri: str) -> bytes:
    """The encoded bytes of a `data:image/...;base64,` URI (or of bare base64, as SGLang accepts)."""
    payload = uri.split(",", 1)[1] if uri.startswith("data:") else uri
    return base64.b64decode(payload, validate=True)


def image_hash(data_or_uri: bytes | str) -> str:
    """The content address of an image: sha256 of its encoded bytes (32 hex chars)."""
    data = from_data_uri(data_or_uri) if isinstance(data_or_uri, str) else data_or_uri
    return hashlib.sha256(data).hexdigest()[:32]


def _resolve(path: str, dataset_uri: str) -> str:
    if "://" in path or path.startswith("/"):
        return path
    base = dataset_uri.rsplit("/", 1)[0] if "/" in dataset_uri else "."
    return str(PurePosixPath(base) / path) if "://" not in base else f"{base}/{path}"


def _image_bytes(value: Any, where: str, dataset_uri: str) -> bytes:
    if isinstance(value, dict):  # HF datasets' Image feature: bytes win, else the path
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return from_data_uri(value)
        except ValueError as e:
            raise DataError(f"{where}: bad base64 in a data URI ({e})") from None
    if isinstance(value, str) and value:
        uri = _resolve(value, dataset_uri)
        try:
            with fsspec.open(uri, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise DataError(f"{where}: image file {uri} not found") from None
        except (OSError, ValueError) as e:
            raise DataError(f"{where}: image file {uri} does not read ({e})") from None
    raise DataError(f"{where}: expected image bytes, a path or a data URI, got {type(value).__name__}")


def _check_decodes(data: bytes, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None


def load_row_images(row: dict, where: str, key: str, dataset_uri: str) -> list[str]:
    """The row's images under `key`, read, decoded (checked) and returned as data URIs."""
    value = row.get(key)
    if value is None:
        raise DataError(f"{where}: missing key {key!r} (--multimodal-keys); keys present: {sorted(row)}")
    items = list(value) if isinstance(value, list | tuple) else [value]
    out = []
    for i, item in enumerate(items):
        at = f"{where}: key {key!r} image {i}"
        data = _image_bytes(item, at, dataset_uri)
        _check_decodes(data, at)
        out.append(to_data_uri(data))
    return out


def parse_multimodal_keys(value: Any) -> dict[str, str] | None:
    """--multimodal-keys as a dict of media type -> dataset key (JSON text or a dict), checked."""
    from miles_platform.config.flags import json_flag

    if value is None:
        return None
    keys = dict(json_flag(value, "--multimodal-keys", dict, 'a JSON object such as \'{"image": "images"}\''))
    bad = [t for t in keys if t not in MULTIMODAL_TYPES]
    if bad or not keys or not all(isinstance(v, str) and v for v in keys.values()):
        from miles_platform.errors import ConfigError

        raise ConfigError(
            f"--multimodal-keys {value!r}: media types built here: {list(MULTIMODAL_TYPES)} (video and audio "
            "are not), each mapped to a dataset key"
        )
    return keys


def thumbnail_grid(
    images: list[bytes], ncol: int = 8, scale: int = 3, pad: int = 2, max_side: int = 96
) -> bytes:
    """PNG of encoded images in rows of `ncol` on grey, each upscaled `scale`x (nearest) but at most
    `max_side` pixels on its longer side (a big photo is shrunk): a dataset's preview in the UI (the
    `vlm_prompt_dataset` and `prompt_dataset` asset pages)."""
    from PIL import Image

    tiles = []
    for b in images:
        t = Image.open(io.BytesIO(b)).convert("RGB")
        f = min(scale, max_side / max(t.width, t.height))
        size = (max(1, round(t.width * f)), max(1, round(t.height * f)))
        tiles.append(t.resize(size, Image.NEAREST if f >= 1 else Image.LANCZOS))
    if not tiles:
        raise ValueError("thumbnail_grid: no images")
    w = max(t.width for t in tiles)
    h = max(t.height for t in tiles)
    ncol = min(ncol, len(tiles))
    nrow = -(-len(tiles) // ncol)
    grid = Image.new("RGB", (ncol * (w + pad) + pad, nrow * (h + pad) + pad), (128, 128, 128))
    for i, t in enumerate(tiles):
        r, c = divmod(i, ncol)
        grid.paste(t, (pad + c * (w + pad), pad + r * (h + pad)))
    buf = io.BytesIO()
    grid.save(buf, "PNG")
    return buf.getvalue()
