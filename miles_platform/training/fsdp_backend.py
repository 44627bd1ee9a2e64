"""Torch-native backend: the HF model itself; FSDP2 (`fully_shard`) when world_size > 1."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from miles_platform.models.checkpoint import load_hf_model
from miles_platform.training.backend import ModelBackend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPBackend(ModelBackend):
    name = "fsdp"

    def build(self, hf_checkpoint: str, trainable: bool = True) -> torch.nn.Module:
        model = load_hf_model(hf_checkpoint, dtype=DTYPES[self.cfg.fsdp_master_dtype])
        model.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.world_size > 1 or self.cfg.fsdp_precision_rules:
            from miles_platform.training.fsdp import shard_model

            model = shard_model(model, self.cfg)
        model.train()
        self.module = model
        return model

    def _autocast(self):
        dt = self.cfg.train_forward_dtype
        if dt == "fp32":
            return torch.autocast("cpu", enabled=False)
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=DTYPES[dt])

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        attn = torch.ones_like(input_ids)
        with self._autocast():
            out = self.module(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attn, use_cache=False
            )
        return out.logits

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {}
        for name, t in self.module.state_dict().items():
            if hasattr(t, "full_tensor"):  # DTensor under FSDP2
                t = t.full_tensor()
            sd[name] = t.detach().to("cpu").clone()
        if getattr(self.module.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and self.module.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing={missing} unexpected={unexpected}")

    def save_model(self, ckpt_dir: str) -> None:
        sd = self.export_hf_state_dict()
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(ckpt_dir, "model.safetensors"))

    def load_model(self, ckpt_dir: str) -> None:
        self.load_hf_state_dict(load_file(os.path.join(ckpt_dir, "model.safetensors")))
