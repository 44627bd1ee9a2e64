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


def test_qwen2_5_vl_takes_the_same_path():
    """A Qwen2.5-VL (14-pixel patches, windowed ViT) runs through the same input path and forward."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from miles_platform.models import vlm
    from miles_platform.models.families import build_model

    tok = vlm.build_vlm_tokenizer(["a b c <image> 1 2"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in vlm.VISION_TOKENS}
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=32,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[vlm.IMAGE_PAD], video_token_id=ids[vlm.VIDEO_PAD],
        vision_start_token_id=ids[vlm.VISION_START], vision_end_token_id=ids[vlm.VISION_END],
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )  # fmt: skip
    model = build_model(cfg)
    assert vlm.is_vlm_config(model.config)
    proc = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28,
                                    max_pixels=56 * 56)  # fmt: skip
    prompt = tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}hi")["input_ids"]
    outs = []
    for seed in (0, 1):
        vi = vlm.vision_inputs(prompt, [_png(seed)], proc, model.config)
        with torch.no_grad():
            outs.append(
                vlm.vlm_logits(model, torch.tensor([vi.input_ids]), vi.pixel_values, vi.image_grid_thw)
            )
    assert outs[0].shape == (1, len(vi.input_ids), len(tok))
    assert (outs[0][0, -1] - outs[1][0, -1]).abs().max() > 1e-4


def test_a_sampled_image_pad_in_the_response_scores(tiny_vlm):
    """A response that sampled `<|image_pad|>` (more pads than images) still scores, as the same
    input for engine and trainer; the positions before it are unchanged (causal)."""
    import torch

    from miles_platform.models import vlm
    from miles_platform.models.checkpoint import load_hf_checkpoint

    model, tok = load_hf_checkpoint(tiny_vlm)
    proc = vlm.load_image_processor(tiny_vlm)
    vi = vlm.vision_inputs(tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}?")["input_ids"], [_png(0)], proc,
                           model.config)  # fmt: skip
    ids = torch.tensor([vi.input_ids + [model.config.image_token_id, 5]])
    with torch.no_grad():
        full = vlm.vlm_logits(model, ids, vi.pixel_values, vi.image_grid_thw)
        head = vlm.vlm_logits(model, ids[:, :-2], vi.pixel_values, vi.image_grid_thw)
        text = vlm.vlm_logits(model, torch.tensor([[5, model.config.image_token_id, 6]]), None, None)
    assert torch.allclose(full[0, :-2], head[0], atol=1e-5) and text.shape == (1, 3, len(tok))


def test_grouped_logits_batch_equal_lengths_and_equal_one_forward_each(tiny_vlm):
    """grouped_vlm_logits: samples of one length share a forward (different images, one text
    sample, one with a sampled image pad beside them) and each equals its own vlm_logits."""
    import torch

    from miles_platform.data.images import to_data_uri
    from miles_platform.models import vlm
    from miles_platform.models.checkpoint import load_hf_checkpoint

    model, tok = load_hf_checkpoint(tiny_vlm)
    pv = vlm.PromptVision(tiny_vlm)
    prompt = tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}?")["input_ids"]
    uris = [[to_data_uri(_png(s))] for s in range(3)] + [None]
    rows = [pv.expand(prompt, u) + [5, 6] for u in uris[:2]]
    rows.append(pv.expand(prompt, uris[2]) + [model.config.image_token_id, 6])  # a sampled pad: alone
    rows.append([7] * len(rows[0]))  # a text sample
    ids = torch.tensor(rows)
    lengths = [ids.shape[1]] * 4
    with torch.no_grad():
        got = vlm.grouped_vlm_logits(model, pv, ids, uris, lengths)
        for i, u in enumerate(uris):
            px = pv.pixels(u) if u else {"pixel_values": None, "image_grid_thw": None}
            want = vlm.vlm_logits(model, ids[i : i + 1], px["pixel_values"], px["image_grid_thw"])[0]
            assert torch.allclose(got[i], want, atol=1e-5), i
    assert not torch.allclose(got[0], got[1], atol=1e-4)  # each row saw its own image


def test_prompt_vision_keeps_each_images_pixels_as_the_processor_gives_them(tiny_vlm):
    """The trainer's and the rollout's PromptVision: an image seen before is not preprocessed again
    (~40% of the tiny VLM's SFT step was that), the result equals the processor's for any mix of
    new and kept images, and the least recently used images go past the byte budget."""
    import torch

    from miles_platform.data.images import to_data_uri
    from miles_platform.models.vlm import PromptVision, process_images

    uris = [to_data_uri(_png(s)) for s in range(4)]
    v = PromptVision(tiny_vlm)
    calls = []
    real = v.processor.__call__
    v.processor = lambda **kw: calls.append(len(kw["images"])) or real(**kw)
    for group in ([uris[0]], uris[:3], uris[1:], [uris[3], uris[0]]):
        got = v.pixels(group)
        want = process_images(real.__self__, [_png(s) for s in (uris.index(u) for u in group)])
        assert torch.equal(got["pixel_values"], want["pixel_values"]), group
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"]), group
    assert calls == [1, 1, 1, 1]  # each of the 4 images preprocessed once
    one = got["pixel_values"].numel() * 4 // 2  # bytes of one image (2 in the last group)
    small = PromptVision(tiny_vlm, cache_bytes=2 * one)
    for u in uris[:3]:
        small.pixels([u])
    assert list(small._kept) == uris[1:3]  # the oldest went: 2 images' bytes kept
