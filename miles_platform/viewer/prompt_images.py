"""The images a vision-language run's samples saw, for the viewer (`GET /prompt_image`).

Rollout shards keep each sample's images by content hash only (`image_hashes`, data/images.py);
the bytes are the run's prompt data's. `PromptImages.get(run, hash)` reads the run's recorded
config (`run_config.json`: --prompt-data, its keys, --multimodal-keys), loads that dataset's images
once (as training read them, checks included) and answers the one whose hash matches: an image
outside the run's prompt data (a tool's, another run's) is a 404, so the route serves nothing but
what the run trained on. Local storage roots only, as the viewer's tokenizer lookup.
"""

from __future__ import annotations

import json
import os
import re
import threading

from miles_platform.errors import MilesError
from miles_platform.store.paths import RUN_CONFIG, StoragePaths
from miles_platform.viewer.queries import ViewerError

_HASH = re.compile(r"[0-9a-f]{32}")
MAX_RUNS = 4  # runs whose image index is kept in memory


class PromptImages:
    def __init__(self, paths: StoragePaths, remote: bool = False):
        self.paths, self.remote = paths, remote
        self._by_run: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()

    def get(self, run: str, image_hash: str) -> tuple[bytes, str]:
        """(encoded bytes, media type) of the run's prompt image with this content hash."""
        if not _HASH.fullmatch(image_hash or ""):
            raise ViewerError(f"hash={image_hash!r}: an image content hash (32 hex characters)")
        data = self._index(run).get(image_hash)
        if data is None:
            raise ViewerError(
                f"image {image_hash} is not in run {run!r}'s --prompt-data (a tool's image, or another run's)",
                404,
            )
        return data, f"image/{_format(data)}"

    def _index(self, run: str) -> dict[str, bytes]:
        with self._lock:
            if run not in self._by_run:
                if len(self._by_run) >= MAX_RUNS:
                    self._by_run.pop(next(iter(self._by_run)))
                self._by_run[run] = self._load(run)
            return self._by_run[run]

    def _load(self, run: str) -> dict[str, bytes]:
        from miles_platform.data.dataset import load_prompt_dataset
        from miles_platform.data.images import from_data_uri, image_hash, parse_multimodal_keys

        path = os.path.join(self.paths.checkpoints(run), RUN_CONFIG)
        if self.remote or not os.path.isfile(path):
            raise ViewerError(
                f"run {run!r}: no {RUN_CONFIG} on this (local) storage root to find its images", 404
            )
        with open(path) as f:
            cfg = json.load(f)
        try:
            keys = parse_multimodal_keys(cfg.get("multimodal_keys"))
            if not keys:
                raise ViewerError(f"run {run!r} has no --multimodal-keys: its samples saw no images", 404)
            records = load_prompt_dataset(
                cfg["prompt_data"], cfg.get("input_key") or "input", None, cfg.get("metadata_key") or "metadata",
                keep_messages=True, multimodal_keys=keys,
            )  # fmt: skip
        except (MilesError, KeyError, OSError) as e:
            raise ViewerError(
                f"run {run!r}: its prompt data does not read ({type(e).__name__}: {e})", 404
            ) from None
        return {image_hash(u): from_data_uri(u) for r in records for u in r.images}


def _format(data: bytes) -> str:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return (img.format or "png").lower()
