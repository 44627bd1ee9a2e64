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
    # 64-pixel images: four merged tokens each, so expansion is seen (prompt_tokens, the prompt limit)
    path = vlm.save_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-vl", image_size=64)
    srv = start_engine_server(path)
    yield srv, path, *load_hf_checkpoint(path)
    srv.stop()


def _post(url, body, status=200):
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _expanded(tok, ids: list[int]) -> list[int]:
    pad = tok.convert_tokens_to_ids(vlm.IMAGE_PAD)
    return [x for t in ids for x in ([t] * 4 if t == pad else [t])]


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
    assert meta["prompt_tokens"] == len(prompt) + 3  # 64x64 -> four merged tokens for the one pad
    assert meta["completion_tokens"] == 6 and meta["weight_version_start"] == meta["weight_version_end"] == 0
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    prompt = _expanded(tok, prompt)
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
    ids = _expanded(tok, tok(text)["input_ids"]) + batch[0]["output_ids"]
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


CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def test_chat_completions_image_parts_are_image_data(vl_engine, monkeypatch):
    """/v1/chat/completions: an image_url part renders as one pad where it stands and its data URI
    goes to /generate as image_data; the answer equals /generate's on the same prompt and image."""
    srv, path, model, tok = vl_engine
    monkeypatch.setattr(srv.core.tokenizer, "chat_template", CHAT_TEMPLATE)  # a template of its own
    red = _uri((255, 0, 0))
    parts = [{"type": "text", "text": "How many shapes are in"}, {"type": "image_url", "image_url": {"url": red}},
             {"type": "text", "text": "?"}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 5, "seed": 3, "temperature": 1.0,
            "logprobs": True, "return_prompt_token_ids": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, prompt = out["choices"][0], out["choices"][0]["prompt_token_ids"]
    assert tok.decode(prompt).count(vlm.IMAGE_PAD) == 1 and "in<|vision_start|>" in tok.decode(prompt)
    assert out["usage"]["prompt_tokens"] == len(prompt) + 3  # counted with the image's four tokens
    gen = _post(srv.url, {"input_ids": prompt, "image_data": [red], "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3}})  # fmt: skip
    assert choice["token_ids"] == gen["output_ids"]
    lps = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert lps == pytest.approx([lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]], abs=1e-6)
    blue = {**body, "messages": [{"role": "user", "content": [*parts[:1], {"type": "image_url",
            "image_url": {"url": _uri((0, 0, 255))}}, *parts[2:]]}]}  # fmt: skip
    other = httpx.post(f"{srv.url}/v1/chat/completions", json=blue, timeout=60).json()["choices"][0]
    assert [c["logprob"] for c in other["logprobs"]["content"]] != lps  # the image reached the model
    two = {**body, "messages": [{"role": "user", "content": [*parts, parts[1]]}], "n": 2}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=two, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text  # two images, n=2: a batch


def _scored(model, path, s_tokens: list[int], images: list[str], start: int) -> torch.Tensor:
    """Teacher-forced log-probs of s_tokens[start:] with all the images (the trainer's forward)."""
    from miles_platform.data.images import from_data_uri

    px = vlm.process_images(vlm.load_image_processor(path), [from_data_uri(u) for u in images])
    ids = torch.tensor([s_tokens])
    with torch.no_grad():
        return vlm.token_logprobs(
            vlm.vlm_logits(model, ids, px["pixel_values"], px["image_grid_thw"]), ids, start
        )


def test_a_tito_session_with_image_parts_records_its_images(vl_engine):
    """The session server expands each image part's pad, sends every image so far as image_data,
    rolls images back with a retried turn and lists them in the record; the model tokens' log-probs
    equal one forward over the whole session with its two images. A text model's server refuses."""
    import asyncio

    from miles_platform.rollout.chat import ChatError, parse_request
    from miles_platform.rollout.sessions import SessionServer

    srv, path, model, tok = vl_engine
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    server = SessionServer(tok, srv.url, None, vision=vlm.PromptVision(path))
    s = server.create({"temperature": 1.0})
    first = [{"role": "user", "content": [{"type": "text", "text": "How many in"},
                                          {"type": "image_url", "image_url": {"url": red}}]}]  # fmt: skip

    async def episode():
        resp, _ = await server.chat(s, {"messages": first, "max_tokens": 3, "seed": 1})
        second = [*first, resp["choices"][0]["message"],
                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": blue}}]}]  # fmt: skip
        await server.chat(s, {"messages": second, "max_tokens": 3, "seed": 2})
        await server.chat(s, {"messages": second, "max_tokens": 3, "seed": 3})  # a retry: rolled back
        await server.close()

    asyncio.run(episode())
    rec = s.record()
    assert rec["image_data"] == [red, blue] and rec["num_calls"] == 2
    pad = tok.convert_tokens_to_ids(vlm.IMAGE_PAD)
    tokens = rec["prompt_token_ids"] + rec["response_token_ids"]
    assert tokens.count(pad) == 8  # four per image, expanded by the session server
    ref = _scored(model, path, tokens, [red, blue], len(rec["prompt_token_ids"]))
    on = torch.tensor(rec["loss_mask"], dtype=torch.bool)
    assert on.sum() == 6 and torch.allclose(torch.tensor(rec["response_log_probs"])[on], ref[on], atol=1e-4)
    from types import SimpleNamespace

    from miles_platform.data.sample import Sample
    from miles_platform.rollout.generate_hub.agentic_tool_call import assemble

    state = SimpleNamespace(tokenizer=tok, sampling_support_replay=False, moe_shape=None)
    sample = assemble(Sample(prompt_tokens=[1]), rec, state, first, None)  # the agentic wrapper's Sample
    assert sample.image_data == [red, blue] and sample.tokens == tokens
    text_only = SessionServer(tok, srv.url, None)
    with pytest.raises(ChatError, match="not a vision-language model"):
        text_only._plan(text_only.create({}), parse_request({"messages": first}))


def test_a_multi_turn_tool_that_renders_an_image(vl_engine):
    """multi_turn: a tool answering with an image_url part adds its vision tokens (expanded) to the
    trajectory and its image to sample.image_data; the next turn's /generate sees both images; the
    agentic wrapper turns an image prompt into image_url parts."""
    import asyncio
    from argparse import Namespace

    from miles_platform.data.sample import Sample
    from miles_platform.rollout.base_types import GenerateFnInput, GenerateState
    from miles_platform.rollout.chat import IMAGE_TEXT
    from miles_platform.rollout.generate_hub.agentic_tool_call import prompt_messages
    from miles_platform.rollout.generate_hub.multi_turn import run_episode
    from miles_platform.rollout.generate_hub.tool_call import ToolCall

    srv, path, model, tok = vl_engine
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    prompt = _expanded(tok, tok(f"How many in {IMAGE_TEXT}?")["input_ids"])
    sample = Sample(prompt=f"How many in {IMAGE_TEXT}?", prompt_tokens=prompt, image_data=[red])
    state = GenerateState(args=Namespace(hf_checkpoint=path, apply_chat_template_kwargs=None), tokenizer=tok,
                          url=srv.url, api_key=None)  # fmt: skip
    turns = iter([[ToolCall("draw", {})], []])

    async def draw(name, params):
        return [{"type": "text", "text": "drawn:"}, {"type": "image_url", "image_url": {"url": blue}}]

    every = list(range(len(tok)))  # each model turn stops at its first token ("stop": the tool runs)
    sp = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5, "stop_token_ids": every}
    inp = GenerateFnInput(state, sample, sp)
    s = asyncio.run(run_episode(inp, lambda text: next(turns), draw, 2, None))
    assert s.image_data == [red, blue] and s.metadata["turns"] == 2, (s.status, s.metadata)
    assert s.tokens.count(tok.convert_tokens_to_ids(vlm.IMAGE_PAD)) == 8
    assert IMAGE_TEXT in s.turns[1]["tool_calls"][0]["result"]  # the record names it, no bytes
    ref = _scored(model, path, s.tokens, [red, blue], len(prompt))
    on = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(s.rollout_log_probs)[on], ref[on], atol=1e-4) and (~on).sum() > 0
    msgs = prompt_messages(f"How many in {IMAGE_TEXT}?", [red])
    assert msgs[0]["content"] == [{"type": "text", "text": "How many in "},
                                  {"type": "image_url", "image_url": {"url": red}}, {"type": "text", "text": "?"}]  # fmt: skip


def test_rollout_max_prompt_len_counts_the_expanded_image_tokens(vl_engine):
    """--rollout-max-prompt-len compares the prompt as generated: each image's pads expanded (Miles
    counts the processor's input_ids); a text prompt of the same unexpanded length is kept."""
    from miles_platform.config import RunConfig
    from miles_platform.data.dataset import PromptRecord
    from miles_platform.rollout.chat import IMAGE_TEXT
    from miles_platform.rollout.manager import RolloutManager

    _, path, _, tok = vl_engine
    img = PromptRecord(
        id="i", prompt=f"How many in {IMAGE_TEXT}?", label="1", metadata={}, images=[_uri((1, 2, 3))]
    )
    n = len(tok.encode(img.prompt, add_special_tokens=False))
    txt = PromptRecord(id="t", prompt="x" * 80, label="1", metadata={})
    txt.prompt = tok.decode(tok.encode(txt.prompt, add_special_tokens=False)[:n])  # n tokens, no image
    m = RolloutManager.__new__(RolloutManager)  # only the prompt-length filter's parts
    m.tok, m._vision = tok, None
    m.cfg = RunConfig(hf_checkpoint=path, rollout_max_prompt_len=n + 2)
    drops: dict[str, int] = {}
    assert m.prompt_len(img) == n + 3 and m._within_prompt_len([img, txt], drops) == [txt]
    assert drops == {"prompt_too_long": 1}
    m.cfg.rollout_max_prompt_len = n + 3
    assert m._within_prompt_len([img, txt], drops) == [img, txt]


def test_eval_datasets_with_images(vl_engine, tmp_path):
    """evaluate(multimodal_keys=...) reads an eval dataset's images as train does and hands them to
    the generate function; the in-process engine's greedy answer is /generate's with that image;
    `miles-platform eval` takes --multimodal-keys."""
    import json

    from miles_platform.rollout.chat import IMAGE_TEXT
    from miles_platform.rollout.evaluate import build_parser, engine_generate_fn, evaluate

    srv, path, _, tok = vl_engine
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    data = tmp_path / "e.jsonl"
    rows = [
        {"prompt": "How many in <image>?", "label": str(i + 1), "images": [u]}
        for i, u in enumerate((red, blue))
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []

    def fake(prompts, max_new_tokens, temperature, top_p, top_k, n, seed, images=None):
        seen.append((prompts, images))
        return [["1"] * n for _ in prompts]

    res = evaluate(None, [("e", str(data))], generate_fn=fake, temperature=0.0, tokenizer=tok,
                   multimodal_keys={"image": "images"})["e"]  # fmt: skip
    prompt = f"How many in {IMAGE_TEXT}?"
    assert seen == [([prompt, prompt], [[red], [blue]])] and res["pass@1"] == 0.5
    out = engine_generate_fn(srv.core)([prompt, prompt], 4, 0.0, 1.0, -1, 1, 0, images=[[red], [blue]])
    sp = {"max_new_tokens": 4, "temperature": 0.0, "stop_token_ids": [tok.eos_token_id]}
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ref = [
        _post(srv.url, {"input_ids": ids, "image_data": [u], "sampling_params": sp})["text"]
        for u in (red, blue)
    ]
    assert out == [[ref[0]], [ref[1]]]
    # the run's engines (in-loop eval): each image's pads expanded as a rollout's, image_data per request
    from types import SimpleNamespace

    from miles_platform.rollout.manager import router_generate_fn

    sent = {}

    def client_generate(ids, sps, return_logprob, image_data):
        sent.update(ids=ids, image_data=image_data)
        return [{"text": "1"}] * len(ids)

    vision = vlm.PromptVision(path)
    manager = SimpleNamespace(tok=tok, generate_fn=None, _prompt_vision=lambda: vision,
                              client=SimpleNamespace(generate=client_generate))  # fmt: skip
    assert (
        router_generate_fn(manager)([prompt, "2+2="], 4, 1.0, 1.0, -1, 2, 0, images=[[red], None])
        == [["1"] * 2] * 2
    )
    assert sent["ids"][0] == sent["ids"][1] == _expanded(tok, ids) and sent["image_data"] == [
        [red],
        [red],
        None,
        None,
    ]
    a = build_parser().parse_args(["--hf-checkpoint", path, "--eval-prompt-data", "e", str(data),
                                   "--multimodal-keys", '{"image": "images"}'])  # fmt: skip
    assert a.multimodal_keys == '{"image": "images"}'


def test_the_kv_cache_path_equals_a_full_forward_per_token(vl_engine, monkeypatch):
    """Image requests prefill once with the pixels and decode through the text model's KV cache: the
    same tokens and log-probs (1e-5) as a full forward of the prefix per token, with two images; a
    sampled <|image_pad|> (forced here) enters as <|vision_end|> on both paths."""
    srv, _, _, tok = vl_engine
    red, blue = _uri((255, 0, 0)), _uri((0, 0, 255))
    img = f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}"
    prompt = tok(f"{img} or {img}?")["input_ids"]
    pad = tok.convert_tokens_to_ids(vlm.IMAGE_PAD)
    sps = [
        {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": s, "ignore_eos": True} for s in range(3)
    ]
    body = {
        "input_ids": [prompt] * 3,
        "image_data": [[red, blue]] * 3,
        "sampling_params": sps,
        "return_logprob": True,
    }

    def run(cached: bool):
        monkeypatch.setattr(srv.core, "image_kv_cache", cached, raising=False)
        return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
                for o in _post(srv.url, body)]  # fmt: skip

    cached, full = run(True), run(False)
    for (ids_c, lps_c), (ids_f, lps_f) in zip(cached, full, strict=True):
        assert ids_c == ids_f and len(ids_c) == 12
        assert torch.allclose(torch.tensor(lps_c), torch.tensor(lps_f), atol=1e-5)
    # forced tokens, a sampled pad among them: the two paths' logits step by step
    from types import SimpleNamespace

    from miles_platform.data.images import from_data_uri
    from miles_platform.rollout.engine_vlm import _cached_logits, _full_logits

    core = srv.core
    px = vlm.process_images(
        vlm.load_image_processor(core.model_path), [from_data_uri(u) for u in (red, blue)]
    )
    ids = vlm.expand_image_tokens(prompt, core.model.config, px["image_grid_thw"])
    reqs = [SimpleNamespace(prompt_ids=ids, output_ids=[]) for _ in range(2)]
    with torch.no_grad():
        gens = [
            f(core, r, px["pixel_values"], px["image_grid_thw"])
            for f, r in zip((_cached_logits, _full_logits), reqs)
        ]
        for forced in (5, pad, 7, pad, 9):
            a, b = (next(g) for g in gens)
            assert torch.allclose(a, b, atol=1e-5), (forced, (a - b).abs().max())
            for r in reqs:
                r.output_ids.append(forced)
