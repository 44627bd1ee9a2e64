"""Torch-native backend: the HF model itself; FSDP2 (`fully_shard`) when world_size > 1.

With --lora-rank > 0 the model is PEFT-wrapped (training/lora.py): only the adapter trains, the
checkpoint holds the adapter and names the base by content hash, and engines get the adapter only.

The model is loaded (and LoRA-wrapped) on the CPU, then moved to the rank's `device`; a forward below
fp32 (`--train-forward-dtype bf16`, the default on CUDA) is sharded by the precision plan even at world
size 1, so the family's aligned rules (training/precision.py) hold on one GPU as on many."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable

import torch
from safetensors.torch import load_file, save_file

from miles_platform.training.backend import ModelBackend, ScoreRequest, Scores, scores_from_logits
from miles_platform.training.precision import DTYPES
from miles_platform.weights.quantize import load_dense_hf_model


class FSDPBackend(ModelBackend):
    name = "fsdp"

    def build(self, hf_checkpoint: str, trainable: bool = True) -> torch.nn.Module:
        model = load_dense_hf_model(hf_checkpoint, dtype=DTYPES[self.cfg.fsdp_master_dtype])
        model.config.use_cache = False
        self._vision = None  # a vision-language model: its image processor (models/vlm.py PromptVision)
        from miles_platform.models.vlm import PromptVision, is_vlm_config, set_vision_trainable

        if is_vlm_config(model.config):
            self._vision = PromptVision(hf_checkpoint)
            if trainable and self.cfg.freeze_vision_tower:  # --freeze-vision-tower: the text model trains
                set_vision_trainable(model, False)
        from miles_platform.training.qat import maybe_apply_int4_qat

        rollout_ckpt = getattr(self.cfg, "hf_checkpoint", None) or hf_checkpoint
        self.int4_qat_modules = maybe_apply_int4_qat(model, rollout_ckpt)  # actor and reference
        self.lora = trainable and self.cfg.uses_lora
        if self.cfg.moe_router_freeze_gate or self.cfg.moe_router_dtype:
            from miles_platform.models.moe import route_in_fp32, routers

            if self.cfg.moe_router_dtype == "fp32":  # the gates compute in fp32 under any forward dtype
                route_in_fp32(model)
            for r in routers(model):
                if self.cfg.moe_router_dtype == "fp32":  # router weights in fp32 whatever --fsdp-master-dtype
                    r.to(torch.float32)
                if trainable and self.cfg.moe_router_freeze_gate:  # routers stay as loaded
                    r.requires_grad_(False)
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.lora:
            from miles_platform.training.lora import wrap_model

            if self.cfg.gradient_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings: recompute needs a grad path
            model = wrap_model(model, self.cfg)
        model.to(self.device)
        if self.world_size > 1 or self.cfg.fsdp_precision_rules or self._compute_dtype() != "fp32":
            from miles_platform.training.fsdp import shard_model

            model = shard_model(model, self.cfg)
        model.train()
        self.module = model
        from miles_platform.training.shared_prefix import model_shares_prefixes

        self.shares_prefixes = self._vision is None and model_shares_prefixes(model.config)
        return model

    def _compute_dtype(self) -> str:
        return self.cfg.train_forward_dtype  # resolved for the device (ModelBackend.__init__)

    def _autocast(self):
        dt, kind = self._compute_dtype(), self.device.type
        if kind not in ("cpu", "cuda"):  # a test's fake device (tests/device_check.py): fp32 only
            if dt != "fp32":
                raise ValueError(f"--train-forward-dtype {dt}: no autocast on device {self.device}")
            return contextlib.nullcontext()
        if dt == "fp32":
            return torch.autocast(kind, enabled=False)
        return torch.autocast(kind, dtype=DTYPES[dt])

    def score(self, req: ScoreRequest) -> Scores:
        """A micro-batch with images (a vision-language model): scored through models/vlm.py
        `vlm_logits`, as the engine scored it; samples of one length whose image pads match their
        images share a forward, the others get their own; logits padded to the micro-batch width."""
        if req.images is None:
            return super().score(req)
        from miles_platform.models.vlm import grouped_vlm_logits

        with req.context(), self._autocast():
            rows = grouped_vlm_logits(
                self.module, self._vision, req.input_ids, req.images, req.lengths, self.device
            )
        width = req.input_ids.shape[1]
        return scores_from_logits(
            torch.stack([torch.nn.functional.pad(z, (0, 0, 0, width - z.shape[0])) for z in rows]), req
        )

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        attn = torch.ones_like(input_ids)
        with self._autocast():
            out = self.module(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attn, use_cache=False
            )
        return out.logits

    def packed_logits(self, packed) -> torch.Tensor:
        with self._autocast():  # sdpa takes the boolean 4D mask as is (True: attend)
            out = self.module(
                input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=packed.keep,
                use_cache=False,
            )  # fmt: skip
        return out.logits

    def _full_state(self, keep=lambda name: True) -> dict[str, torch.Tensor]:
        sd = {}
        for name, t in self.module.state_dict().items():
            if not keep(name):
                continue
            if hasattr(t, "full_tensor"):  # DTensor under FSDP2
                t = t.full_tensor()
            sd[name] = t.detach().to("cpu").clone()
        return sd

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy under HF names; for LoRA the merged weights (base + scale * B @ A)."""
        if self.lora:
            from miles_platform.training.lora import merged_state_dict

            return merged_state_dict(self.export_base_state_dict(), *self.export_adapter())
        sd = self._full_state()
        if getattr(self.module.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    # ---- LoRA ---------------------------------------------------------------------------------
    def export_base_state_dict(self) -> dict[str, torch.Tensor]:
        """The frozen base under HF names (the PEFT wrapper's `base_layer` dropped)."""
        from miles_platform.training.lora import is_adapter_param

        sd = {}
        for name, t in self._full_state(lambda n: not is_adapter_param(n)).items():
            sd[re.sub(r"(\.base_layer)+\.", ".", name.removeprefix("base_model.model."))] = t
        if getattr(self.module.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd

    def export_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(lora_A / lora_B tensors under PEFT's file keys, adapter_config.json): what engines get."""
        from miles_platform.training.lora import adapter_config_dict, adapter_key, is_adapter_param

        state = {adapter_key(n): t for n, t in self._full_state(is_adapter_param).items()}
        return state, adapter_config_dict(self.module)

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        from miles_platform.training.lora import ADAPTER_NAME, is_adapter_param

        names = {n for n in self.module.state_dict() if is_adapter_param(n)}
        full = {k.replace(".lora_A.", f".lora_A.{ADAPTER_NAME}.").replace(".lora_B.", f".lora_B.{ADAPTER_NAME}."): v
                for k, v in state.items()}  # fmt: skip
        if set(full) != names:
            raise ValueError(
                f"adapter mismatch: missing {sorted(names - set(full))[:3]} unexpected {sorted(set(full) - names)[:3]}"
            )
        _, unexpected = self.module.load_state_dict(full, strict=False)
        if unexpected:
            raise ValueError(f"adapter mismatch: unexpected {unexpected[:3]}")

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora:
            raise ValueError("a LoRA trainer loads adapters (load_adapter), not full HF weights")
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and self.module.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing={missing} unexpected={unexpected}")

    def save_model(self, ckpt_dir: str) -> None:
        self.snapshot_model(copy=False)(ckpt_dir)

    def snapshot_model(self, copy: bool = True) -> Callable[[str], None]:
        """`save_model` in two halves (--async-save): the gathers now (collective), into copies the
        training steps do not touch (`copy`); the returned writer only writes files (any thread)."""
        own = (lambda v: v.detach().clone().contiguous()) if copy else (lambda v: v.contiguous())
        if self.lora:  # the adapter only; the base is named by content hash, never copied
            from miles_platform.training.lora import adapter_writer

            return adapter_writer(*self.export_adapter(), self.cfg.hf_checkpoint, self.rank, copy)
        sd = self.export_hf_state_dict()
        sd = {k: own(v) for k, v in sd.items()} if self.rank == 0 else {}

        def write_model(ckpt_dir: str) -> None:
            if self.rank == 0:
                save_file(sd, os.path.join(ckpt_dir, "model.safetensors"))

        return write_model

    def load_model(self, ckpt_dir: str) -> None:
        if self.lora:
            from miles_platform.training.lora import read_checkpoint_adapter

            self.load_adapter(read_checkpoint_adapter(ckpt_dir, self.cfg.hf_checkpoint))
            return
        self.load_hf_state_dict(load_file(os.path.join(ckpt_dir, "model.safetensors")))
