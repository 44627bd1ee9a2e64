"""Images on the embedded engine's `/generate` (SGLang's `image_data`), for a vision-language model.

Request shape (SGLang's): `image_data` beside `input_ids` / `text`: for one prompt a list of images
(or one image), for a batch a list with one such entry per prompt (None: no images). An image is a
`data:image/...;base64,` URI, bare base64, or a local path (Miles sends data URIs). The prompt names
each image with one `<|image_pad|>` (expanded here to the image's merged patch count, as SGLang's
processor does) or carries the expanded pads already (as a processor-built prompt does); the answer's
`prompt_tokens` counts the expanded prompt.

Generation: a request with images is generated on the scheduler thread, one token at a time with
the engine's sampler and seeds: a prefill of the prompt with its pixel values (models/vlm.py
`vlm_logits`, the function the trainer scores with), then the text model's KV cache (the vision
tower runs once per request); its `output_token_logprobs` are the text tokens' log-probs, equal to a
full forward's (`core.image_kv_cache = False` runs one per token: the reference). It runs to its end
within one scheduler step (tiny models on the CPU; the batched KV-cache path serves text).
Options the batched path adds (LoRA, sampling masks, top-k log-probs, input scoring, routed experts)
are refused for image requests by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles_platform.rollout.engine_requests import Request, RequestError
from miles_platform.rollout.sampling import draw

if TYPE_CHECKING:
    from miles_platform.rollout.engine_core import EngineCore

# body fields the vision path does not serve (the batched path's extras)
_NOT_WITH_IMAGES = ("lora_path", "return_sampling_mask", "return_routed_experts", "top_logprobs_num",
                    "token_ids_logprob", "logprob_start_len")  # fmt: skip


class VisionPrep:
    """The served checkpoint's image processor and config: turns a request's images into pixel values
    and its prompt's pads into the expanded ones. Thread-safe (parsers call it on their threads)."""

    def __init__(self, model_path: str, hf_config: Any):
        from miles_platform.models.vlm import load_image_processor

        self.processor, self.config = load_image_processor(model_path), hf_config

    def attach(self, reqs: list[Request], body: dict, is_batch: bool, context_length: int) -> None:
        """Set `vision` (and the expanded prompt) of every request that `body["image_data"]` gives images."""
        per_prompt = _per_prompt(body.get("image_data"), len(reqs), is_batch)
        if any(per_prompt):
            extras = [k for k in _NOT_WITH_IMAGES if body.get(k) not in (None, False, 0, -1)]
            if extras:
                raise RequestError(
                    f"image_data with {extras}: not served for image prompts by the embedded engine"
                )
        for r, images in zip(reqs, per_prompt, strict=True):
            if images:
                self._attach_one(r, images, context_length)

    def _attach_one(self, r: Request, images: list, context_length: int) -> None:
        from miles_platform.models.vlm import process_images

        data = [_image_bytes(x, i) for i, x in enumerate(images)]
        try:
            px = process_images(self.processor, data)
        except Exception as e:  # PIL raises many types for a bad image
            raise RequestError(f"image_data: an image does not decode ({type(e).__name__}: {e})") from None
        r.prompt_ids = expand_pads(r.prompt_ids, self.config, px["image_grid_thw"])
        if len(r.prompt_ids) >= context_length:
            raise RequestError(
                f"prompt has {len(r.prompt_ids)} tokens with its images; the context is {context_length}"
            )
        r.max_new_tokens = min(r.params.max_new_tokens, context_length - len(r.prompt_ids))
        r.vision = px


def expand_pads(prompt_ids: list[int], hf_config: Any, grids) -> list[int]:
    """Each image's pad run as its patch count: one `<|image_pad|>` per image (a placeholder), or the
    pads expanded already (a processor-built prompt, an earlier turn); else RequestError."""
    from miles_platform.models.vlm import expand_image_tokens

    try:
        return expand_image_tokens(prompt_ids, hf_config, grids)
    except ValueError as e:
        raise RequestError(f"image_data: {e} (one <|image_pad|> per image, or its pads expanded)") from None


def _per_prompt(value: Any, n: int, is_batch: bool) -> list[list | None]:
    if value is None:
        return [None] * n
    if not is_batch:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != n:
        raise RequestError(
            f"image_data of a batch: a list of {n} entries (one per prompt), got {type(value).__name__}"
        )
    return [v if isinstance(v, list) or v is None else [v] for v in value]


def _image_bytes(value: Any, i: int) -> bytes:
    from miles_platform.data.images import from_data_uri

    if not isinstance(value, str) or not value:
        raise RequestError(f"image_data[{i}]: a data URI, base64 or a path, got {type(value).__name__}")
    if value.startswith("data:") or not Path(value).is_file():
        try:
            return from_data_uri(value)
        except ValueError:
            raise RequestError(f"image_data[{i}]: not a data URI, base64 or an existing file") from None
    return Path(value).read_bytes()


@torch.no_grad()
def generate_with_images(core: EngineCore, reqs: list[Request]) -> None:
    """Generate each image request to its end with the engine's sampler: one prefill of the prompt
    with its pixel values (the vision tower runs once), then one token at a time through the text
    model's KV cache (`core.image_kv_cache`, default on); off, a full forward of the prefix per
    token (`vlm_logits`, the trainer's function: the reference the cached path is tested against)."""
    for r in reqs:
        r.version_start = core._version_of(r)
        px = r.vision["pixel_values"].to(core.device, core.dtype)
        grid = r.vision["image_grid_thw"].to(core.device)
        steps = _cached_logits(core, r, px, grid) if getattr(core, "image_kv_cache", True) else _full_logits(
            core, r, px, grid
        )  # fmt: skip
        p = r.params
        for logits in steps:
            core.stats["num_forward_calls"] += 1
            d = draw(logits, [p.temperature], [p.top_p], [p.top_k], [p.min_p], [r.seed], [r.position])
            r.output_ids.append(d.tokens[0])
            r.logprobs.append(d.logprobs[0])
            core.stats["num_generated_tokens"] += 1
            reason = core._finish_reason(r, d.tokens[0])
            if reason:
                core._finish(r, reason)
                break


def _full_logits(core: EngineCore, r: Request, px, grid):
    """The next token's logits (1, V) of `r`'s prefix, a full forward each time it is asked."""
    from miles_platform.models.vlm import vlm_logits

    while True:
        ids = torch.tensor([r.prompt_ids + r.output_ids], device=core.device)
        yield vlm_logits(core.model, ids, px, grid)[:, -1].float()


def _cached_logits(core: EngineCore, r: Request, px, grid):
    """The same logits through a KV cache: the prompt's forward with pixel values (the model
    computes its M-RoPE positions and `rope_deltas`), then each sampled token alone, at text
    positions shifted by those deltas (restored before every step: the model keeps them as state).
    A sampled `<|image_pad|>` enters as `<|vision_end|>`, as `vlm_logits` masks it."""
    from transformers import DynamicCache

    from miles_platform.models.vlm import vlm_logits

    model, cfg = core.model, core.model.config
    cache = DynamicCache(config=cfg.get_text_config())
    ids = torch.tensor([r.prompt_ids], device=core.device)
    logits = vlm_logits(model, ids, px, grid, cache=cache)
    deltas = model.model.rope_deltas
    yield logits[:, -1].float()
    while True:
        tok = r.output_ids[-1]
        tok = cfg.vision_end_token_id if tok == cfg.image_token_id else tok
        model.model.rope_deltas = deltas
        out = model(input_ids=torch.tensor([[tok]], device=core.device), cache=cache, use_cache=True)
        yield out.logits[:, -1].float()
