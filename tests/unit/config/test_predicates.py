"""RunConfig's named predicates say what the flags mean, in one place (config/<capability>.py)."""

import pytest

from miles_platform.config import RunConfig


@pytest.mark.parametrize(
    ("flags", "predicate", "expected"),
    [
        ({}, "uses_lora", False),
        ({"lora_rank": 8}, "uses_lora", True),
        ({"lora_rank": 8}, "syncs_lora_adapter", True),
        ({"lora_rank": 8, "lora_train_only": True}, "syncs_lora_adapter", False),
        ({"lora_train_only": True}, "syncs_lora_adapter", False),
        ({}, "embedded_engines_only", True),
        ({"rollout_engine": "sglang"}, "embedded_engines_only", False),
        ({"rollout_external_engine_addrs": ["h:1"]}, "embedded_engines_only", False),
        ({"use_opd": True, "opd_type": "sglang"}, "uses_teacher_engine", True),
        ({"use_opd": True, "opd_type": "sglang"}, "uses_trainer_teacher", False),
        ({"use_opd": True, "opd_type": "megatron"}, "uses_trainer_teacher", True),
        ({"opd_type": "megatron"}, "uses_trainer_teacher", False),
        ({"update_weight_transfer_mode": "disk-delta"}, "uses_disk_delta", True),
        ({"update_weight_transfer_mode": "disk"}, "uses_disk_delta", False),
        ({"advantage_estimator": "ppo"}, "uses_critic", True),
        ({"advantage_estimator": "ppo", "loss_type": "sft_loss"}, "uses_critic", False),
        ({}, "uses_critic", False),
        ({"use_kl_loss": True}, "uses_reference_model", True),
        ({"kl_coef": 0.1}, "uses_reference_model", True),
        ({}, "uses_reference_model", False),
    ],
)
def test_predicate(flags, predicate, expected):
    assert bool(getattr(RunConfig(rollout_batch_size=2, **flags), predicate)) is expected
