"""The tiny Qwen3-VL (models/vlm.py): built and saved by the project, loaded through the checkpoint
path every family takes, images change the text logits, megatron refuses it by name."""

from __future__ import annotations

import io
import json

import pytest


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from miles_platform.models.vlm import save_tiny_vlm_checkpoint

    return save_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm") / "tiny-vl")


def _png(seed: int, size=(20, 28)) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def test_tiny_vlm_loads_and_sees_its_image(tiny_vlm):
    import torch

    from miles_platform.models import vlm
    from miles_platform.models.checkpoint import load_hf_checkpoint, validate_hf_dir

    cfg = validate_hf_dir(tiny_vlm)
    assert cfg["architectures"] == ["Qwen3VLForConditionalGeneration"]
    model, tok = load_hf_checkpoint(tiny_vlm)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and vlm.is_vlm_config(model.config)
    proc = vlm.load_image_processor(tiny_vlm)
    ids = tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}How many shapes?")["input_ids"]
    a, b = (vlm.vision_inputs(ids, [_png(s)], proc, model.config) for s in (0, 1))
    assert a.image_grid_thw.tolist() == [[1, 2, 2]]  # any size -> 32x32 -> 2x2 patches -> 1 merged token
    x = torch.tensor([a.input_ids])
    with torch.no_grad():
        la = vlm.vlm_logits(model, x, a.pixel_values, a.image_grid_thw)
        la2 = vlm.vlm_logits(model, x, a.pixel_values, a.image_grid_thw)
        lb = vlm.vlm_logits(model, x, b.pixel_values, b.image_grid_thw)
    assert torch.equal(la, la2)  # stateless: no rope deltas carried between calls
    assert (la[0, -1] - lb[0, -1]).abs().max() > 1e-4  # the text tokens after the image see it


def test_image_pads_must_match_images(tiny_vlm):
    from miles_platform.models import vlm
    from miles_platform.models.checkpoint import load_hf_checkpoint

    model, tok = load_hf_checkpoint(tiny_vlm)
    proc = vlm.load_image_processor(tiny_vlm)
    ids = tok("no image here")["input_ids"]
    with pytest.raises(ValueError, match="0 image placeholder"):
        vlm.vision_inputs(ids, [_png(0)], proc, model.config)


def test_megatron_refuses_vlm_by_name(tiny_vlm):
    from miles_platform.errors import CheckpointError
    from miles_platform.models.bridge import get_bridge

    cfg = json.loads((__import__("pathlib").Path(tiny_vlm) / "config.json").read_text())
    with pytest.raises(CheckpointError, match="Qwen3VLForConditionalGeneration.*vision-language"):
        get_bridge(cfg)
