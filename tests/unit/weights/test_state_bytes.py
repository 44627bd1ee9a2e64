"""A state dict as raw bytes (weights/transports encode_state / decode_state): how the trainer hands a
version back with its train call and the tensor / mooncake transports move it to the engines."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from miles_platform.weights.transports import decode_state, encode_state


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(3, 5, generator=g),
        "w16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "w8": torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn),  # torch cannot unpickle these
        "scale": torch.tensor(0.5),  # 0-dim
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def test_every_dtype_and_shape_comes_back_bit_for_bit():
    state = _state()
    back = decode_state(encode_state(state))
    assert list(back) == list(state)
    for n, t in state.items():
        assert back[n].dtype == t.dtype and back[n].shape == t.shape, n
        raw = [x.contiguous().reshape(-1).view(torch.uint8) for x in (back[n], t)]
        assert torch.equal(*raw), n


def test_read_only_bytes_decode_to_tensors_of_their_own():
    """Ray hands an object's arrays over read-only (its shared store): the tensors decode_state
    gives are writable copies, not views a write would fault on (torch warns on such a view)."""
    enc = encode_state(_state())
    for n in enc["__tensors__"]:
        enc[n] = enc[n].copy()
        enc[n].setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "non-writable array" warning fails the test
        back = decode_state(enc)
    back["w32"].add_(1.0)  # a write lands in the tensor's own memory
    assert not np.shares_memory(back["w32"].numpy(), enc["w32"])


def test_tensors_on_a_device_are_encoded_from_the_host():
    """A rank's weights on an accelerator (tests/device_check.py's fake one: `.numpy()` of a device
    tensor fails there, as on a GPU) are encoded from their host copy."""
    from device_check import fake_device

    state = _state()
    with fake_device() as dev:
        on_device = {n: t.to(dev) for n, t in state.items() if n != "w8"}
        enc = encode_state(on_device)
    back = decode_state(enc)
    for n in on_device:
        assert back[n].device.type == "cpu" and torch.equal(back[n], state[n]), n
