"""The OpenAI routes on a model like the demo's, whose tokenizer carries only our generic chat
template (models/tokenizer.py): `/v1/completions` answers what `/generate` answers (with the
`openai` client, on the engine and through the router), streams token by token, refuses what the
engine cannot do by name; chat on such a model is a 400 that points to `/v1/completions`; the
model id is the absolute checkpoint path, or the run and policy version an engine serves."""

from __future__ import annotations

import copy
import os
import time

import httpx
import openai
import pytest
from openai_streams import assert_streamed_while_generating, slow_steps, sse_events, text_of

from miles_platform.config import RunConfig
from miles_platform.rollout import chat
from miles_platform.rollout.engine_fleet import _embedded_kwargs
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.router import start_router

KEY = "oa-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fleet(tiny_hf_checkpoint):
    engine = start_engine_server(tiny_hf_checkpoint, api_key=KEY)
    router = start_router(worker_urls=[engine.url], api_key=KEY, worker_api_key=KEY)
    yield engine, router
    router.stop()
    engine.stop()


def generate(url: str, text: str, **sampling) -> dict:
    body = {"text": text, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 2}
    r = httpx.post(f"{url}/generate", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("via", ["engine", "router"])
def test_completions_answer_what_generate_answers(fleet, via):
    engine, router = fleet
    client = openai.OpenAI(base_url=f"{engine.url if via == 'engine' else router.url}/v1", api_key=KEY)
    want = generate(engine.url, "18+25=", max_new_tokens=6, temperature=0)
    r = client.completions.create(model="anything", prompt="18+25=", max_tokens=6, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text == want["text"] and c.finish_reason == want["meta_info"]["finish_reason"]["type"]
    assert c.logprobs.token_logprobs == [lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]
    decode = engine.core.tokenizer.decode
    tops = [{decode([i]): v for v, i, _ in top} for top in want["meta_info"]["output_top_logprobs"]]
    assert c.logprobs.top_logprobs == tops and "".join(c.logprobs.tokens) == c.text
    assert r.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == len(want["output_ids"]) and r.object == "text_completion"
    assert r.model == os.path.abspath(engine.core.model_path)
    # the prompt as token ids; a batch of prompts, n choices each, seeded seed + j
    ids = engine.core.tokenizer("18+25=")["input_ids"]
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == c.text
    batch = client.completions.create(model="m", prompt=["18+25=", "7+11="], max_tokens=3, n=2, seed=3)
    assert [x.index for x in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 12
    assert batch.choices[3].text == generate(engine.url, "7+11=", max_new_tokens=3, sampling_seed=4)["text"]
    # a stop string cuts the text where /generate cuts it
    long = generate(engine.url, "18+25=", max_new_tokens=20, temperature=0)["text"]
    stop = long.strip()[1]
    cut = client.completions.create(model="m", prompt="18+25=", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == long[: long.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_completions_refuse_what_the_engine_cannot_do_by_name(fleet):
    engine, _ = fleet
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key=KEY)
    for kw, needle in [
        ({"echo": True}, "echo=True is not supported by the embedded engine"),
        ({"frequency_penalty": 0.5, "suffix": "!"}, "frequency_penalty=0.5, suffix='!' are not supported"),
        ({"best_of": 3}, "best_of=3 is not supported"),
        ({"prompt": []}, "prompt=[]: must be a string, a list of token ids"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"max_tokens": 0}, "must be a positive integer"),
        ({"logprobs": 21}, "logprobs=21: must be an integer in [0, 20]"),
        ({"n": 40, "prompt": ["1+1=", "2+2="]}, "at most 64 choices"),
        ({"extra_body": {"bogus": 1}}, "unknown completion fields ['bogus']; see SGLang's CompletionRequest"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": "m", "prompt": "1+1=", **kw})
        assert e.value.status_code == 400 and needle in str(e.value), (kw, str(e.value))
    assert client.completions.create(model="m", prompt="1+1=", max_tokens=1, best_of=1).choices  # the default
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{engine.url}/v1", api_key="wrong").completions.create(model="m", prompt="1")


def test_chat_on_a_model_without_a_learned_template_points_to_completions(fleet):
    """The demo's tokenizer carries only our generic template: its answer to a templated prompt
    is nonsense, so the chat route refuses it (token ids still pass, as SGLang's input_ids)."""
    engine, router = fleet
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "18+25="}])
    assert "generic chat template" in str(e.value) and "/v1/completions" in str(e.value)
    ids = engine.core.tokenizer("18+25=")["input_ids"]
    body = {
        "messages": [{"role": "user", "content": "-"}],
        "input_ids": ids,
        "max_tokens": 6,
        "temperature": 0,
    }
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=AUTH)
    want = generate(engine.url, "18+25=", max_new_tokens=6, temperature=0)["text"]
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    bare = copy.deepcopy(engine.core.tokenizer)
    bare.chat_template = None
    with pytest.raises(chat.ChatError, match="has no chat template: POST the raw prompt"):
        chat.render_prompt(bare, chat.parse_request({"messages": [{"role": "user", "content": "1+1="}]}))


@pytest.mark.parametrize("via", ["engine", "router"])
def test_completions_stream_tokens_as_they_are_generated(fleet, via):
    engine, router = fleet
    url = engine.url if via == "engine" else router.url
    body = {"prompt": "18+25=", "max_tokens": 60, "ignore_eos": True, "temperature": 0, "logprobs": 1}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with slow_steps(engine.core):
        events = sse_events(url, "/v1/completions", streamed, KEY)
    assert_streamed_while_generating(events, tokens=60)
    full = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).json()
    assert "".join(text_of(e) for _, e in events) == full["choices"][0]["text"]
    lps = [
        x for _, e in events for c in e["choices"] for x in (c["logprobs"] or {}).get("token_logprobs", [])
    ]
    assert lps == full["choices"][0]["logprobs"]["token_logprobs"]
    assert events[-2][1]["choices"][0]["finish_reason"] == "length"
    assert events[-1][1]["usage"] == full["usage"]
    # the router held the worker's slot for the stream and gave it back
    assert [w.inflight for w in router.router.workers.values()] == [0]


def test_a_client_that_leaves_a_stream_frees_the_router_slot(fleet):
    engine, router = fleet
    body = {"prompt": "18+25=", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with slow_steps(engine.core):
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=AUTH) as r:
            next(r.iter_lines())  # the first event, then the client goes away
    deadline = time.monotonic() + 10
    while any(w.inflight for w in router.router.workers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(w.inflight, w.healthy) for w in router.router.workers.values()] == [(0, True)]


def test_the_model_id_is_the_absolute_checkpoint_or_the_run_and_version(
    fleet, tiny_hf_checkpoint, monkeypatch
):
    engine, _ = fleet
    monkeypatch.chdir(os.path.dirname(tiny_hf_checkpoint))  # a relative path, as the README serves one
    relative = start_engine_server(os.path.basename(tiny_hf_checkpoint), api_key=KEY)
    run = start_engine_server(core=engine.core, api_key=KEY, run_name="mine")
    named = start_engine_server(core=engine.core, api_key=KEY, served_model_name="tiny-demo")
    try:
        ids = {}
        for name, server in (("relative", relative), ("run", run), ("named", named)):
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
            [card] = client.models.list().data
            answer = client.completions.create(model="default", prompt="1+1=", max_tokens=1)
            assert answer.model == card.id, name
            ids[name] = card.id
        assert os.path.isabs(ids["relative"]) and os.path.samefile(ids["relative"], tiny_hf_checkpoint)
        assert ids["run"] == "mine.v000000" and ids["named"] == "tiny-demo"
        cfg = RunConfig(rollout_batch_size=2, hf_checkpoint=tiny_hf_checkpoint, run_name="mine").validate()
        assert _embedded_kwargs(cfg)["run_name"] == "mine"  # what a run's engines are started with
        engine.core.update_weights_from_disk(tiny_hf_checkpoint, 3)
        assert openai.OpenAI(base_url=f"{run.url}/v1", api_key=KEY).models.list().data[0].id == "mine.v000003"
    finally:
        for server in (relative, run, named):
            server.stop()
