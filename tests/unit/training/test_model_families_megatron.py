"""Qwen2 and Llama on megatron-core: HF -> torch_dist (TP=2) -> HF bit-exact, and logits, loss and
gradients of the megatron GPTModel equal HF's (transformers' own Qwen2ForCausalLM /
LlamaForCausalLM) in fp32. A control drops the family's difference (Qwen2's q/k/v biases, Llama's
llama3 rope scaling) and shows parity would then fail, so the mapping is what makes it pass.

Everything touching torch.distributed runs in a subprocess (this file as a script), one per family.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_helpers import warm_python
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
TOL = 1e-5  # fp32 parity (as tests/unit/training/test_megatron_backend.py)
FAMILIES = ["qwen2", "llama"]


def save_family_checkpoint(family: str, tok_dir: str, path: Path) -> str:
    """GQA with 2 query groups (TP=2 splits whole groups), untied embeddings, norm weights drawn away
    from HF's init of 1 (a norm mapped to the wrong place shows in the logits), and q/k projections
    scaled up so attention is sharp, not HF init's near-uniform: positions (RoPE) then matter."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint
    from miles_platform.models.families import build_model, tiny_config

    tok = load_tokenizer(tok_dir)
    cfg = tiny_config(family, len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    model = build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
    save_hf_checkpoint(model, tok, path)
    return str(path)


@pytest.fixture(scope="module", params=FAMILIES)
def report(request, tiny_hf_checkpoint, tmp_path_factory):
    family = request.param
    work = tmp_path_factory.mktemp(f"mf_{family}")
    hf = save_family_checkpoint(family, tiny_hf_checkpoint, work / "hf")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([*warm_python(), __file__, family, hf, str(work)], capture_output=True, text=True,
                          env=env, timeout=400, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return family, hf, work, json.loads(proc.stdout.strip().splitlines()[-1])


def test_hf_to_torch_dist_to_hf_is_bit_exact(report):
    family, hf, work, r = report
    assert len(list((work / "td" / "release").glob("*.distcp"))) == 2  # TP=2: one file per rank
    a, b = load_file(f"{hf}/model.safetensors"), load_file(str(work / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert any(k.endswith("q_proj.bias") for k in a) is (family == "qwen2")
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert r["to_torch_dist"]["content_hash"] and r["to_hf"]["tensors"] == len(a)


def test_megatron_logits_loss_grads_match_hf_in_fp32(report):
    family, _, _, r = report
    p = r["parity"]
    assert p["logits_max_abs_diff"] < TOL and p["loss_abs_diff"] < TOL and p["grad_max_abs_diff"] < TOL
    assert p["grads_compared"] == p["hf_params"] and p["export_identical"]


def test_without_the_family_mapping_parity_fails(report):
    """Over 512 positions the mapped model is within the bound; Qwen2 with zeroed q/k/v biases or
    Llama with default rope is far outside it."""
    family, _, _, r = report
    c = r["control"]
    assert c["mapped_logits_max_abs_diff"] < TOL
    assert c["dropped"] == {"qwen2": "qkv_bias", "llama": "rope_scaling"}[family]
    assert c["logits_max_abs_diff"] > 1000 * TOL


def test_refused_family_config_names_the_field(tiny_hf_checkpoint, tmp_path):
    """hf-to-torch-dist refuses a Llama whose rope megatron cannot reproduce, before writing anything."""
    from miles_platform.errors import CheckpointError
    from miles_platform.weights import conversion

    hf = Path(save_family_checkpoint("llama", tiny_hf_checkpoint, tmp_path / "hf"))
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "yarn"
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_type 'yarn'.*--train-backend fsdp"):
        conversion.hf_to_torch_dist(str(hf), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- subprocess side


def _control(family: str, hf_path: str, T: int = 512) -> dict:
    """Megatron logits against HF's over T positions, with the bridge's mapping and with the family's
    difference dropped. llama3 scaling only touches frequencies whose wavelength exceeds 2048
    positions, so it shows in the logits only over hundreds of positions, not the 12 of _compare."""
    from miles_platform.models.checkpoint import load_hf_model, validate_hf_dir
    from miles_platform.training import megatron_backend as mb

    hf = load_hf_model(hf_path)
    ids = torch.randint(0, hf.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T).expand(2, T)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos).logits

    def diff(cfg, sd) -> float:
        model, bridge = mb.build_gpt_model(cfg)
        full = bridge.hf_to_megatron(sd, cfg, padded_vocab_size=bridge.gpt_model_kwargs(cfg)["vocab_size"])
        mb.load_full_state(model, full)
        with torch.no_grad():
            got = model(ids, pos, causal[None, None])[..., : cfg["vocab_size"]]
        return (got - want).abs().max().item()

    cfg, sd = validate_hf_dir(hf_path), dict(hf.state_dict())
    out = dict(mapped_logits_max_abs_diff=diff(cfg, sd), positions=T)
    if family == "qwen2":
        sd = {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in sd.items()}
        out["dropped"] = "qkv_bias"
    else:
        cfg = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "default"}}
        out["dropped"] = "rope_scaling"
    out["logits_max_abs_diff"] = diff(cfg, sd)
    return out


def _main(family: str, hf: str, work: str) -> None:
    from contextlib import redirect_stdout
    from io import StringIO

    from megatron_parity import compare

    from miles_platform.training import megatron_shims
    from miles_platform.weights import conversion

    torch.set_num_threads(1)
    report, w = {}, Path(work)
    for name, argv in (
        ("to_torch_dist", ["hf-to-torch-dist", "--hf-checkpoint", hf, "--save", str(w / "td"),
                           "--tensor-model-parallel-size", "2"]),
        ("to_hf", ["torch-dist-to-hf", "--load", str(w / "td"), "--hf-checkpoint", hf, "--save", str(w / "back")]),
    ):  # fmt: skip
        buf = StringIO()
        with redirect_stdout(buf):
            assert conversion.cli_main(argv) == 0
        report[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    report["parity"], _, _ = compare(hf, w)
    report["control"] = _control(family, hf)
    megatron_shims.destroy_process_group()
    print(json.dumps(report))


if __name__ == "__main__":
    _main(*sys.argv[1:])
