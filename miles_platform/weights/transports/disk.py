"""`disk`: engines reload the full HF export of the version (`POST /update_weights_from_disk`)."""

from __future__ import annotations

from miles_platform.rollout.client import post
from miles_platform.store.remote import size
from miles_platform.weights.transports import TransferStats, Transport


def update_from_disk(url: str, path: str, version: int, api_key: str | None) -> None:
    body = post(
        url,
        "/update_weights_from_disk",
        {"model_path": path, "weight_version": str(version)},
        api_key=api_key,
        timeout=600,
    )
    if isinstance(body, dict) and body.get("success") is False:
        raise RuntimeError(f"{url}: update_weights_from_disk({path}) failed: {body}")


class DiskTransport(Transport):
    name = "disk"

    def prepare(self, state, version, hf_dir):
        if hf_dir is None:
            raise RuntimeError("disk transport needs the HF export of the version")
        self._path = hf_dir
        n = size(f"{hf_dir}/model.safetensors")  # a local path or an object-store URI
        return TransferStats(wire_bytes=n * len(self.engines), full_bytes=n * len(self.engines))

    def activate(self, version):
        for e in self.engines:
            update_from_disk(e.url, self._path, version, self.cfg.api_key)
