"""Weights out of any megatron layout: the HF export at TP2, PP2, interleaved PP2 and EP2 (the tiny
Qwen3-MoE) is the TP1 export byte for byte (the safetensors file an engine or disk-delta reads), kept
by the first rank of each model replica only, whatever the bucket size (CP2, which splits no weight:
test_megatron_layouts.py checks who keeps it), and the
broadcast transport streams the same tensors bucket by bucket from a TP2 trainer to an engine rank.

Buckets follow Miles' `--update-weight-buffer-size` rule: a unit (the embedding, one layer, the final
norm + output layer) is never split; the next unit starts a new bucket once the bucket would reach
the size. At 1 byte every unit is its own bucket.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import pytest
import torch
from loop_helpers import run_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2_interleaved": (2, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)),
    "ep2": (2, dict(expert_model_parallel_size=2)),  # the tiny Qwen3-MoE: each rank holds 2 of 4 experts
}


def _actor(ckpt, rank, world, port, **overrides):
    from miles_platform.config import RunConfig
    from miles_platform.training.actor import TrainerActor

    cfg = RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                    global_batch_size=4, actor_num_gpus_per_node=world, **overrides).validate()  # fmt: skip
    return TrainerActor(cfg, rank, world, f"tcp://127.0.0.1:{port}")


BUFFERS = (512 * 1024**2, 1)  # one bucket; every unit its own bucket


def _export_worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict) -> None:
    """One actor exports at each of BUFFERS (the backend reads --update-weight-buffer-size at each
    export) into `<out>/<buffer>/`."""
    torch.set_num_threads(1)
    from miles_platform.training import megatron_shims

    try:
        actor = _actor(ckpt, rank, world, port, **overrides)
        for buffer in BUFFERS:
            actor.cfg.update_weight_buffer_size = buffer
            sub = Path(out, str(buffer))
            sub.mkdir(exist_ok=True)
            sizes = [
                sum(t.numel() * t.element_size() for t in b.values()) for b in actor.backend.hf_buckets()
            ]
            weights = actor.get_hf_weights()
            if weights:
                save_file(weights, f"{sub}/rank{rank}.safetensors")
            Path(f"{sub}/rank{rank}.json").write_text(json.dumps({"buckets": sizes, "kept": len(weights)}))
    except Exception:
        Path(f"{out}/rank{rank}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


def _run(fn, nprocs: int, args: tuple, out: Path) -> None:
    run_ranks(fn, args, nprocs, out)


@pytest.fixture(scope="module")
def layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from miles_platform.models.tiny import save_layout_checkpoint

    return save_layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("weights") / "l4")


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from test_moe_megatron import save_moe_checkpoint

    return save_moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("weights_moe") / "moe")


@pytest.fixture(scope="module")
def moe_tp1_export(moe_checkpoint, tmp_path_factory):
    """The tiny Qwen3-MoE's 1-rank export (its checkpoint stores the experts fused, transformers' layout;
    the export names each expert, as the engines load Qwen3-MoE)."""
    out = tmp_path_factory.mktemp("moe_tp1") / "out"
    _run(_export_worker, 1, (1, free_port(), moe_checkpoint, str(out), {}), out)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_is_the_tp1_export_byte_for_byte(layout, request, tmp_path):
    world, flags = LAYOUTS[layout]
    moe = layout == "ep2"
    layout_checkpoint = request.getfixturevalue("moe_checkpoint" if moe else "layout_checkpoint")
    out = tmp_path / "out"
    _run(_export_worker, world, (world, free_port(), layout_checkpoint, str(out), flags), out)
    # the dense TP1 export is the checkpoint itself (tests/megatron_parity.py); its safetensors bytes are
    # the bytes of the same dict written by the same writer
    reference = tmp_path / "reference.safetensors"
    save_file(load_file(Path(layout_checkpoint) / "model.safetensors"), reference)
    units = 2 + 4  # embedding, 4 layers, final norm (tied: no output layer)
    for buffer in BUFFERS:
        got = out / str(buffer)
        if moe:  # the MoE's 1-rank export, and its units: embedding, 2 layers, final norm + output layer
            reference, units = (
                request.getfixturevalue("moe_tp1_export") / str(buffer) / "rank0.safetensors",
                4,
            )
        assert (got / "rank0.safetensors").read_bytes() == reference.read_bytes(), f"buffer {buffer}"
        info = [json.loads((got / f"rank{r}.json").read_text()) for r in range(world)]
        kept = [i["kept"] > 0 for i in info]
        # the first rank of each model replica (TP x PP) keeps the state; EP2 is data parallel 2
        replicas = 2 if moe else 1
        assert kept == [True] * replicas + [False] * (world - replicas), f"buffer {buffer}: {kept}"
        assert len(info[0]["buckets"]) == (units if buffer == 1 else 1), (
            f"buffer {buffer}: {info[0]['buckets']}"
        )


def _broadcast_worker(rank: int, world: int, port: int, group_port: int, ckpt: str, out: str) -> None:
    """Ranks 0..1: a TP2 trainer; rank 2: an engine receiving the weights group's broadcasts."""
    torch.set_num_threads(1)
    from miles_platform.training import megatron_shims
    from miles_platform.weights.transports.broadcast import broadcast, new_weights_group, parse_dtype

    meta = Path(out, "meta.json")
    try:
        if rank == 2:
            while not meta.exists():
                time.sleep(0.1)
            m = json.loads(meta.read_text())
            group = new_weights_group("127.0.0.1", group_port, 1, 2, "w", "gloo")
            got = {}
            for n, d, s in zip(m["names"], m["dtypes"], m["shapes"], strict=True):
                got[n] = torch.empty(s, dtype=parse_dtype(d))
                broadcast(group, got[n])
            save_file(got, f"{out}/engine.safetensors")
            return
        actor = _actor(ckpt, rank, 2, port, tensor_model_parallel_size=2, update_weight_buffer_size=1)
        state = actor.get_hf_weights()
        if rank == 0:
            names = list(state)[::-1]  # an order the buckets do not come in: held until due
            meta.write_text(json.dumps({"names": names, "dtypes": [str(state[n].dtype).removeprefix("torch.")
                                        for n in names], "shapes": [list(state[n].shape) for n in names]}))  # fmt: skip
            actor.init_weights_update_group("127.0.0.1", group_port, 2, "w", "gloo")
            Path(out, "sent.json").write_text(json.dumps(actor.broadcast_weights("w", names)))
        else:
            actor.broadcast_weights("w", None)
    except Exception:
        Path(f"{out}/rank{rank}.error").write_text(traceback.format_exc())
    finally:
        if rank < 2:
            megatron_shims.destroy_process_group()


def test_broadcast_streams_a_tp2_trainers_buckets_to_an_engine(layout_checkpoint, tmp_path):
    out = tmp_path / "bcast"
    _run(_broadcast_worker, 3, (3, free_port(), free_port(), layout_checkpoint, str(out)), out)
    got = load_file(out / "engine.safetensors")
    want = load_file(Path(layout_checkpoint) / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    sent = json.loads((out / "sent.json").read_text())["names"]
    assert sent == json.loads((out / "meta.json").read_text())["names"] and sent != list(got)
