"""`miles-platform weights publish | apply | list` as an operator runs them."""

import shutil

import torch
from safetensors.torch import load_file, save_file

from miles_platform.cli import main


def _target(tiny, tmp_path, seed=1):
    d = tmp_path / f"target{seed}"
    shutil.copytree(tiny, d)
    s = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    s = {k: v + 1e-3 * (torch.rand(v.shape, generator=g) < 0.2) for k, v in s.items()}
    save_file(s, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, s


def test_publish_apply_list(tiny_hf_checkpoint, tmp_path, capsys):
    pub, local = tmp_path / "pub", tmp_path / "replica"
    shutil.copytree(tiny_hf_checkpoint, local)
    t1, s1 = _target(tiny_hf_checkpoint, tmp_path, 1)
    args = ["weights", "publish", "--base", tiny_hf_checkpoint, "--target", str(t1), "--out", str(pub)]
    assert main(args + ["--encoding", "overwrite", "--checksum", "blake3"]) == 0
    out = capsys.readouterr().out
    assert "published v0 (snapshot" in out and "published v1 (delta, base v0)" in out
    assert main(["weights", "apply", "--pub", str(pub), "--checkpoint", str(local)]) == 0
    got = load_file(str(local / "model.safetensors"))
    assert all(torch.equal(got[k], s1[k]) for k in s1)
    # next version from t1 -> t2; a wrong --base is refused
    t2, s2 = _target(str(t1), tmp_path, 2)
    bad = ["weights", "publish", "--base", tiny_hf_checkpoint, "--target", str(t2), "--out", str(pub)]
    assert main(bad) == 2
    assert "is not the latest publication v1" in capsys.readouterr().err
    assert main(["weights", "publish", "--base", str(t1), "--target", str(t2), "--out", str(pub)]) == 0
    capsys.readouterr()
    assert main(["weights", "list", "--pub", str(pub)]) == 0
    out = capsys.readouterr().out
    assert "LATEST v2" in out and len([ln for ln in out.splitlines() if "delta" in ln]) == 2


def test_apply_failure_is_one_line_and_leaves_checkpoint(tiny_hf_checkpoint, tmp_path, capsys):
    pub, local = tmp_path / "pub", tmp_path / "replica"
    shutil.copytree(tiny_hf_checkpoint, local)
    t1, _ = _target(tiny_hf_checkpoint, tmp_path, 1)
    main(["weights", "publish", "--base", tiny_hf_checkpoint, "--target", str(t1), "--out", str(pub)])
    payload = pub / "weight_v000001" / "payload.bin"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    before = {f.name: f.read_bytes() for f in local.iterdir()}
    capsys.readouterr()
    assert main(["weights", "apply", "--pub", str(pub), "--checkpoint", str(local)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "weight_v000001" in err and "tensor" in err
    assert {f.name: f.read_bytes() for f in local.iterdir()} == before


def test_list_without_pub_finds_every_runs_publications_under_the_storage_root(
    tiny_hf_checkpoint, tmp_path, capsys
):
    from miles_platform.store.paths import StoragePaths

    paths = StoragePaths(str(tmp_path / "root"))
    assert main(["weights", "list", "--storage-root", paths.root]) == 1
    assert "no publications under" in capsys.readouterr().err
    for run in ("a", "b"):
        t1, _ = _target(tiny_hf_checkpoint, tmp_path / run, 1)
        pub = paths.publications(run)
        assert (
            main(["weights", "publish", "--base", tiny_hf_checkpoint, "--target", str(t1), "--out", pub]) == 0
        )
    capsys.readouterr()
    assert main(["weights", "list", "--storage-root", paths.root]) == 0
    out = capsys.readouterr().out
    assert f"{paths.publications('a')}: LATEST v1" in out and f"{paths.publications('b')}: LATEST v1" in out


def test_a_nan_or_reshaped_target_and_a_fifo_in_a_publication_are_refused_cleanly(
    tiny_hf_checkpoint, tmp_path, capsys
):
    """Issue #49, item 12: a NaN or shape-changed target was published (and a NaN one would reach
    every replica); a FIFO planted as a publication's payload made `weights apply` block forever.
    Now each is one line naming the tensor or the file, and nothing is written."""
    import os

    def edit(name, fn):
        d = tmp_path / name
        shutil.copytree(tiny_hf_checkpoint, d)
        s = load_file(str(d / "model.safetensors"))
        s["model.norm.weight"] = fn(s["model.norm.weight"].clone())
        save_file(s, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    def nan(w):
        w[0] = float("nan")
        return w

    cases = [(edit("nan", nan), "model.norm.weight: 1 non-finite value(s)"),
             (edit("wide", lambda w: torch.cat([w, w[:1]])), "model.norm.weight: --target has torch.float32 [")]  # fmt: skip
    for target, why in cases:
        out = tmp_path / f"pub-{target.name}"
        capsys.readouterr()
        assert (
            main(
                [
                    "weights",
                    "publish",
                    "--base",
                    tiny_hf_checkpoint,
                    "--target",
                    str(target),
                    "--out",
                    str(out),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err, err
        assert not out.exists() or not any(out.iterdir())  # nothing published, not even v0
    pub, local = tmp_path / "pub", tmp_path / "replica"
    shutil.copytree(tiny_hf_checkpoint, local)
    t1, _ = _target(tiny_hf_checkpoint, tmp_path, 1)
    main(["weights", "publish", "--base", tiny_hf_checkpoint, "--target", str(t1), "--out", str(pub)])
    payload = pub / "weight_v000001" / "payload.bin"
    payload.unlink()
    os.mkfifo(payload)
    capsys.readouterr()
    assert main(["weights", "apply", "--pub", str(pub), "--checkpoint", str(local)]) == 2  # returns, no hang
    err = capsys.readouterr().err.strip()
    assert "payload.bin: not a regular file" in err, err
