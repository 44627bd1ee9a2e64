"""`broadcast` weight transport: SGLang's weights-update-group API on a real gloo group (CPU)."""

import threading

import httpx
import torch
from loop_helpers import small_run_config

from miles_platform.loop import train
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.weights.transports.broadcast import (
    broadcast,
    dtype_name,
    new_weights_group,
    weights_update_endpoint,
)


def _cfg(ckpt, tmp_path, **kw):
    return small_run_config(ckpt, tmp_path, **kw)


def _in_thread(fn):
    """Run fn while the caller makes its HTTP call: the collective needs both ranks at once."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _update(url, group, named, version):
    """Rank 0 broadcasts `named` while the engine receives it via /update_weights_from_distributed."""

    def send():
        for t in named.values():
            broadcast(group, t.contiguous())

    body = {
        "names": list(named),
        "dtypes": [dtype_name(t.dtype) for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()],
        "group_name": "g",
        "weight_version": version,
    }
    t, out = _in_thread(send)
    r = httpx.post(f"{url}/update_weights_from_distributed", json=body, timeout=60)
    t.join(60)
    assert "error" not in out, out.get("error")
    return r


def test_engine_receives_weights_by_broadcast_and_rejects_a_bad_shape(tiny_hf_checkpoint):
    server = start_engine_server(tiny_hf_checkpoint)
    try:
        ep = weights_update_endpoint()
        assert ep["backend"] == "gloo" and ep["master_address"] == "127.0.0.1"
        t, out = _in_thread(
            lambda: new_weights_group(ep["master_address"], ep["master_port"], 0, 2, "g", "gloo", 30)
        )
        r = httpx.post(
            f"{server.url}/init_weights_update_group",
            json={**ep, "rank_offset": 1, "world_size": 2, "group_name": "g"},
            timeout=60,
        )
        t.join(60)
        assert r.status_code == 200 and r.json()["success"], r.text
        group = out["value"]

        old = server.core.get_weights()
        torch.manual_seed(0)
        new = {n: w + 0.01 * torch.randn_like(w) for n, w in old.items()}
        r = _update(server.url, group, new, 3)
        assert r.status_code == 200 and r.json()["success"], r.text
        got = server.core.get_weights()
        assert all(torch.equal(got[n], new[n]) for n in new)
        assert not torch.equal(got["model.embed_tokens.weight"], old["model.embed_tokens.weight"])
        assert server.core.weight_version == 3

        # a wrong shape arrives over the wire but is refused at load: old weights and version stay
        name = next(iter(new))
        bad = {**new, name: torch.zeros(new[name].shape[0] + 1, *new[name].shape[1:])}
        r = _update(server.url, group, bad, 4)
        assert r.status_code == 400 and not r.json()["success"]
        assert name in r.json()["message"] and "kept weight_version 3" in r.json()["message"]
        assert server.core.weight_version == 3
        assert all(torch.equal(server.core.get_weights()[n], new[n]) for n in new)

        # the group is still in step: a good update after the refused one lands
        newer = {n: w * 0.5 for n, w in new.items()}
        r = _update(server.url, group, newer, 4)
        assert r.status_code == 200, r.text
        assert server.core.weight_version == 4
        assert all(torch.equal(server.core.get_weights()[n], newer[n]) for n in newer)
    finally:
        server.stop()


def test_update_without_a_group_is_refused(tiny_hf_checkpoint):
    server = start_engine_server(tiny_hf_checkpoint)
    try:
        body = {"names": [], "dtypes": [], "shapes": [], "group_name": "nope"}
        r = httpx.post(f"{server.url}/update_weights_from_distributed", json=body, timeout=30)
        assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    finally:
        server.stop()


def test_loop_updates_engines_by_broadcast(tiny_hf_checkpoint, tmp_path):
    cfg = _cfg(
        tiny_hf_checkpoint,
        tmp_path,
        update_weight_transfer_mode="broadcast",
        check_weight_update_equal=True,
    )
    res = train(cfg)
    # check_weight_update_equal compares every engine's weights with the trainer's after each update
    assert res.final_version == 2 and len(res.versions) == 2
