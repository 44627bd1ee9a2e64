"""Vision-language models: the tiny Qwen3-VL the project builds, and the one input path every
Qwen-VL checkpoint (Qwen3-VL, Qwen2.5-VL) takes through the engine and the trainer.

A prompt names its images with Miles' `<image>` placeholder (`--multimodal-keys`, data/images.py);
`expand_image_tokens` turns each into `<|vision_start|>` + one `<|image_pad|>` per merged patch +
`<|vision_end|>`, the layout HF's Qwen-VL processors and SGLang build. The image processor is
transformers' own (`preprocessor_config.json` of the checkpoint; the PIL backend, so torchvision is
not needed); the full processor class is not used because it wants a video processor (torchvision).

The forward (`vlm_forward`) passes `mm_token_type_ids` and no cache, so the model computes its
multimodal rope positions from the ids every call: the engine and the trainer run the same function
on the same ids and pixels, which is what keeps their log-probs equal.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_platform.data.images import IMAGE_PLACEHOLDER

if TYPE_CHECKING:
    import torch
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# the tiny model's images: 32x32 RGB -> a 2x2 grid of 16-pixel patches -> 1 merged token (merge 2)
TINY_IMAGE_SIZE = 32


def is_vlm_config(hf_config: Any) -> bool:
    from miles_platform.models.families import VLM_FAMILIES, family_of

    fam = family_of(hf_config)
    return fam is not None and fam.name in VLM_FAMILIES


def decode_image(data: bytes):
    """PIL RGB image of encoded bytes (PNG, JPEG, ...)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def build_vlm_tokenizer(corpus: list[str], vocab_size: int = 160):
    """The project's byte-level BPE (models/tokenizer.py) plus the Qwen-VL vision tokens."""
    from miles_platform.models.tokenizer import train_tokenizer

    tok = train_tokenizer(corpus, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tok


def build_image_processor(size: int = TINY_IMAGE_SIZE):
    """Qwen-VL's image processor for small images: 16-pixel patches, 2x2 merge, every image resized
    to `size` x `size` pixels (min = max pixels), normalized to [-1, 1]."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=size * size, max_pixels=size * size,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip


def tiny_vlm_config(tokenizer, **text_overrides):
    """A tiny Qwen3-VL: a 2-layer 32-wide vision tower (one deepstack layer) and a 2-layer text model."""
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
    )  # fmt: skip
    text.update(text_overrides)
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )  # fmt: skip
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, architectures=["Qwen3VLForConditionalGeneration"],
    )  # fmt: skip


def save_tiny_vlm_checkpoint(
    path, corpus: list[str] | None = None, seed: int = 0, image_size: int = TINY_IMAGE_SIZE
) -> str:
    """A random tiny Qwen3-VL + tokenizer + image processor config (images resized to `image_size`
    square: 32 -> one merged image token, 64 -> four), saved as an HF dir (< 2 s)."""
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.families import build_model

    corpus = corpus or [f"How many shapes are in {IMAGE_PLACEHOLDER}? {n}" for n in range(10)]
    tok = build_vlm_tokenizer(corpus)
    model = build_model(tiny_vlm_config(tok), seed=seed)
    dest = save_hf_checkpoint(model, tok, path, extra=build_image_processor(image_size))
    return str(dest)


def load_image_processor(path):
    """The checkpoint's image processor (preprocessor_config.json), PIL backend."""
    import json
    from pathlib import Path

    from miles_platform.errors import CheckpointError

    cfg_file = Path(path) / "preprocessor_config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"HF checkpoint {path}: a vision-language model needs preprocessor_config.json")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads(cfg_file.read_text())
    keep = ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels", "image_mean",
            "image_std", "size", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")  # fmt: skip
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k in keep and v is not None})


@dataclass
class VisionInputs:
    """One sequence's model inputs: ids with the image pads expanded, and the processor's outputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor  # (patches, channels * temporal * patch * patch)
    image_grid_thw: torch.Tensor  # (images, 3)


def expand_image_tokens(prompt_ids: list[int], hf_config, grids) -> list[int]:
    """Each image's `<|image_pad|>` run (in order) as its merged patch count: a run of one pad (the
    placeholder) is repeated, a run of the count already (expanded before, e.g. an earlier turn of
    a multi-turn trajectory) is kept. A prompt with fewer or more pad runs than images, or a run of
    another length, is refused."""
    pad = hf_config.image_token_id
    merge = hf_config.vision_config.spatial_merge_size
    counts = [int(g.prod()) // (merge * merge) for g in grids]
    runs = [i for i, t in enumerate(prompt_ids) if t == pad and (i == 0 or prompt_ids[i - 1] != pad)]
    if len(runs) != len(counts):
        raise ValueError(f"the prompt has {len(runs)} image placeholder(s) for {len(counts)} image(s)")
    out, i, k = [], 0, 0
    while i < len(prompt_ids):
        if prompt_ids[i] != pad:
            out.append(prompt_ids[i])
            i += 1
            continue
        n = 1
        while i + n < len(prompt_ids) and prompt_ids[i + n] == pad:
            n += 1
        if n not in (1, counts[k]):
            raise ValueError(
                f"image {k}: a run of {n} image pads; its image is 1 placeholder or {counts[k]} pads"
            )
        out.extend([pad] * counts[k])
        i, k = i + n, k + 1
    return out


def process_images(image_processor, images: list[bytes]) -> dict:
    """pixel_values and image_grid_thw of encoded images (the checkpoint's image processor)."""
    out = image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def vision_inputs(prompt_ids: list[int], images: list[bytes], image_processor, hf_config) -> VisionInputs:
    """The prompt's ids with each image's pads expanded, and its pixel values and grid."""
    px = process_images(image_processor, images)
    ids = expand_image_tokens(list(prompt_ids), hf_config, px["image_grid_thw"])
    return VisionInputs(ids, px["pixel_values"], px["image_grid_thw"])


def vlm_logits(model, input_ids: torch.Tensor, pixel_values, image_grid_thw, cache=None) -> torch.Tensor:
    """Logits of one unpadded sequence (1, L) with its images, positions from the ids. `cache` (an
    empty DynamicCache): filled with the sequence's keys and values (the engine's prefill)."""
    cfg = model.config
    input_ids = _extra_pads_masked(input_ids, cfg, image_grid_thw)
    mm = (input_ids == cfg.image_token_id).to(input_ids.dtype)
    kw: dict[str, Any] = {"mm_token_type_ids": mm}
    if pixel_values is not None:
        kw.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    model.model.rope_deltas = None  # stateless: positions are recomputed from these ids
    if cache is not None:
        kw.update(cache=cache, use_cache=True)
    out = model(input_ids=input_ids, **{"use_cache": False, **kw})
    return out.logits


def grouped_vlm_logits(model, vision: PromptVision, input_ids, images: list, lengths: list[int], device=None):
    """Per sample its logits (n_i, V) of `input_ids[i, :lengths[i]]` with its images (data URIs, or
    None). Samples of one length whose `<|image_pad|>` count is exactly their images' share one
    batched `vlm_logits` forward (pixel values concatenated in row order, as HF's Qwen-VL takes a
    batch); a text sample or one whose response sampled an image pad runs alone."""
    import torch

    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size
    px, groups = [], {}
    for i, (uris, n) in enumerate(zip(images, lengths, strict=True)):
        p = vision.pixels(uris) if uris else {"pixel_values": None, "image_grid_thw": None}
        px.append(p)
        want = 0 if not uris else int(p["image_grid_thw"].prod(-1).sum()) // (merge * merge)
        exact = bool(uris) and int((input_ids[i, :n] == cfg.image_token_id).sum()) == want
        groups.setdefault((n, "batch") if exact else (n, i), []).append(i)
    out: list = [None] * len(lengths)
    for (n, _), rows in groups.items():
        pv = [px[i]["pixel_values"] for i in rows]
        grid = [px[i]["image_grid_thw"] for i in rows]
        pv = None if pv[0] is None else torch.cat(pv).to(device or pv[0].device)
        grid = None if grid[0] is None else torch.cat(grid).to(device or grid[0].device)
        z = vlm_logits(model, input_ids[rows, :n], pv, grid)
        for j, i in enumerate(rows):
            out[i] = z[j]
    return out


def _extra_pads_masked(input_ids: torch.Tensor, cfg, image_grid_thw) -> torch.Tensor:
    """`<|image_pad|>` tokens beyond the images' (a response that sampled one) enter the forward as
    `<|vision_end|>`: HF's model would otherwise refuse the sequence (pads without features). Engine
    and trainer both score through here, so they see the same input."""
    import torch

    merge = cfg.vision_config.spatial_merge_size
    want = 0 if image_grid_thw is None else int(image_grid_thw.prod(-1).sum()) // (merge * merge)
    is_pad = input_ids == cfg.image_token_id
    if int(is_pad.sum()) <= want:
        return input_ids
    extra = is_pad & (is_pad.cumsum(-1) > want)
    return torch.where(extra, torch.full_like(input_ids, cfg.vision_end_token_id), input_ids)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probs of ids[start:] under logits (1, L, V) of the same sequence (fp32)."""
    import torch

    lp = torch.log_softmax(logits[0, start - 1 : -1].float(), dim=-1)
    return lp.gather(-1, ids[0, start:, None]).squeeze(-1)


class PromptVision:
    """A checkpoint's image processor and config, for the rollout side: a prompt's ids with each
    image's pad expanded (the ids the engine generates from and the trainer scores). Each image's
    pixel values are kept (least recently used out past `cache_bytes`): the trainer sees the same
    images every step of an SFT epoch and in every sample of a GRPO group, and preprocessing them
    again was ~40% of the tiny VLM's SFT step (measured 2026-12-06). The processor is deterministic,
    so a kept result is the one it would give again; callers must not write into it."""

    def __init__(self, hf_checkpoint: str, cache_bytes: int = 128 << 20):
        from collections import OrderedDict

        from transformers import AutoConfig

        self.processor = load_image_processor(hf_checkpoint)
        self.config = AutoConfig.from_pretrained(str(hf_checkpoint))
        self._kept: OrderedDict[str, tuple] = OrderedDict()  # data URI -> (pixel_values, grid)
        self._kept_bytes, self._cache_bytes = 0, cache_bytes

    def _one(self, uri: str) -> tuple:
        from miles_platform.data.images import from_data_uri

        got = self._kept.get(uri)
        if got is not None:
            self._kept.move_to_end(uri)
            return got
        px = process_images(self.processor, [from_data_uri(uri)])
        got = (px["pixel_values"], px["image_grid_thw"])
        size = got[0].numel() * got[0].element_size()
        if size <= self._cache_bytes:
            self._kept[uri] = got
            self._kept_bytes += size
            while self._kept_bytes > self._cache_bytes:
                _, (pv, _) = self._kept.popitem(last=False)
                self._kept_bytes -= pv.numel() * pv.element_size()
        return got

    def expand(self, prompt_ids: list[int], image_uris: list[str]) -> list[int]:
        if not image_uris:
            return expand_image_tokens(prompt_ids, self.config, self.pixels([])["image_grid_thw"])
        import torch

        # the grids only: no copy of the kept pixel values
        return expand_image_tokens(prompt_ids, self.config, torch.cat([self._one(u)[1] for u in image_uris]))

    def pixels(self, image_uris: list[str]) -> dict:
        """pixel_values and image_grid_thw of a sample's images (the trainer's batch)."""
        import torch

        if not image_uris:  # what the processor says of no image
            return process_images(self.processor, [])
        kept = [self._one(u) for u in image_uris]
        return {
            "pixel_values": torch.cat([pv for pv, _ in kept]),
            "image_grid_thw": torch.cat([g for _, g in kept]),
        }


def vision_tower(model):
    """The vision tower (ViT + merger) of a Qwen-VL model: `model.model.visual`."""
    inner = getattr(model, "model", model)
    return inner.visual


def set_vision_trainable(model, trainable: bool) -> int:
    """Freeze (or unfreeze) the vision tower; returns how many parameters it has."""
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(trainable)
    return sum(p.numel() for p in params)
