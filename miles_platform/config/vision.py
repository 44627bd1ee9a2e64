"""Vision-language runs (docs/vlm.md): Miles' --multimodal-keys (the dataset key of each row's
images) and our --freeze-vision-tower (Miles has none: its fsdp backend trains the whole model).
What needs the checkpoint (a Qwen-VL family, models/families.py VLM_FAMILIES) is checked by preflight."""

from __future__ import annotations

from dataclasses import dataclass

from miles_platform.config.flags import flag
from miles_platform.errors import ConfigError


@dataclass
class VisionFlags:
    multimodal_keys: str | None = flag(
        None, "rollout",
        'JSON object of media type -> dataset key, e.g. \'{"image": "images"}\' (Miles\'): each row\'s images '
        "(bytes, paths or data URIs), one <image> placeholder each in the prompt; a Qwen-VL --hf-checkpoint",
    )  # fmt: skip
    freeze_vision_tower: bool = flag(
        False, "algorithm",
        "a vision-language model's vision tower (ViT + merger) is not trained; the text model is (not a "
        "Miles flag: Miles' fsdp backend trains the whole model, as this build does without it)",
    )  # fmt: skip

    def image_keys(self) -> dict[str, str] | None:
        from miles_platform.data.images import parse_multimodal_keys

        return parse_multimodal_keys(self.multimodal_keys)

    def _check_vision_flags(self) -> None:
        if not self.image_keys():
            return
        blocked = [
            ("LoRA (--lora-rank)", self.uses_lora),
            ("SFT rollouts", self.uses_sft_rollout),
            ("--data-source-path (the class reads its own data)", bool(self.data_source_path)),
            ("top-p / top-k sampling-support replay", self.sampling_support_replay()),
            (
                "score centering's candidates (--rollout-top-logprobs-num)",
                bool(self.rollout_top_logprobs_num),
            ),
            ("--use-rollout-routing-replay", self.use_rollout_routing_replay),
            ("on-policy distillation with a teacher engine", self.uses_teacher_engine),
            ("--train-backend megatron (no vision-language bridge)", self.train_backend == "megatron"),
            ("--advantage-estimator ppo (the critic reads no images)", self.advantage_estimator == "ppo"),
        ]
        bad = [what for what, on in blocked if on]
        if bad:
            raise ConfigError(
                f"--multimodal-keys {self.multimodal_keys}: image prompts are not built with {', '.join(bad)}"
            )


def check_vision_checkpoint(cfg, hf_config: dict) -> None:
    """--multimodal-keys / --freeze-vision-tower need a vision-language --hf-checkpoint (preflight)."""
    from miles_platform.models.vlm import is_vlm_config

    given = [f for f, on in (("--multimodal-keys", bool(cfg.multimodal_keys)),
                             ("--freeze-vision-tower", cfg.freeze_vision_tower)) if on]  # fmt: skip
    if given and not is_vlm_config(hf_config):
        raise ConfigError(
            f"{', '.join(given)}: --hf-checkpoint {cfg.hf_checkpoint} is {hf_config.get('architectures')}, not a "
            "vision-language model (Qwen3VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)"
        )
