"""A run from an fp8 / int4 rollout checkpoint: the engines serve it at every version, --ci-test holds."""

import json
import re

import httpx
import pytest
import torch
from loop_helpers import small_run_config

from miles_platform.loop import Reporter, train
from miles_platform.store.lineage_identity import read_edges
from miles_platform.store.paths import StoragePaths, served_path
from miles_platform.training.qat import QAT_FLAG_ENV, QAT_GROUP_ENV
from miles_platform.weights.quantize import quantize_checkpoint
from miles_platform.weights.rollout_quant import read_served_state, rollout_quant


class _ServedFormat(Reporter):
    """After each rollout (its weight update done): what every engine says it serves."""

    def __init__(self, api_key: str):
        self.api_key, self.urls, self.served, self.logs = api_key, [], [], []

    def log(self, msg: str) -> None:
        self.logs.append(msg)
        if msg.startswith("engines "):
            self.urls = re.findall(r"http://127\.0\.0\.1:\d+", msg.partition(" router ")[0])

    def on_rollout(self, rollout_id, metrics) -> None:
        auth = {"Authorization": f"Bearer {self.api_key}"}
        infos = [httpx.get(f"{u}/get_server_info", headers=auth, timeout=10).json() for u in self.urls]
        self.served.append([(i["weight_version"], i["quantization"]) for i in infos])


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_quantized_rollout_checkpoint_is_served_quantized_after_every_update(
    tiny_hf_checkpoint, tmp_path, fmt
):
    """fp8; int4 with Miles' INT4 QAT on (through --train-env-vars): step 0's trainer-vs-engine check holds."""
    q = str(tmp_path / fmt)
    quantize_checkpoint(tiny_hf_checkpoint, q, fmt, group_size=16)
    qat = {"train_env_vars": json.dumps({QAT_FLAG_ENV: "1", QAT_GROUP_ENV: "16"})} if fmt == "int4" else {}
    # --ci-test: the step-0 checks, and after each update the engines' weights == dequant(quantize(trainer's))
    # an entropy bonus moves the weights even when every reward is 0 (the untrained model)
    cfg = small_run_config(q, tmp_path, ci_test=True, api_key="k" * 32, entropy_coef=0.01, **qat)
    probe = _ServedFormat(cfg.api_key)
    res = train(cfg, probe)
    assert res.final_version == 2 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-6
    assert probe.served == [[(1, fmt)], [(2, fmt)]]
    assert any(m.startswith("INT4 QAT on") for m in probe.logs) == bool(qat)
    assert any(m.startswith("[ci-test] rollout 1: ") for m in probe.logs)  # checked at every rollout
    # rollout 1 ran on v1: the trainer (moved off the grid by a step) vs what the engine served of it
    after = res.metrics[1]["train/train_rollout_logprob_abs_diff"]
    # measured: fp8 2.9e-3; int4 with QAT 2.4e-7 (without QAT 1.0e-2): training sees what serving sees
    assert after < 1e-5 if qat else after > 1e-4, after
    rq, paths = rollout_quant(q), StoragePaths(cfg.storage_root)
    edges = {(e.child, e.parent, e.relation) for e in read_edges(paths, "t")}
    assert {(f"quantized:t.v00000{v}:{fmt}", f"t.v00000{v}", "quantized_as") for v in (1, 2)} <= edges
    for v in (1, 2):  # each served version is on disk beside its dense export: quantize(export), bit for bit
        export = paths.hf_export("t", v)
        dense, dense_fmt, _ = read_served_state(export)
        _, served_fmt, stored = read_served_state(served_path(export, fmt))
        assert (dense_fmt, served_fmt) == (None, fmt)
        want = {n: t for n, t in rq.quantize(dense).items() if n in stored}
        assert want.keys() == stored.keys()
        assert all(torch.equal(stored[n].view(torch.uint8), want[n].view(torch.uint8)) for n in stored)
