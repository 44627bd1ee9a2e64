"""Embedded, external and SGLang engines stand in for one another: a weight transport they cannot
take is refused before anything starts."""

from __future__ import annotations

import pytest
from loop_helpers import small_run_config

from miles_platform.config import ConfigError
from miles_platform.loop import validate_before_start


@pytest.mark.parametrize("mode", ["tensor", "mooncake"])
@pytest.mark.parametrize(
    "engines, named",
    [({"rollout_engine": "sglang"}, "--rollout-engine sglang"),
     ({"rollout_external_engine_addrs": ["127.0.0.1:1"]}, "--rollout-external-engine-addrs")],
)  # fmt: skip
def test_actor_only_transport_refused_for_http_engines(tiny_hf_checkpoint, tmp_path, mode, engines, named):
    """`tensor` / `mooncake` load weights through the embedded engine's Ray actor; SGLang's actor has
    no such method (an AttributeError at the first update) and external engines have no actor."""
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, **engines)
    with pytest.raises(ConfigError, match=f"--update-weight-transfer-mode {mode}.*{named}") as e:
        validate_before_start(cfg)
    assert "disk-delta" in str(e.value) and "--rollout-engine embedded" in str(e.value)
    # HTTP transports are fine for them, and no transport runs without trainers or without engines
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode="disk", **engines)
    )
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, debug_rollout_only=True,
                         **engines)
    )  # fmt: skip
