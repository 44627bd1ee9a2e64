"""LoRA (--lora-rank > 0): a weight update ships the adapter only (lora_A / lora_B), never the base.

`tensor`: in-process to Ray-hosted embedded engines (the adapter of the run's name replaced in one
step). `disk`: SGLang's `POST /unload_lora_adapter` + `POST /load_lora_adapter` with the version's
PEFT adapter dir, so a real SGLang server (started with --enable-lora) drops in. Both inside the
pause, as every update. `full_bytes` is the base model's size: density = adapter / full weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.weights.transports import TransferStats, Transport, full_bytes


def lora_name(cfg) -> str:
    """The engine-side adapter name of a run: requests choose it with `lora_path`."""
    return cfg.run_name


def base_weight_bytes(hf_checkpoint: str) -> int:
    return sum(f.stat().st_size for f in Path(hf_checkpoint).glob("*.safetensors"))


class LoraTransport(Transport):
    name = "lora"

    def __init__(self, cfg, paths, engines):
        super().__init__(cfg, paths, engines)
        self.full = base_weight_bytes(cfg.hf_checkpoint)
        self._loaded: set[str] = set()  # engine URLs holding this run's adapter (HTTP path)

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
        name = lora_name(self.cfg)
        if self._in_process():
            import ray

            ray.get(
                [
                    e.actor.load_lora_adapter.remote(name, self._state, self._config, version)
                    for e in self.engines
                ]
            )
            return
        body = {"lora_name": name, "lora_path": self._dir}
        if self.cfg.rollout_engine == "embedded" and not self.cfg.rollout_external_engine_addrs:
            body["weight_version"] = version  # the embedded engine's extension; SGLang takes SGLang's fields
        for e in self.engines:
            if e.url in self._loaded:
                post(
                    e.url, "/unload_lora_adapter", {"lora_name": name}, api_key=self.cfg.api_key, timeout=600
                )
                self._loaded.discard(e.url)
            try:
                post(e.url, "/load_lora_adapter", body, api_key=self.cfg.api_key, timeout=600)
            except EngineHTTPError as err:
                raise RuntimeError(f"{e.url}: load_lora_adapter({self._dir}) failed: {err.body}") from err
            self._loaded.add(e.url)
