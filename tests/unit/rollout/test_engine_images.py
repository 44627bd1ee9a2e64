"""SGLang's `image_data` on the embedded engine's `/generate` (rollout/engine_vlm.py), over real HTTP on
loopback: the request shape, text-token log-probs equal to the trainer's forward, refusals by name."""

from __future__ import annotations

import httpx
import pytest
import torch
from loop_helpers import square_image_uri

from miles_platform.models import vlm


def _uri(color) -> str:
    return square_image_uri(color, 24, (4, 4, 16, 16))


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.rollout.engine_server import start_engine_server

    torch.set_num_threads(1)
    path = vlm.save_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-vl")
    srv = start_engine_server(path)
    yield srv, path, *load_hf_checkpoint(path)
    srv.stop()


def _post(url, body, status=200):
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _teacher_forced(model, path, ids, image, start):
    proc = vlm.load_image_processor(path)
    from miles_platform.data.images import from_data_uri

    px = vlm.process_images(proc, [from_data_uri(image)])
    with torch.no_grad():
        logits = vlm.vlm_logits(model, torch.tensor([ids]), px["pixel_values"], px["image_grid_thw"])
    return vlm.token_logprobs(logits, torch.tensor([ids]), start)


def test_image_data_generate_logprobs_match_the_trainer_forward(vl_engine):
    srv, path, model, tok = vl_engine
    prompt = tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}How many shapes?")["input_ids"]
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    sp = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7}
    out = _post(
        srv.url, {"input_ids": prompt, "image_data": [red], "sampling_params": sp, "return_logprob": True}
    )
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt)  # 32x32 -> one merged token: the single pad stays one
    assert meta["completion_tokens"] == 6 and meta["weight_version_start"] == meta["weight_version_end"] == 0
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    ids = prompt + out["output_ids"]
    ref = _teacher_forced(model, path, ids, red, len(prompt))
    assert torch.allclose(torch.tensor([lp for lp, _, _ in lps]), ref, atol=1e-4)
    assert (ref - _teacher_forced(model, path, ids, blue, len(prompt))).abs().max() > 1e-5  # the image counts
    again = _post(
        srv.url, {"input_ids": prompt, "image_data": red, "sampling_params": sp, "return_logprob": True}
    )
    assert again["output_ids"] == out["output_ids"]  # one image may be given bare; seeded draws repeat

    # a batch: image_data per prompt (None: text only, the batched path), text prompts too
    text = f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}How many?"
    batch = _post(srv.url, {"text": [text, "How many?"], "image_data": [[blue], None], "sampling_params": sp,
                            "return_logprob": True})  # fmt: skip
    assert [len(b["output_ids"]) for b in batch] == [6, 6]
    ids = tok(text)["input_ids"] + batch[0]["output_ids"]
    ref = _teacher_forced(model, path, ids, blue, len(ids) - 6)
    assert torch.allclose(torch.tensor([lp for lp, _, _ in batch[0]["meta_info"]["output_token_logprobs"]]), ref,
                          atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"image_data": [_uri((9, 9, 9)), _uri((1, 1, 1))]}, "1 image placeholder(s) for 2 image(s)"),
        ({"image_data": ["data:image/png;base64,aGVsbG8="]}, "an image does not decode"),
        ({"image_data": [_uri((9, 9, 9))], "lora_path": "a"}, "['lora_path']: not served for image prompts"),
        ({"image_data": [[_uri((9, 9, 9))]] * 2}, "image_data[0]: a data URI"),
    ],
)
def test_bad_image_requests_are_400(vl_engine, extra, needle):
    srv, _, _, tok = vl_engine
    prompt = tok(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}?")["input_ids"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, **extra}
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.text, r.text
    assert srv.core.is_alive()


def test_a_text_model_refuses_image_data(tiny_hf_checkpoint):
    from miles_platform.models.checkpoint import load_tokenizer
    from miles_platform.rollout.engine_requests import RequestError, RequestParser

    parser = RequestParser(load_tokenizer(tiny_hf_checkpoint), 256, 128)
    with pytest.raises(RequestError, match="not a vision-language model"):
        parser.parse_body({"input_ids": [1, 2], "image_data": [_uri((1, 2, 3))]})
