"""Embedded, external and SGLang engines stand in for one another: a weight transport they cannot
take is refused before anything starts, and the weight-equality check reads every kind of engine
through SGLang's `/get_weights_by_name` (the stand-in SGLang side is in test_sglang_launcher.py)."""

from __future__ import annotations

import httpx
import pytest
import torch
from loop_helpers import small_run_config
from safetensors.torch import load_file

from miles_platform.config import ConfigError
from miles_platform.loop import CITestFailure, train, validate_before_start
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.weights.equality import first_mismatch


@pytest.mark.parametrize("mode", ["tensor", "mooncake"])
@pytest.mark.parametrize(
    "engines, named",
    [({"rollout_engine": "sglang"}, "--rollout-engine sglang"),
     ({"rollout_external_engine_addrs": ["127.0.0.1:1"]}, "--rollout-external-engine-addrs")],
)  # fmt: skip
def test_actor_only_transport_refused_for_http_engines(tiny_hf_checkpoint, tmp_path, mode, engines, named):
    """`tensor` / `mooncake` load weights through the embedded engine's Ray actor; SGLang's actor has
    no such method (an AttributeError at the first update) and external engines have no actor."""
    cfg = small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, **engines)
    with pytest.raises(ConfigError, match=f"--update-weight-transfer-mode {mode}.*{named}") as e:
        validate_before_start(cfg)
    assert "disk-delta" in str(e.value) and "--rollout-engine embedded" in str(e.value)
    # HTTP transports are fine for them, and no transport runs without trainers or without engines
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode="disk", **engines)
    )
    validate_before_start(
        small_run_config(tiny_hf_checkpoint, tmp_path, update_weight_transfer_mode=mode, debug_rollout_only=True,
                         **engines)
    )  # fmt: skip


def test_embedded_engine_answers_get_weights_by_name_like_sglang(tiny_hf_checkpoint):
    server = start_engine_server(tiny_hf_checkpoint, api_key="s3cret", max_batch_size=4)
    try:
        url, auth = server.url, {"Authorization": "Bearer s3cret"}
        weights = load_file(f"{tiny_hf_checkpoint}/model.safetensors")
        emb = weights["model.embed_tokens.weight"]
        body = {"name": "model.embed_tokens.weight", "truncate_size": 3}
        r = httpx.post(f"{url}/get_weights_by_name", json=body, headers=auth)
        assert r.status_code == 200 and r.json() == emb[:3].tolist()  # first 3 rows, a bare list
        r = httpx.post(f"{url}/get_weights_by_name", json={"name": "lm_head.weight"}, headers=auth)
        assert r.json() == emb[:100].tolist()  # tied head: the embedding, default truncate_size 100
        assert httpx.post(f"{url}/get_weights_by_name", json=body).status_code == 401  # the run's secret
        r = httpx.post(f"{url}/get_weights_by_name", json={"name": "no.such"}, headers=auth)
        assert r.status_code == 400 and "no.such" in r.json()["error"]["message"]

        assert first_mismatch(url, weights, "fp32", api_key="s3cret") is None
        name = "model.layers.0.self_attn.k_proj.weight"
        server.core.update_weights_from_tensors({name: weights[name] * 2}, weight_version=1)
        assert f"tensor {name} differs" in first_mismatch(url, weights, "fp32", api_key="s3cret")
    finally:
        server.stop()


def test_weights_checksum_covers_every_element_in_one_request(tiny_hf_checkpoint):
    """Our `/weights_checksum` extension: one request for all tensors; a change in the last element
    of one tensor (one ulp) is caught and then reported with values from `/get_weights_by_name`."""
    from miles_platform.weights.checksum import checksum

    server = start_engine_server(tiny_hf_checkpoint, api_key="s3cret", max_batch_size=4)
    try:
        url, auth = server.url, {"Authorization": "Bearer s3cret"}
        weights = load_file(f"{tiny_hf_checkpoint}/model.safetensors")
        r = httpx.post(f"{url}/weights_checksum", json={}, headers=auth)
        served = r.json()
        assert r.status_code == 200 and set(weights) <= set(served)
        name = "model.layers.1.mlp.down_proj.weight"
        assert served[name] == {
            "dtype": "float32",
            "shape": list(weights[name].shape),
            "xxh3_128": checksum(weights[name]),
        }
        assert httpx.post(f"{url}/weights_checksum", json={}).status_code == 401
        bad = httpx.post(f"{url}/weights_checksum", json={"names": ["no.such"]}, headers=auth)
        assert bad.status_code == 400 and "no.such" in bad.json()["error"]["message"]
        assert httpx.post(f"{url}/weights_checksum", json={"names": "x"}, headers=auth).status_code == 400

        changed = weights[name].clone()
        changed.view(-1)[-1] = torch.nextafter(changed.view(-1)[-1], torch.tensor(float("inf")))
        server.core.update_weights_from_tensors({name: changed}, weight_version=1)
        why = first_mismatch(url, weights, "fp32", api_key="s3cret")
        assert why and f"tensor {name} differs" in why and "max abs diff" in why
        assert first_mismatch(url, {**weights, name: changed}, "fp32", api_key="s3cret") is None
    finally:
        server.stop()


def test_weight_check_catches_an_external_engine_that_kept_its_old_weights(tiny_hf_checkpoint, tmp_path):
    """An external engine acknowledges /update_weights_from_disk and advances its version but keeps
    the old weights. The check used to skip engines without a Ray actor and let this pass."""
    server = start_engine_server(tiny_hf_checkpoint, api_key="s3cret", max_batch_size=8)

    def acknowledge_only(path, weight_version=None):
        server.core.update_weights_from_tensors({}, weight_version=int(weight_version))
        return int(weight_version)

    server.core.update_weights_from_disk = acknowledge_only
    cfg = small_run_config(
        tiny_hf_checkpoint, tmp_path, num_rollout=1, update_weight_transfer_mode="disk", api_key="s3cret",
        rollout_external_engine_addrs=[server.url.removeprefix("http://")], check_weight_update_equal=True,
    )  # fmt: skip
    try:
        with pytest.raises(CITestFailure, match=f"at v1: engine {server.url} tensor .* differs"):
            train(cfg)
        assert server.core.weight_version == 1  # the update itself went through, over HTTP with the secret
    finally:
        server.stop()


def test_checked_rows_cover_small_tensors_whole_and_bound_big_ones():
    from miles_platform.weights.equality import MAX_CHECKED_ELEMENTS, checked_rows

    assert checked_rows(torch.zeros(8, 4)) == 8
    assert checked_rows(torch.zeros(MAX_CHECKED_ELEMENTS, 4)) == MAX_CHECKED_ELEMENTS // 4
    assert checked_rows(torch.zeros(7)) == 7


def test_a_bf16_engine_serves_qwen3_5s_a_log_in_fp32_as_stored_and_the_check_expects_it(
    tiny_hf_checkpoint, tmp_path
):
    """models/gdn.py: Qwen3.5's log decay rates load into fp32 as stored (not rounded through bf16) and are
    served in fp32 at --dtype bf16, as SGLang serves them; the weight-equality check casts the trainer's A_log
    to fp32 and everything else to bf16, so the checkpoint's own weights pass and a bf16-rounded A_log fails."""
    import sys
    from pathlib import Path

    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_qwen3_5_bridge import q35_config, sharp_q35

    ckpt = str(tmp_path / "q35")
    save_hf_checkpoint(sharp_q35(q35_config(len(load_tokenizer(tiny_hf_checkpoint)), "qwen3_5")),
                       load_tokenizer(tiny_hf_checkpoint), ckpt)  # fmt: skip
    weights = load_file(f"{ckpt}/model.safetensors")
    a_log = [k for k in weights if k.endswith(".linear_attn.A_log")]
    assert a_log and weights[a_log[0]].dtype == torch.float32
    server = start_engine_server(ckpt, api_key="s3cret", dtype="bf16", max_batch_size=4)
    try:
        served = httpx.post(f"{server.url}/weights_checksum", json={"names": [a_log[0], "lm_head.weight"]},
                            headers={"Authorization": "Bearer s3cret"}).json()  # fmt: skip
        assert served[a_log[0]]["dtype"] == "float32" and served["lm_head.weight"]["dtype"] == "bfloat16"
        assert first_mismatch(server.url, weights, "bf16", api_key="s3cret") is None
        rounded = {**weights, a_log[0]: weights[a_log[0]].bfloat16().float()}
        assert not torch.equal(rounded[a_log[0]], weights[a_log[0]])
        why = first_mismatch(server.url, rounded, "bf16", api_key="s3cret")
        assert why and f"tensor {a_log[0]} differs" in why
    finally:
        server.stop()
    # an fp8-quantized checkpoint (its Linear weights; A_log stays as stored) is served with A_log as stored too
    from miles_platform.weights.quantize import load_dense_hf_model, quantize_checkpoint

    quantize_checkpoint(ckpt, str(tmp_path / "q35_fp8"), "fp8")
    model = load_dense_hf_model(str(tmp_path / "q35_fp8"), torch.bfloat16)
    got = dict(model.named_parameters())[a_log[0]]
    assert got.dtype == torch.float32 and torch.equal(got, weights[a_log[0]])
