"""A run from an fp8 rollout checkpoint: the engines serve fp8 at every version, --ci-test holds."""

import re

import httpx
import torch
from loop_helpers import small_run_config

from miles_platform.loop import Reporter, train
from miles_platform.store.paths import StoragePaths
from miles_platform.weights.quantize import quantize_checkpoint
from miles_platform.weights.rollout_quant import read_served_state, rollout_quant, served_path


class _ServedFormat(Reporter):
    """After each rollout (its weight update done): what every engine says it serves."""

    def __init__(self, api_key: str):
        self.api_key, self.urls, self.served = api_key, [], []

    def log(self, msg: str) -> None:
        if msg.startswith("engines "):
            self.urls = re.findall(r"http://127\.0\.0\.1:\d+", msg.partition(" router ")[0])

    def on_rollout(self, rollout_id, metrics) -> None:
        auth = {"Authorization": f"Bearer {self.api_key}"}
        infos = [httpx.get(f"{u}/get_server_info", headers=auth, timeout=10).json() for u in self.urls]
        self.served.append([(i["weight_version"], i["quantization"]) for i in infos])


def test_an_fp8_rollout_checkpoint_is_served_as_fp8_after_every_update(tiny_hf_checkpoint, tmp_path):
    q = str(tmp_path / "fp8")
    quantize_checkpoint(tiny_hf_checkpoint, q, "fp8")
    # --ci-test: the step-0 checks, and after each update the engines' weights == dequant(quantize(trainer's))
    cfg = small_run_config(q, tmp_path, ci_test=True, api_key="k" * 32)
    probe = _ServedFormat(cfg.api_key)
    res = train(cfg, probe)
    assert res.final_version == 2 and res.ci_checks["train_rollout_logprob_abs_diff"] < 1e-6
    assert probe.served == [[(1, "fp8")], [(2, "fp8")]]
    rq, paths = rollout_quant(q), StoragePaths(cfg.storage_root)
    for v in (1, 2):  # each served version is on disk beside its dense export: quantize(export), bit for bit
        export = paths.hf_export("t", v)
        dense, fmt, _ = read_served_state(export)
        _, served_fmt, stored = read_served_state(served_path(export, "fp8"))
        assert (fmt, served_fmt) == (None, "fp8")
        want = {n: t for n, t in rq.quantize(dense).items() if n in stored}
        assert want.keys() == stored.keys()
        assert all(torch.equal(stored[n].view(torch.uint8), want[n].view(torch.uint8)) for n in stored)
