"""The trainers' checkpointer (training/checkpoint.py): a save is atomic and its pointer comes last,
optimizer tensors and RNG states come back exactly."""

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_platform.config import RunConfig
from miles_platform.run_lifecycle import remove_dead_writers_tmp
from miles_platform.store.paths import StoragePaths
from miles_platform.training.checkpoint import (
    Checkpointer,
    iter_dir,
    load_optimizer_tensors,
    optimizer_tensors,
    python_rng_state,
    read_latest,
    restore_python_rng,
    restore_rng_tensors,
    rng_tensors,
)


def test_a_save_is_complete_before_its_pointer_and_a_dead_one_leaves_only_staging(tmp_path):
    save = str(tmp_path / "ckpt")
    seen = []

    def files(d: str) -> None:
        Path(d, "model.safetensors").write_bytes(b"weights")
        seen.append(("files", os.path.basename(d), read_latest(save)))

    def marker(d: str) -> None:
        assert Path(d, "model.safetensors").is_file()  # every rank's files first
        Path(d, "state.json").write_text("{}")
        seen.append(("marker", os.path.isdir(iter_dir(save, 3)), read_latest(save)))

    ck = Checkpointer(save, marker="state.json")
    assert ck.save(3, files, marker) == iter_dir(save, 3)
    staging = seen[0][1]
    assert staging.startswith(".iter_0000003.tmp-") and seen[1] == ("marker", False, None)
    assert read_latest(save) == 3 and sorted(os.listdir(iter_dir(save, 3))) == [
        "model.safetensors",
        "state.json",
    ]

    def dies(d: str) -> None:
        Path(d, "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        ck.save(5, dies, marker)
    assert read_latest(save) == 3 and not os.path.exists(iter_dir(save, 5))  # the last one stands
    left = [n for n in os.listdir(save) if n.startswith(".")]
    assert len(left) == 1 and left[0].startswith(".iter_0000005.tmp-")
    # the next launch, under the run lock, removes what the dead save staged
    cfg = RunConfig(
        rollout_batch_size=1, run_name="r", save=save, storage_root=str(tmp_path / "root")
    ).validate()
    logged = []
    remove_dead_writers_tmp(cfg, StoragePaths(cfg.storage_root), logged.append)
    assert [n for n in os.listdir(save) if n.startswith(".")] == [] and len(logged) == 1
    with ck.open_latest() as d:
        assert d == iter_dir(save, 3)
    with Checkpointer(str(tmp_path / "none")).open_latest() as d:
        assert d is None


def _trained_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(
    "fmt",
    [
        {},  # the policy trainer's and the critic's: every state tensor, `<param>::<key>`
        {"sep": ".", "keys": ("exp_avg", "exp_avg_sq"), "full": True},  # the diffusion trainer's
    ],
)
def test_optimizer_tensors_come_back_into_a_fresh_optimizer_exactly(fmt):
    model, opt = _trained_adam(0)
    saved = optimizer_tensors(opt, model.named_parameters(), **fmt)
    sep = fmt.get("sep", "::")
    names = {
        f"{n}{sep}{k}"
        for n, _ in model.named_parameters()
        for k in fmt.get("keys", ("step", "exp_avg", "exp_avg_sq"))
    }
    assert set(saved) == names
    fresh, fresh_opt = _trained_adam(1)
    fresh.load_state_dict(model.state_dict())
    load_optimizer_tensors(fresh_opt, fresh.named_parameters(), saved, sep=sep, full=fmt.get("full", False))
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        for k in fmt.get("keys", ("step", "exp_avg", "exp_avg_sq")):
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), (n, k)


def test_rng_states_come_back_exactly():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    tensors, py = rng_tensors(), python_rng_state()
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    restore_rng_tensors(tensors)
    restore_python_rng(py)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
