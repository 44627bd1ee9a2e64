"""TITO session server (rollout/sessions.py) and the agentic wrapper (generate_hub/agentic_tool_call.py)
against a real embedded engine: an OpenAI-client agent's 3-turn episode assembles into a Sample whose
model tokens carry the log-probs of one teacher-forced forward over it; append-only violations,
unknown sessions and TITO control fields are refused; a crashing, hung or misbehaving agent fails
only its own sample; one `--ci-test` loop run trains on agentic samples with step-0 ppo_kl 0."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
import torch
from loop_helpers import small_run_config, small_run_kwargs, write_prompts

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.data.dataset import PromptRecord
from miles_platform.loop import train, validate_before_start
from miles_platform.models.checkpoint import load_tokenizer
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.manager import RolloutManager

KEY = "tito-secret"
AGENTIC = "miles.rollout.generate_hub.agentic_tool_call.generate"
PROMPT = [{"role": "system", "content": "use tools"}, {"role": "user", "content": "What is 2+3+7?"}]
RECORD = PromptRecord(id="p0", prompt=json.dumps(PROMPT), label="12", metadata={})


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint):
    srv = start_engine_server(tiny_hf_checkpoint, api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_hf_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32).eval()


def _cfg(ckpt, tmp_path, **kw) -> RunConfig:
    base = dict(custom_generate_function_path=AGENTIC, custom_agent_function_path="agent_fns.three_turns",
                use_session_server="v1", rollout_temperature=0.8, rollout_max_response_len=6,
                rollout_batch_size=1, n_samples_per_prompt=1, api_key=KEY)  # fmt: skip
    cfg = RunConfig(**small_run_kwargs(ckpt, tmp_path, **{**base, **kw})).validate()
    validate_before_start(cfg)
    return cfg


def _run(cfg, tok, url, records, seeds=None):
    m = RolloutManager(cfg, tok, None, url)
    try:
        groups = m.generate_groups(
            records, [[1]] * len(records), seeds or [[11 + i] for i in range(len(records))]
        )
        return m.finalize(0, groups), m
    finally:
        m.close()


def test_a_three_turn_agent_episode_matches_a_teacher_forced_forward(
    tiny_hf_checkpoint, engine, hf, tmp_path
):
    tok = load_tokenizer(tiny_hf_checkpoint)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path)  # subproc: the agent in a child process of its own
    [s], _ = _run(cfg, tok, engine.url, [RECORD])
    assert s.status in ("completed", "truncated") and s.metadata["turns"] == 3, s.metadata
    assert s.reward == 1.0 and s.metadata["agent_turns"] == 3
    assert {"session_id", "max_seq_len", "prompt_id"} <= set(s.metadata["seen_metadata"])
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert s.prompt_tokens == tok.encode(text, add_special_tokens=False)
    assert [t["role"] for t in s.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    for t, answer in zip([s.turns[1], s.turns[3]], ("result 5", "result 6")):
        span = tok.decode(s.response_tokens[t["start"] : t["end"]])
        assert span.endswith(f"<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"), span
        assert span.startswith("\n") or span.startswith("<|im_end|>\n")  # the model's turn closed
    for t in s.turns:
        assert set(s.loss_mask[t["start"] : t["end"]]) == {int(t["role"] == "assistant")}
    assert s.turns[-1]["end"] == len(s.response_tokens) == len(s.loss_mask) == len(s.rollout_log_probs)
    # one teacher-forced forward over prompt + the whole trajectory: model tokens carry their log-prob
    with torch.no_grad():
        z = hf(torch.tensor([s.tokens])).logits[0, len(s.prompt_tokens) - 1 : -1].float() / 0.8
    want = torch.log_softmax(z, -1).gather(1, torch.tensor(s.response_tokens)[:, None])[:, 0]
    got, on = torch.tensor(s.rollout_log_probs), torch.tensor(s.loss_mask, dtype=torch.bool)
    assert on.sum() > 0 and (~on).sum() > 0
    assert torch.allclose(got[on], want[on], atol=1e-4) and (got[~on] == 0).all()


def test_a_crashing_a_hung_and_a_raising_agent_fail_only_their_own_sample(
    tiny_hf_checkpoint, engine, tmp_path
):
    tok = load_tokenizer(tiny_hf_checkpoint)
    # the good agent takes ~1.5 s alone and took over 4 s in a full run on a slow VM (2026-12-06)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_timeout=8.0)
    crash, hang = (PromptRecord(id=i, prompt="1+1=", label="2", metadata={}) for i in ("crash", "hang"))
    ok, crashed, hung = _run(cfg, tok, engine.url, [RECORD, crash, hang])[0]
    assert ok.status in ("completed", "truncated") and ok.metadata["turns"] == 3 and not ok.remove_sample
    assert crashed.status == "failed" and "exited with code 3" in crashed.metadata["agent_error"]
    assert hung.status == "failed" and "did not finish within" in hung.metadata["agent_error"]
    for s in (crashed, hung):  # kept in the group (the batch invariant), out of the loss
        assert s.remove_sample and s.loss_mask == [0] * len(s.response_tokens) and s.prompt_tokens
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_path="agent_fns.returns_a_list",
               custom_agent_function_mode="inline")  # fmt: skip
    [s], _ = _run(cfg, tok, engine.url, [RECORD])
    assert s.status == "failed" and "returned a list, not a dict or None" in s.metadata["agent_error"]
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_path="agent_fns.raises",
               custom_agent_function_mode="inline")  # fmt: skip
    [s], _ = _run(cfg, tok, engine.url, [RECORD])
    assert s.status == "failed" and "RuntimeError: sandbox down" in s.metadata["agent_error"]


def test_session_server_http_contract(tiny_hf_checkpoint, engine, tmp_path):
    """404 for an unknown session, 400 for control fields and a wrong training temperature, a retry
    rolls back one turn, a rewritten history fails the session; every path needs the token."""
    tok = load_tokenizer(tiny_hf_checkpoint)
    m = RolloutManager(_cfg(tiny_hf_checkpoint, tmp_path), tok, None, engine.url)
    url, h = m.args.session_server_url, {"Authorization": f"Bearer {KEY}"}
    try:
        assert httpx.post(f"{url}/sessions", json={}).status_code == 401
        sid = httpx.post(f"{url}/sessions", json={"temperature": 0.8}, headers=h).json()["session_id"]
        chat = f"{url}/sessions/{sid}/v1/chat/completions"
        r = httpx.post(f"{url}/sessions/nope/v1/chat/completions", json={"messages": PROMPT}, headers=h)
        assert r.status_code == 404 and "unknown session 'nope'" in r.text
        assert httpx.get(f"{url}/sessions/nope", headers=h).status_code == 404
        for bad in ({"input_ids": [1, 2]}, {"logprob_start_len": 0}):
            r = httpx.post(chat, json={"messages": PROMPT, **bad}, headers=h)
            assert r.status_code == 400 and "TITO control field" in r.text
        r = httpx.post(chat, json={"messages": PROMPT, "temperature": 1.0}, headers=h)
        assert r.status_code == 400 and "samples at 0.8" in r.text

        def say(messages):
            r = httpx.post(chat, json={"messages": messages, "max_tokens": 3}, headers=h, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]

        a1 = say(PROMPT)
        say(PROMPT)  # a retry of the first turn: rolled back, answered again
        rec = httpx.get(f"{url}/sessions/{sid}", headers=h).json()
        assert rec["num_calls"] == 1 and len(rec["turns"]) == 1 and rec["status"] == "active"
        a1 = rec["messages"][-1]
        h2 = PROMPT + [a1, {"role": "user", "content": "and 5 more?"}]
        say(h2)
        rec = httpx.get(f"{url}/sessions/{sid}", headers=h).json()
        assert rec["num_calls"] == 2 and [t["role"] for t in rec["turns"]] == [
            "assistant",
            "user",
            "assistant",
        ]
        rewritten = copy.deepcopy(h2 + [rec["messages"][-1], {"role": "user", "content": "again"}])
        rewritten[1]["content"] = "What is 9+9?"
        r = httpx.post(chat, json={"messages": rewritten}, headers=h)
        assert r.status_code == 400 and "not append-only" in r.text
        rec = httpx.get(f"{url}/sessions/{sid}", headers=h).json()
        assert rec["status"] == "failed" and "rewrites the history" in rec["failure"]
        assert httpx.delete(f"{url}/sessions/{sid}", headers=h).json()["deleted"] is True
        assert httpx.get(f"{url}/sessions/{sid}", headers=h).status_code == 404
    finally:
        m.close()


def test_a_template_that_rewrites_earlier_turns_fails_the_sample(tiny_hf_checkpoint, engine, tmp_path):
    tok = copy.deepcopy(load_tokenizer(tiny_hf_checkpoint))
    tok.chat_template = (  # counts the messages at the top: every turn re-renders the start
        "<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_mode="inline")
    [s], _ = _run(cfg, tok, engine.url, [RECORD])
    assert s.status == "failed" and s.remove_sample and "not append-only" in s.metadata["session_error"]
    assert s.metadata["turns"] == 1 and "BadRequestError" in s.metadata["agent_error"]


def test_agentic_flags_are_validated_before_start(tiny_hf_checkpoint, tmp_path):
    data = write_prompts(tmp_path)
    base = ["--hf-checkpoint", tiny_hf_checkpoint, "--prompt-data", data, "--rollout-batch-size", "1",
            "--input-key", "prompt", "--rm-type", "math", "--storage-root", str(tmp_path / "root")]  # fmt: skip
    agentic = [
        "--custom-generate-function-path",
        AGENTIC,
        "--custom-agent-function-path",
        "agent_fns.three_turns",
    ]
    cfg = parse_run_config(base + agentic + ["--use-session-server", "--tito-model", "qwen3"])
    assert cfg.use_session_server == "v1" and cfg.custom_agent_function_mode == "subproc"
    for argv, needle in [
        (agentic + ["--use-session-server", "v2"], "--use-session-server v2: only v1"),
        (agentic, "needs --use-session-server"),
        (agentic[:2] + ["--use-session-server"], "needs --custom-agent-function-path"),
        (
            ["--custom-agent-function-path", "agent_fns.three_turns"],
            "read by --custom-generate-function-path",
        ),
        (["--tito-model", "qwen3"], "session server flags; set --use-session-server"),
        # Miles' names whose turn format is not built: refused by name, not an argparse "invalid choice"
        (
            agentic + ["--use-session-server", "--tito-model", "kimi25"],
            "--tito-model kimi25: Miles' turn format",
        ),
        (agentic + ["--use-session-server", "--tito-model", "deepseekv4"], "DeepSeek-V4's encoder"),
        (agentic + ["--use-session-server", "--apply-chat-template"], "--apply-chat-template with agentic"),
    ]:
        with pytest.raises(ConfigError, match=None) as e:
            parse_run_config(base + argv)
        assert needle in str(e.value), (argv, str(e.value))
    with pytest.raises(ConfigError, match="has no '<|eot_id|>' token"):
        validate_before_start(
            parse_run_config(base + agentic + ["--use-session-server", "--tito-model", "llama3"])
        )
    bad = parse_run_config(base + ["--use-session-server", "--custom-generate-function-path", AGENTIC,
                                   "--custom-agent-function-path", "agent_fns.TOOLS"])  # fmt: skip
    with pytest.raises(ConfigError, match="--custom-agent-function-path 'agent_fns.TOOLS'"):
        validate_before_start(bad)


def test_agentic_ci_test_run_trains_on_session_samples(tiny_hf_checkpoint, tmp_path):
    """The loop with a real engine: agent episodes over the session server, prompts as messages lists;
    --ci-test holds (step-0 ppo_kl 0, trainer and engine log-probs agree)."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "label": str(2 * i)})
                            + "\n" for i in range(4)))  # fmt: skip
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, prompt_data=str(data), ci_test=True, num_rollout=1,
        custom_generate_function_path=AGENTIC, custom_agent_function_path="agent_fns.three_turns",
        use_session_server="v1", rollout_max_response_len=4, max_seq_len=200,
        custom_agent_function_mode="inline",  # the child processes are tested above; here the loop
    )  # fmt: skip
    res = train(cfg)
    assert res.ci_checks["step0_ppo_kl"] < 1e-9 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-4
    assert res.metrics[0]["multi_turn/turns/max"] == 3 and res.metrics[0]["rollout/failed"] == 0
    assert res.metrics[0]["rollout/raw_reward"] == 1.0  # the agent's reward, not the math rm's


def test_the_abort_hook_runs_when_a_round_is_cancelled(tiny_hf_checkpoint, engine, tmp_path, monkeypatch):
    """A sample whose generation raises cancels its round; the agent module's abort(args) runs."""
    from miles_platform.rollout.generate_hub import agentic_tool_call

    log = tmp_path / "abort.jsonl"
    monkeypatch.setenv("AGENT_FNS_ABORT_LOG", str(log))

    async def broken(input):
        raise RuntimeError("session server unreachable")

    monkeypatch.setattr(agentic_tool_call, "generate", broken)
    cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_mode="inline")
    m = RolloutManager(cfg, load_tokenizer(tiny_hf_checkpoint), None, engine.url)
    try:
        with pytest.raises(RuntimeError, match="session server unreachable"):
            m.generate_groups([RECORD], [[1]], [[1]])
    finally:
        m.close()
    assert [json.loads(x) for x in log.read_text().splitlines()] == [{"run": "t"}]


def test_big_chats_long_sessions_and_session_floods_get_clear_errors(tiny_hf_checkpoint, engine, tmp_path):
    """Issue #49, item 9. A 1.4 MB chat was tokenized on the session server's event loop before its
    length was checked (seconds of stall for every other request); a session past the model's
    context got a bare 500; sessions were unbounded. Now: a byte-count lower bound refuses it before
    any tokenization, TITO tokenizes on a thread of its own, the context is the checkpoint's, the
    engine's refusal is passed on as a 400, and past the limit POST /sessions answers 429."""
    import threading

    tok = load_tokenizer(tiny_hf_checkpoint)
    m = RolloutManager(_cfg(tiny_hf_checkpoint, tmp_path), tok, None, engine.url)
    srv, url, h = m.sessions.server, m.args.session_server_url, {"Authorization": f"Bearer {KEY}"}
    calls, first_prompt = [], srv.tito.first_prompt

    def spy(*a, **kw):  # the real tokenizer, and the thread it ran on
        calls.append(threading.current_thread().name)
        return first_prompt(*a, **kw)

    srv.tito.first_prompt = spy
    try:
        assert srv.context_length == 256  # the tiny checkpoint's max_position_embeddings

        def chat(content, max_tokens=3):
            sid = httpx.post(f"{url}/sessions", json={}, headers=h).json()["session_id"]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
            return httpx.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body, headers=h, timeout=60)

        r = chat("12+34= " * 200_000)
        assert r.status_code == 400 and "at least" in r.text and "256" in r.text, r.text
        assert calls == []  # refused before any tokenization
        r = chat("1+2=" * 250)  # fits the byte bound, not the context once tokenized
        assert r.status_code == 400 and "the context (256)" in r.text, r.text
        r = chat("1+2=")
        assert r.status_code == 200, r.text
        assert calls and all(name.startswith("tito") for name in calls)
        srv.max_sessions = len(srv.sessions) + 1
        assert httpx.post(f"{url}/sessions", json={}, headers=h).status_code == 200
        r = httpx.post(f"{url}/sessions", json={}, headers=h)
        assert r.status_code == 429 and "DELETE /sessions/<id>" in r.text
        r = httpx.post(f"{engine.url}/v1/chat/completions", headers=h, timeout=60,
                       json={"messages": [{"role": "user", "content": "12+34= " * 200_000}]})  # fmt: skip
        assert r.status_code == 400 and "at least" in r.text, r.text
    finally:
        m.close()


def test_an_agent_gets_a_generate_only_key_and_cannot_swap_weights_or_pause(
    tiny_hf_checkpoint, engine, tmp_path
):
    """Every agent process got the run's master key: a test agent swapped the run's weights through
    the engine and the router and the run exited 0 (issue #49, item 3). Now it gets the run's
    generate-only key: its chats work, every control call it tries is a 403, and the admin key
    still does everything."""
    from miles_platform.rollout.router import start_router

    router = start_router(worker_urls=[engine.url], api_key=KEY, worker_api_key=KEY)  # as a run starts it
    try:
        meta = {"engine_url": engine.url, "router_url": router.url}
        record = PromptRecord(id="p0", prompt=json.dumps(PROMPT), label="12", metadata=meta)
        cfg = _cfg(tiny_hf_checkpoint, tmp_path, custom_agent_function_path="agent_fns.grabs_the_engine")
        [s], _ = _run(cfg, load_tokenizer(tiny_hf_checkpoint), engine.url, [record])
        assert s.status != "failed", s.metadata.get("agent_error")
        assert s.metadata["tried"] and set(s.metadata["tried"].values()) == {403}, s.metadata["tried"]
        assert len(s.response_tokens) > 0  # the chat went through the session server and the engine
        from miles_platform.rollout.http_common import generate_key

        gen = {"Authorization": f"Bearer {generate_key(KEY)}"}
        r = httpx.post(f"{router.url}/generate", headers=gen, timeout=60,
                       json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
        assert r.status_code == 200, r.text
        admin = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{engine.url}/continue_generation", headers=admin).status_code == 200
        assert (
            httpx.post(f"{engine.url}/continue_generation", headers={"Authorization": "Bearer x"}).status_code
            == 401
        )
    finally:
        router.stop()
