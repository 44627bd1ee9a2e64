"""rm_hub: each built-in reward on hand-written responses, dispatch rules, remote_rm over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from miles_platform.config import ConfigError, RewardSettings, RunConfig
from miles_platform.data.sample import Sample
from miles_platform.rollout.rm_hub import (
    RemoteRewardError,
    async_rm,
    batched_async_rm,
    compute_rewards,
    validate_reward_config,
)
from miles_platform.rollout.rm_hub.boxed import last_boxed
from miles_platform.rollout.rm_hub.dapo_rm import dapo_reward
from miles_platform.rollout.rm_hub.deepscaler_rm import deepscaler_reward
from miles_platform.rollout.rm_hub.f1_rm import f1_reward
from miles_platform.rollout.rm_hub.math_rm import math_reward


def cfg(**kw) -> RunConfig:
    return RunConfig(rollout_batch_size=1, **kw)


def test_last_boxed_balanced_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed 5.") == "5"
    assert last_boxed(r"cut off \boxed{\frac{1}{2") is None
    assert last_boxed("no box") is None


def test_math_equivalence_and_fast_path():
    assert math_reward(r"so \boxed{\frac{1}{2}}", "0.5") == 1.0  # symbolic, via math_verify
    assert math_reward(r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}") == 1.0  # normalized strings
    assert math_reward(r"\boxed{1,000}", "1000") == 1.0
    assert math_reward(r"\boxed{8}", r"\boxed{7}") == 0.0
    assert math_reward("the answer is 7", "7") == 1.0  # no box: math_verify extracts
    assert math_reward(r"\boxed{7}", None) == 0.0


def test_dapo_last_answer_line():
    assert dapo_reward("Answer: 3\nthinking more...\nAnswer: 42", "42") == {"score": 1.0, "acc": 1.0}
    assert dapo_reward("Answer: 42\nAnswer: 41", "42") == {"score": -1.0, "acc": 0.0}
    assert dapo_reward("no answer line", "42")["score"] == -1.0
    assert dapo_reward("answer: $1,000$", "1000.0")["acc"] == 1.0


def test_deepscaler_needs_think_close():
    assert deepscaler_reward(r"<think>\boxed{4}</think> so \boxed{4}", "4") == 1.0
    assert deepscaler_reward(r"reasoning \boxed{4}", "4") == 0.0  # no </think>
    assert deepscaler_reward(r"<think>\boxed{4}</think> no box after", "4") == 0.0


def test_f1_tokens():
    # pred "cat sat mat" vs gold "cat sat on mat": overlap 3, P=3/3, R=3/4, F1 = 2*1*0.75/1.75
    assert f1_reward("The cat sat, mat!", "cat sat on the mat") == pytest.approx(6 / 7)
    assert f1_reward("dog", "cat") == 0.0


def test_dispatch_metadata_override_and_boxed_prefix():
    args = cfg(rm_type="f1")
    s = Sample(response=r"Paris \boxed{Paris}", label="Paris", metadata={"rm_type": "boxed_f1"})
    assert asyncio.run(async_rm(args, s)) == 1.0  # boxed_ grades only "Paris"
    s.metadata = {}
    assert asyncio.run(async_rm(args, s)) == pytest.approx(
        2 / 3
    )  # tokens "paris boxedparis" vs "paris": P=1/2, R=1


def test_random_is_seeded():
    args = cfg(rm_type="random", seed=7)
    samples = [Sample(index=i) for i in range(32)]
    a = asyncio.run(batched_async_rm(args, samples))
    b = asyncio.run(batched_async_rm(args, [Sample(index=i) for i in range(32)]))
    assert a == b and set(a) == {0.0, 1.0}


def test_unknown_rm_type_lists_valid_types():
    with pytest.raises(ConfigError, match=r"--rm-type 'mth'.*'math'.*boxed_<type>"):
        validate_reward_config(cfg(rm_type="mth"))
    with pytest.raises(ConfigError, match="boxed_nope"):
        asyncio.run(async_rm(cfg(rm_type="math"), Sample(metadata={"rm_type": "boxed_nope"})))
    with pytest.raises(ConfigError, match="--rm-url"):
        validate_reward_config(cfg(rm_type="remote_rm"))
    with pytest.raises(ConfigError, match="--reward-key score"):
        validate_reward_config(cfg(rm_type="dapo"))
    validate_reward_config(cfg(rm_type="boxed_math"))


def test_no_reward_is_refused_unless_every_prompt_names_one(tmp_path):
    with pytest.raises(ConfigError, match=r"no reward: set --rm-type .* or --custom-rm-path"):
        validate_reward_config(cfg())
    rows = [{"input": "1+1=", "label": "2", "metadata": {"rm_type": "math"}}, {"input": "2+2=", "label": "4"}]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"record 1 has no metadata.rm_type"):
        validate_reward_config(cfg(prompt_data=str(data), label_key="label"))
    data.write_text(json.dumps(rows[0]) + "\n")  # Miles' per-sample dispatch: every row names its reward
    validate_reward_config(cfg(prompt_data=str(data), label_key="label"))


def test_compute_rewards_sets_reward_and_raw_reward():
    args = cfg(rm_type="dapo", reward_key="score")
    samples = [
        Sample(index=0, response="Answer: 5", label="5"),
        Sample(index=1, response="Answer: 4", label="5"),
    ]
    compute_rewards(args, samples)
    assert samples[0].reward == {"score": 1.0, "acc": 1.0} and samples[0].raw_reward == 1.0
    assert samples[1].raw_reward == -1.0


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            async def length_rm(args, sample):
                return float(len(sample.response))

            async def rank_rm(args, samples):
                order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
                ranks = [0.0] * len(samples)
                for r, i in enumerate(order):
                    ranks[i] = float(r)
                return ranks

            def one_arg(sample):
                return 1.0

            SEEN = []

            async def seen_rm(args, sample):
                SEEN.append(args)
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_rm_per_sample_and_group(custom_module):
    samples = [Sample(index=i, group_index=i // 2, response="x" * (3 - i)) for i in range(4)]
    assert compute_rewards(cfg(custom_rm_path="my_rewards.length_rm"), samples) == [3.0, 2.0, 1.0, 0.0]
    args = cfg(custom_rm_path="my_rewards.rank_rm", group_rm=True)
    compute_rewards(args, samples)  # ranked within each group of 2
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="--custom-rm-path.*2 positional"):
        validate_reward_config(cfg(custom_rm_path="my_rewards.one_arg"))


def test_a_custom_rm_receives_the_runs_own_args(custom_module):
    """Miles' contract `async def f(args, sample)`: a run's function gets the run's RunConfig (every
    flag), a Miles-style args object (a ported rollout function's) itself, and eval settings with the
    flags' attribute names; the hub itself reads typed RewardSettings."""
    import my_rewards

    run = cfg(custom_rm_path="my_rewards.seen_rm", n_samples_per_prompt=1)
    compute_rewards(run.reward_settings(), [Sample(response="a")])
    miles_args = SimpleNamespace(custom_rm_path="my_rewards.seen_rm", rm_type=None, hf_checkpoint="/m")
    asyncio.run(batched_async_rm(miles_args, [Sample(response="b")]))
    evals = RewardSettings(custom_rm_path="my_rewards.seen_rm", reward_key="score")
    compute_rewards(evals, [Sample(response="c")])
    assert my_rewards.SEEN[0] is run and my_rewards.SEEN[1] is miles_args and my_rewards.SEEN[2] is evals
    assert (evals.rm_type, evals.custom_rm_path, evals.group_rm, evals.reward_key, evals.eval_reward_key,
            evals.rm_url) == (None, "my_rewards.seen_rm", False, "score", None, None)  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        evals.rm_type = "math"  # settings are read, never changed mid-run


class _RewardHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        if body["label"] == "boom":
            self._reply(500, b"internal failure")
        elif body["label"] == "bare":
            self._reply(200, b"0.25")
        else:
            self._reply(200, json.dumps({"reward": float(body["response"] == body["label"])}).encode())

    def _reply(self, code: int, data: bytes):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_remote_rm_over_http(reward_server):
    url = f"http://127.0.0.1:{reward_server.server_port}/reward"
    args = cfg(rm_type="remote_rm", rm_url=url)
    validate_reward_config(args)
    samples = [
        Sample(index=0, prompt="p", response="yes", label="yes", metadata={"k": 1}),
        Sample(index=1, response="no", label="yes"),
        Sample(index=2, response="x", label="bare"),
    ]
    assert compute_rewards(args, samples) == [1.0, 0.0, 0.25]
    first = next(b for b in reward_server.seen if b["metadata"] == {"k": 1})
    assert first == {"prompt": "p", "response": "yes", "label": "yes", "metadata": {"k": 1}}
    with pytest.raises(RemoteRewardError, match=r"HTTP 500.*internal failure"):
        compute_rewards(args, [Sample(response="x", label="boom")])


def test_remote_rm_and_the_engine_clients_build_no_tls_context_per_call(reward_server, monkeypatch):
    """A remote reward's client per sample uses the process's one TLS context (miles_platform/tls.py,
    as every client the platform makes): a new one loads certifi's CA bundle, ~40-100 ms of CPU."""
    import ssl

    import httpx._config
    import httpx._transports.default

    from miles_platform.tls import client_tls

    # httpx's own default, not the suite's shared one (tests/conftest.py), for clients that ask for it
    monkeypatch.setattr(httpx._transports.default, "create_ssl_context", httpx._config.create_ssl_context)

    ctx = client_tls()
    assert ctx is client_tls() and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    made = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(1) or real(*a, **kw))
    url = f"http://127.0.0.1:{reward_server.server_port}/reward"
    args = cfg(rm_type="remote_rm", rm_url=url)
    samples = [Sample(index=i, response="yes", label="yes") for i in range(6)]
    assert compute_rewards(args, samples) == [1.0] * 6
    assert made == []


def test_remote_rm_unreachable_names_url():
    args = RewardSettings(rm_type="remote_rm", rm_url="http://127.0.0.1:9/none")
    with pytest.raises(RemoteRewardError, match="127.0.0.1:9"):
        asyncio.run(async_rm(args, Sample()))


WARM_UP_CASES = [(("math",), True), (("boxed_math",), True), (("deepscaler", None), True),
                 (("f1", "dapo", None), False)]  # fmt: skip


@pytest.fixture(scope="module")
def warm_up_loads() -> dict:
    """Each case's answer from a fresh interpreter (this one may have imported math_verify already):
    one that imports rm_hub once (~3 CPU-s: torch, transformers), then each case in a fork of it."""
    import subprocess

    code = f"""
import os, sys
from miles_platform.rollout.rm_hub import warm_up_rewards
assert 'math_verify' not in sys.modules
for rm_types, _ in {WARM_UP_CASES!r}:
    r, w = os.pipe()
    if os.fork() == 0:
        warm_up_rewards(*rm_types)
        os.write(w, str('math_verify' in sys.modules).encode())
        os._exit(0)
    os.close(w)
    print(repr(rm_types), os.read(r, 16).decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return dict(line.rsplit(" ", 1) for line in out.strip().splitlines())


@pytest.mark.parametrize(("rm_types", "loads"), WARM_UP_CASES)
def test_warm_up_rewards_loads_the_symbolic_grader_only_when_the_run_grades_with_it(
    warm_up_loads, rm_types, loads
):
    assert warm_up_loads[repr(rm_types)] == str(loads)


def test_warm_up_and_grading_work_off_the_main_thread():
    # a run driven from a thread (concurrent LoRA runs in one process) has no signal.alarm
    from miles_platform.rollout.rm_hub import math_rm, warm_up_rewards

    errors, results = [], []

    def work():
        try:
            warm_up_rewards("math")
            results.append(math_rm.math_equal.__wrapped__("\\frac{1}{2}", "0.5"))
        except Exception as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors and results == [True]


def test_a_background_warm_up_runs_beside_the_caller_and_the_run_waits_for_it(monkeypatch):
    """A run starts its graders' imports once Ray is up (run_services.py): `warm_up_rewards` waits for
    them, and a failure there is raised by its own call."""
    import time

    from miles_platform.rollout import rm_hub

    calls, release = [], threading.Event()

    def slow_warm_up():
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            release.wait(10)  # still importing when the caller goes on
            calls.append("first done")

    monkeypatch.setitem(rm_hub.WARM_UPS, "math", slow_warm_up)
    t0 = time.monotonic()
    rm_hub.warm_up_rewards_in_background("boxed_math", None)
    assert time.monotonic() - t0 < 1 and calls == ["warm-up-rewards"]  # returned at once, on its own thread
    threading.Timer(0.3, release.set).start()
    rm_hub.warm_up_rewards("math")  # waits for the background one, then runs it here (a no-op when done)
    assert calls == ["warm-up-rewards", "first done", threading.current_thread().name]
    assert not rm_hub._warming  # nothing left waiting

    def broken():
        raise RuntimeError("no grader")

    monkeypatch.setitem(rm_hub.WARM_UPS, "math", broken)
    rm_hub.warm_up_rewards_in_background("math")
    with pytest.raises(RuntimeError, match="no grader"):
        rm_hub.warm_up_rewards("math")
