import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_platform.cluster.ports import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run scripts/gpu_smoke.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _few_threads():
    import torch

    torch.set_num_threads(1)
    yield


def save_tiny_checkpoint(path) -> str:
    """A random tiny Qwen3 checkpoint + our tokenizer, saved as an HF dir at `path` (< 2 s). The
    `tiny_hf_checkpoint` fixture; scripts/gpu_checks.py builds its checkpoint with this too."""
    from miles_platform.models.checkpoint import save_hf_checkpoint
    from miles_platform.models.qwen3 import build_model, tiny_qwen3_config
    from miles_platform.models.tokenizer import train_tokenizer

    corpus = [f"What is {a}+{b}? {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    tok = train_tokenizer(corpus, vocab_size=128)
    cfg = tiny_qwen3_config(
        len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
    )
    save_hf_checkpoint(build_model(cfg, seed=0), tok, path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 checkpoint + our tokenizer, saved as an HF dir (fast: < 2 s)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda not installed")
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    if not os.path.exists(binary):
        pytest.skip("mooncake_master binary not found next to the interpreter or on PATH")
    port = free_port()
    log = open(tmp_path_factory.mktemp("mooncake") / "master.log", "w")  # noqa: SIM115
    args = [binary, f"--rpc_port={port}", f"--metrics_port={free_port()}", "--rpc_address=127.0.0.1"]
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        from miles_platform.cluster.object_store import close_stores

        close_stores()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()
