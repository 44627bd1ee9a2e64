"""LoRA (--lora-rank > 0): a weight update ships the adapter only (lora_A / lora_B), never the base.

Every policy version is registered on the engines under its own immutable name, `<run>@v<N>`
(Miles' multi-LoRA contract: "each push registers an immutable version under its own engine-side
name, so in-flight sampling against an older version is never disturbed"): load the new name,
switch the run's requests to it (`AdapterName.current`), unload the previous one (the engine
lets requests still holding it finish first, as SGLang's unload). Nothing of the engine is
paused, so runs that share a base can share engines: another run's requests, and the base's,
never wait on or see this run's update.

`tensor`: in-process to Ray-hosted embedded engines. `disk`: SGLang's `POST /load_lora_adapter`
/ `POST /unload_lora_adapter` with the version's PEFT adapter dir, so a real SGLang server
(started with --enable-lora) drops in. `full_bytes` is the base model's size: density = adapter /
full weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles_platform.rollout.base_types import AdapterName
from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.weights.transports import TransferStats, Transport, full_bytes


def base_weight_bytes(hf_checkpoint: str) -> int:
    return sum(f.stat().st_size for f in Path(hf_checkpoint).glob("*.safetensors"))


class LoraTransport(Transport):
    name = "lora"

    pauses = False  # a new immutable name per version: nothing of the engine stops for an update

    def __init__(self, cfg, paths, engines, adapter: AdapterName | None = None):
        super().__init__(cfg, paths, engines)
        self.full = base_weight_bytes(cfg.hf_checkpoint)
        self.adapter = adapter or AdapterName(cfg.run_name)
        self._kind: dict[str, bool] = {}  # engine URL -> is the embedded engine (takes weight_version)

    def prepare(self, state, version, hf_dir):
        """`state`: the adapter tensors; `hf_dir`: the version's adapter dir (already written)."""
        if hf_dir is None:
            raise RuntimeError("LoRA transport needs the version's adapter dir")
        self._state, self._dir = state, hf_dir
        self._config = json.loads(Path(hf_dir, "adapter_config.json").read_text())
        if self._in_process():
            n = full_bytes(state)
        else:
            n = os.path.getsize(os.path.join(hf_dir, "adapter_model.safetensors"))
        k = len(self.engines)
        return TransferStats(wire_bytes=n * k, full_bytes=self.full * k)

    def _in_process(self) -> bool:
        return self.cfg.update_weight_transfer_mode == "tensor" and all(e.actor for e in self.engines)

    def activate(self, version):
        new, old = self.adapter.of(version), self.adapter.current
        if new == old:  # the same version again: replaced in place (the engine refuses nothing)
            old = None
        if self._in_process():
            import ray

            ray.get(
                [
                    e.actor.load_lora_adapter.remote(new, self._state, self._config, version)
                    for e in self.engines
                ]
            )
        else:
            for e in self.engines:
                body = {"lora_name": new, "lora_path": self._dir}
                if self._embedded(e):  # the embedded engine's extension; SGLang takes SGLang's fields
                    body["weight_version"] = version
                try:
                    self._load(e, body)
                except EngineHTTPError as err:
                    raise RuntimeError(f"{e.url}: load_lora_adapter({self._dir}) failed: {err.body}") from err
        self.adapter.current = new  # the run's next requests carry the new version's name
        if old is not None:
            for e in self.engines:
                self._unload(e, old)

    def _embedded(self, e) -> bool:
        """Is `e` this project's embedded engine (Ray-hosted or attached as an external one)?"""
        if e.url not in self._kind:
            from miles_platform.rollout.client import get

            info = get(e.url, "/get_server_info", api_key=self.cfg.api_key)
            self._kind[e.url] = info.get("version") == "miles-platform-embedded"
        return self._kind[e.url]

    def _load(self, e, body: dict) -> None:
        try:
            post(e.url, "/load_lora_adapter", body, api_key=self.cfg.api_key, timeout=600)
        except EngineHTTPError as err:
            if "already loaded" not in str(err.body):
                raise
            # an external engine still holds this name from an earlier process of the run (a crash
            # before the version was recorded): the version is being published again, so replace it
            self._unload(e, body["lora_name"])
            post(e.url, "/load_lora_adapter", body, api_key=self.cfg.api_key, timeout=600)

    def _unload(self, e, name: str) -> None:
        """Unload `name` from engine `e`; one it does not hold (an engine restarted, a resumed run's
        old name) is not an error."""
        try:
            post(e.url, "/unload_lora_adapter", {"lora_name": name}, api_key=self.cfg.api_key, timeout=600)
        except EngineHTTPError as err:
            if "not loaded" not in str(err.body):
                raise RuntimeError(f"{e.url}: unload_lora_adapter({name}) failed: {err.body}") from err
