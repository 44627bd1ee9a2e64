"""The embedded engine serves SGLang's LoRA API over real HTTP on loopback: adapters match a
PEFT-wrapped HF model token for token, several adapters share one engine without seeing each
other's weights, and the API answers as SGLang does."""

import pytest
import torch
from engine_hooks import HoldScheduler, until

from miles_platform.models.checkpoint import load_hf_model
from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.lora_serving import read_adapter_dir, tensor_sha256

PROMPT = [5, 9, 17, 33, 41]


def _random_adapter(ckpt, out, targets, seed, r=4, alpha=8):
    """A PEFT adapter with random A and B (B = 0 would make it the base) saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    conf = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(load_hf_model(ckpt), conf)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(4.0)  # a visibly different policy at this tiny scale
    model.save_pretrained(str(out), save_embedding_layers=False)
    return str(out)


def _peft_log_probs(ckpt, adapter_dir, prompt, output_ids):
    from peft import PeftModel

    model = load_hf_model(ckpt)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def _gen(url, loras, seed=7, n_tokens=8):
    body = {
        "input_ids": [PROMPT] * len(loras),
        "sampling_params": [
            {"max_new_tokens": n_tokens, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}
        ]
        * len(loras),  # fmt: skip
        "return_logprob": True,
        "lora_path": loras,
    }
    return post(url, "/generate", body)


@pytest.fixture
def engine(tiny_hf_checkpoint):
    server = start_engine_server(tiny_hf_checkpoint, num_threads=1)
    yield server
    server.stop()


def test_engine_with_adapter_equals_peft_forward_and_adapters_stay_isolated(
    engine, tiny_hf_checkpoint, tmp_path
):
    attn = _random_adapter(tiny_hf_checkpoint, tmp_path / "attn", ["q_proj", "v_proj", "o_proj"], seed=1)
    mlp = _random_adapter(tiny_hf_checkpoint, tmp_path / "mlp", ["gate_proj", "down_proj", "lm_head"], seed=2)
    for name, path in (("attn", attn), ("mlp", mlp)):
        out = post(engine.url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert out["success"] and out["loaded_adapters"][name] == path
    # one batch, three policies: each row is served with its own adapter (or the base) only
    rows = _gen(engine.url, ["attn", "mlp", None, "attn"])
    texts = {}
    for out, adapter in zip(rows, [attn, mlp, None, attn], strict=True):
        ids = out["output_ids"]
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        want = _peft_log_probs(tiny_hf_checkpoint, adapter, PROMPT, ids)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        texts.setdefault(adapter, []).append(ids)
    assert texts[attn][0] == texts[attn][1]  # same seed, same adapter: same tokens
    assert len({tuple(v[0]) for v in texts.values()}) == 3, "the three policies should differ"
    # served alone, an adapter gives the same tokens and log-probs as inside the mixed batch
    alone = _gen(engine.url, ["mlp"])[0]
    assert alone["output_ids"] == rows[1]["output_ids"]
    lp = lambda o: [x[0] for x in o["meta_info"]["output_token_logprobs"]]  # noqa: E731
    torch.testing.assert_close(torch.tensor(lp(alone)), torch.tensor(lp(rows[1])), atol=1e-5, rtol=0)


def test_lora_api_answers_like_sglang(engine, tiny_hf_checkpoint, tmp_path):
    path = _random_adapter(tiny_hf_checkpoint, tmp_path / "a", ["q_proj"], seed=3)
    with pytest.raises(EngineHTTPError, match="not loaded") as e:
        _gen(engine.url, ["a"])
    assert e.value.status == 400
    post(engine.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": path, "weight_version": 5})
    with pytest.raises(EngineHTTPError, match="already loaded"):
        post(engine.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": path})
    out = _gen(engine.url, ["a", None])
    assert out[0]["meta_info"]["weight_version"] == 5 and out[1]["meta_info"]["weight_version"] == 0
    with pytest.raises(EngineHTTPError, match="min"):
        post(engine.url, "/generate", {"input_ids": PROMPT, "lora_path": "a", "exact_weight_version": 4})
    sums = post(engine.url, "/get_lora_adapter_checksums", {"lora_name": "a"})
    tensors, _ = read_adapter_dir(path)
    assert sums["weight_version"] == 5 and sums["sha256"] == {k: tensor_sha256(t) for k, t in tensors.items()}
    info = post(engine.url, "/unload_lora_adapter", {"lora_name": "a"})
    assert info["success"] and info["loaded_adapters"] == {}
    with pytest.raises(EngineHTTPError, match="not loaded"):
        post(engine.url, "/unload_lora_adapter", {"lora_name": "a"})
    bad = _random_adapter(tiny_hf_checkpoint, tmp_path / "bad", ["q_proj"], seed=4, r=4)
    t, c = read_adapter_dir(bad)
    t = {k: (v[:, :-1] if ".lora_A." in k else v) for k, v in t.items()}  # wrong in_features
    with pytest.raises(Exception, match="expected"):
        engine.core.load_lora_adapter("bad", t, c)
    assert engine.core.lora_adapters() == {}


def test_prefill_scoring_runs_under_the_requests_adapter(engine, tiny_hf_checkpoint, tmp_path):
    """An OPD teacher (or the student's own top-k scoring) served with `lora_path`: the input
    log-probs are the adapter's, equal to a PEFT forward, and a mixed batch keeps each row's policy."""
    path = _random_adapter(tiny_hf_checkpoint, tmp_path / "s", ["q_proj", "down_proj"], seed=4)
    post(engine.url, "/load_lora_adapter", {"lora_name": "s", "lora_path": path})
    body = {"input_ids": [PROMPT, PROMPT], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "lora_path": ["s", None]}  # fmt: skip
    with_lora, base = post(engine.url, "/generate", body)
    for out, adapter in ((with_lora, path), (base, None)):
        got = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
        want = _peft_log_probs(tiny_hf_checkpoint, adapter, PROMPT[:1], PROMPT[1:])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert (torch.tensor([e[0] for e in with_lora["meta_info"]["input_token_logprobs"][1:]])
            - torch.tensor([e[0] for e in base["meta_info"]["input_token_logprobs"][1:]])).abs().max() > 1e-3  # fmt: skip


def test_unload_lets_requests_holding_the_adapter_finish_and_refuses_new_ones(
    engine, tiny_hf_checkpoint, tmp_path
):
    """SGLang's unload semantics, which a LoRA run's immutable per-version names rely on: requests
    already holding the adapter finish undisturbed (same tokens as alone), new ones are refused at once."""
    import threading

    path = _random_adapter(tiny_hf_checkpoint, tmp_path / "a", ["q_proj", "down_proj"], seed=5)
    post(engine.url, "/load_lora_adapter", {"lora_name": "old", "lora_path": path})
    alone = _gen(engine.url, ["old"], seed=11, n_tokens=48)[0]
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(out=_gen(engine.url, ["old"], seed=11, n_tokens=48)[0]))

    def mid_generation(core):  # the request holding "old" has generated and is still running
        return any(r.lora == "old" and r.output_tokens > 0 for r in core.running())

    with HoldScheduler(engine.core, mid_generation) as scheduler:  # no step runs until the block exits
        t.start()
        scheduler.wait()
        unloading = threading.Thread(
            target=lambda: post(engine.url, "/unload_lora_adapter", {"lora_name": "old"})
        )
        unloading.start()
        until(lambda: "old" not in engine.core.served_loras())  # the unload has begun draining
        with pytest.raises(EngineHTTPError, match="not loaded"):  # a new request naming it: refused
            _gen(engine.url, ["old"])
        assert "old" in engine.core.lora_adapters()  # but not unloaded under the running request
    unloading.join(30)
    t.join(30)
    assert held["out"]["output_ids"] == alone["output_ids"], "the request holding the adapter finished on it"
    assert held["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.core.lora_adapters() == {}


def test_malformed_and_non_finite_adapters_are_400s_and_load_nothing(engine, tiny_hf_checkpoint, tmp_path):
    """Issue #49, item 12: four malformed adapter configs answered 500; NaN factors and lora_alpha
    1e308 loaded (every later request under them generated garbage)."""
    import json

    from safetensors.torch import load_file, save_file

    good = _random_adapter(tiny_hf_checkpoint, tmp_path / "good", ["q_proj"], seed=5)
    conf = json.loads(open(f"{good}/adapter_config.json").read())
    tensors = load_file(f"{good}/adapter_model.safetensors")
    cases = {
        "no_r": ({k: v for k, v in conf.items() if k != "r"}, tensors, "adapter_config r=None"),
        "r_zero": ({**conf, "r": 0}, tensors, "adapter_config r=0"),
        "r_text": ({**conf, "r": "four"}, tensors, "adapter_config r='four'"),
        "no_alpha": ({k: v for k, v in conf.items() if k != "lora_alpha"}, tensors, "lora_alpha=None"),
        "huge_alpha": ({**conf, "lora_alpha": 1e308}, tensors, "lora_alpha=1e"),
        "nan": (conf, {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, "NaN or inf"),
    }
    for name, (c, t, needle) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(c))
        save_file(t, str(d / "adapter_model.safetensors"))
        with pytest.raises(EngineHTTPError, match=needle) as e:
            post(engine.url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(d)})
        assert e.value.status == 400, (name, e.value)
    assert engine.core.lora_adapters() == {}
    assert len(_gen(engine.url, [None])) == 1  # the engine still serves


def test_an_adapter_belongs_to_the_key_that_loaded_it(tiny_hf_checkpoint, tmp_path, capsys):
    """Issue #49, item 12: any key holder could unload (or unload + reload, i.e. replace) another
    run's adapter on a shared engine. Each run gets its own tenant key; an adapter is owned by the
    key that loaded it (403 naming the adapter for any other tenant); the admin key may do all."""
    from miles_platform.cli import main as cli
    from miles_platform.rollout.http_common import tenant_key

    admin = "the-engine-admin-key"
    server = start_engine_server(
        tiny_hf_checkpoint, api_key=admin, num_threads=1, weight_roots=[str(tmp_path)]
    )
    try:
        a, b = tenant_key(admin, "run-a"), tenant_key(admin, "run-b")
        ad = _random_adapter(tiny_hf_checkpoint, tmp_path / "a", ["q_proj"], seed=1)
        post(server.url, "/load_lora_adapter", {"lora_name": "run-a@v1", "lora_path": ad}, api_key=a)
        post(server.url, "/load_lora_adapter", {"lora_name": "admins", "lora_path": ad}, api_key=admin)
        for name in ("run-a@v1", "admins"):  # b may neither unload nor take over the name
            for route in ("/unload_lora_adapter", "/load_lora_adapter"):
                with pytest.raises(EngineHTTPError) as e:
                    post(server.url, route, {"lora_name": name, "lora_path": ad}, api_key=b)
                assert e.value.status == 403 and f"LoRA adapter {name!r} belongs to" in str(e.value), e.value
        assert server.core.lora_adapters()["run-a@v1"]["owner"] == "run-a"
        with pytest.raises(EngineHTTPError) as e:  # a tenant key swaps no base weights, pauses nothing
            post(server.url, "/pause_generation", {}, api_key=b)
        assert e.value.status == 403
        with pytest.raises(EngineHTTPError) as e:  # a forged tenant key is no key
            post(
                server.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": ad}, api_key=b[:-4] + "0000"
            )
        assert e.value.status == 401
        post(server.url, "/load_lora_adapter", {"lora_name": "run-b@v1", "lora_path": ad}, api_key=b)
        gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "lora_path": "run-b@v1"}
        assert post(server.url, "/generate", gen, api_key=b)["meta_info"]["completion_tokens"] == 2
        post(server.url, "/unload_lora_adapter", {"lora_name": "run-a@v1"}, api_key=a)  # its own
        post(server.url, "/unload_lora_adapter", {"lora_name": "run-b@v1"}, api_key=admin)  # admin: any
        assert set(server.core.lora_adapters()) == {"admins"}
    finally:
        server.stop()
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"MILES_API_KEY": admin}):
        assert cli(["engine-key", "--tenant", "run-a"]) == 0
    assert capsys.readouterr().out.strip() == tenant_key(admin, "run-a")
