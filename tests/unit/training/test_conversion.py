"""HF <-> torch_dist conversion: TP=2 save -> TP=1 load bit-exact, bad input refused (TP=1 round
trip through the CLI: tests/dagster/test_conversion_asset.py).

Anything that initializes torch.distributed runs in a subprocess (this file run as a script),
so the pytest process stays clean.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_helpers import warm_python
from safetensors.torch import load_file

from miles_platform.errors import CheckpointError
from miles_platform.weights import conversion

REPO = Path(__file__).resolve().parents[3]


def _run_script(*args: str, timeout: int = 240) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run(
        [*warm_python(), __file__, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _hf_tensors(path) -> dict:
    return load_file(str(Path(path) / "model.safetensors"))


def _assert_bit_exact(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _no_leftovers(save: Path):
    assert not save.exists()
    assert not [p for p in save.parent.iterdir() if p.name.startswith(f".{save.name}.")]


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # the tiny Qwen3-MoE, Miles' MoE layout: TP2 for attention, 2 of the 4 experts per rank, unsplit
    "tp2_ep2_etp1": [
        "--tensor-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--expert-tensor-parallel-size",
        "1",
    ],
}


@pytest.fixture(scope="module")
def moe_hf_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from test_moe_megatron import save_moe_checkpoint

    return save_moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("moe") / "hf")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_save_loads_at_one_rank(layout, untied_hf_checkpoint, moe_hf_checkpoint, tmp_path):
    """2 gloo ranks each save their shards (TP slices, a pipeline stage's layers, an expert rank's
    experts); a 1-rank load gives back the same tensors."""
    hf = moe_hf_checkpoint if "ep2" in layout else untied_hf_checkpoint
    td, back = tmp_path / "td2", tmp_path / "back2"
    out = _run_script(hf, str(td), str(back), *LAYOUTS[layout])
    assert len(list((td / "release").glob("*.distcp"))) == 2  # one file per rank
    assert out["stdlib_fork_server"] is False  # rank 1 forked from the script, no fresh interpreter
    if "ep2" not in layout:
        assert out["to_torch_dist"]["tensors"] == 11  # untied: + output_layer
    _assert_bit_exact(_hf_tensors(hf), _hf_tensors(back))


def test_layouts_the_model_does_not_split_are_refused(untied_hf_checkpoint, tmp_path):
    for flags, match in (
        (dict(pipeline_model_parallel_size=3), "must divide num_hidden_layers"),
        (dict(expert_model_parallel_size=2), "the model has no experts"),
        (dict(tensor_model_parallel_size=4), "must divide num_key_value_heads"),
    ):
        with pytest.raises(CheckpointError, match=match):
            conversion.hf_to_torch_dist(untied_hf_checkpoint, tmp_path / "out", **flags)
        _no_leftovers(tmp_path / "out")


@pytest.fixture(scope="module")
def untied_hf_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """GQA with 2 query groups (so TP=2 splits whole groups), untied embeddings, odd vocab."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config

    tok = load_tokenizer(tiny_hf_checkpoint)
    cfg = tiny_qwen3_config(
        len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("untied") / "hf"
    save_hf_checkpoint(build_model(cfg, seed=1), tok, path)
    return str(path)


def _copy_with(src, dst, mutate) -> str:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    sd = _hf_tensors(dst)
    mutate(sd)
    save_file(sd, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_tensor_refused(tiny_hf_checkpoint, tmp_path):
    bad = _copy_with(
        tiny_hf_checkpoint, tmp_path / "bad", lambda sd: sd.pop("model.layers.1.self_attn.q_norm.weight")
    )
    save = tmp_path / "out"
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.q_norm.weight"):
        conversion.hf_to_torch_dist(bad, save)
    _no_leftovers(save)


def test_shape_mismatch_refused(tiny_hf_checkpoint, tmp_path):
    def widen(sd):
        sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 65)

    bad = _copy_with(tiny_hf_checkpoint, tmp_path / "bad", widen)
    save = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight.*\(32, 65\).*\(32, 64\)"):
        conversion.hf_to_torch_dist(bad, save)
    _no_leftovers(save)


def test_unsupported_architecture_refused(tiny_hf_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_checkpoint, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        conversion.hf_to_torch_dist(bad, tmp_path / "out")
    _no_leftovers(tmp_path / "out")


def test_torch_dist_without_metadata_refused_by_cli(tiny_hf_checkpoint, tmp_path):
    ckpt = tmp_path / "td" / "release"
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"\0" * 16)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "td" / "latest_checkpointed_iteration.txt").write_text("release")
    save = tmp_path / "out"
    proc = subprocess.run(
        [*warm_python(), "-m", "miles_platform.cli", "convert", "torch-dist-to-hf", "--load", str(tmp_path / "td"),
         "--hf-checkpoint", tiny_hf_checkpoint, "--save", str(save)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert ".metadata" in proc.stderr and "Traceback" not in proc.stderr
    _no_leftovers(save)


def test_failure_midway_leaves_previous_save_untouched(tiny_hf_checkpoint, tmp_path, monkeypatch):
    save = tmp_path / "out"
    save.mkdir()
    (save / "keep.txt").write_text("old")

    def crash(*a, **k):
        raise RuntimeError("writer died")

    monkeypatch.setattr(conversion, "_run_ranks", crash)
    with pytest.raises(RuntimeError, match="writer died"):
        conversion.hf_to_torch_dist(tiny_hf_checkpoint, save)
    assert [p.name for p in save.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _main(hf: str, td: str, back: str, *layout: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, argv in (
        ("to_torch_dist", ["hf-to-torch-dist", "--hf-checkpoint", hf, "--save", td, *layout]),
        ("to_hf", ["torch-dist-to-hf", "--load", td, "--hf-checkpoint", hf, "--save", back]),
    ):
        from contextlib import redirect_stdout
        from io import StringIO

        buf = StringIO()
        with redirect_stdout(buf):
            assert conversion.cli_main(argv) == 0
        results[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    from multiprocessing import forkserver

    results["stdlib_fork_server"] = forkserver._forkserver._forkserver_pid is not None
    print(json.dumps(results))


if __name__ == "__main__":
    _main(*sys.argv[1:])
