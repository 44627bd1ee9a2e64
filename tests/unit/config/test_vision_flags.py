"""--multimodal-keys and --freeze-vision-tower (config/vision.py): refused where they have no effect."""

from __future__ import annotations

import json

import pytest

from miles_platform.config import RunConfig
from miles_platform.config.vision import check_vision_checkpoint
from miles_platform.errors import ConfigError

KEYS = '{"image": "images"}'
BATCH = dict(rollout_batch_size=2, global_batch_size=2)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(lora_rank=4), "LoRA"),
        (dict(train_backend="megatron"), "--train-backend megatron"),
        (dict(advantage_estimator="ppo"), "--advantage-estimator ppo"),
        (dict(multimodal_keys='{"audio": "clips"}'), "video and audio are not"),
    ],
)
def test_multimodal_keys_refused_where_not_built(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        RunConfig(**{"multimodal_keys": KEYS, **BATCH, **kw}).validate()


def test_vision_flags_need_a_vision_language_checkpoint(tiny_hf_checkpoint):
    hf = json.loads(open(f"{tiny_hf_checkpoint}/config.json").read())
    for kw in (dict(multimodal_keys=KEYS), dict(freeze_vision_tower=True)):
        cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, **BATCH, **kw).validate()
        with pytest.raises(ConfigError, match=r"Qwen3ForCausalLM.*not a vision-language model"):
            check_vision_checkpoint(cfg, hf)
    check_vision_checkpoint(cfg, {"architectures": ["Qwen3VLForConditionalGeneration"]})  # a VLM passes
