"""A fake accelerator for CPU machines: catches a tensor built on the CPU in a device's computation.

On a CPU-only machine every tensor is on the CPU, so a train step or a sampling step that forgets
`device=` passes every test and fails at its first op on a GPU. Under `fake_device()` the rank's
device is "meta:0", PyTorch's meta device but with values: a tensor created on (or moved to) it is
an `OnDevice` wrapper around a real CPU tensor, and every aten op on wrapped tensors runs on their
CPU values, so losses, log-probs, sampled tokens and `.item()` are the real ones. (Real meta
tensors have no index: a library's own use of "meta", e.g. transformers building a model before
loading its weights, is left alone.) What the mode refuses is what CUDA refuses: an op that mixes a
tensor on the device with a tensor elsewhere that is not a 0-dim CPU scalar (CUDA accepts those as
scalars, and so does this). Copies between the two (`.to`, `.cpu()`, `copy_`) are allowed, as on a
GPU. `.numpy()` of a device tensor fails, as on a GPU.

    with fake_device() as dev:                # dev == torch.device("meta", 0)
        actor = TrainerActor(cfg, device=dev)
        actor.train(0, batch)                 # DeviceMismatch names the op and the CPU tensor

`on_device(t)` says whether a tensor lives on the fake device; `host_values(t)` reads its values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("meta", 0)
# ops that move data between devices: a CPU tensor may meet a device tensor there, as on a GPU
_TRANSFERS = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize"}


class DeviceMismatch(AssertionError):
    """A CPU tensor met tensors on the rank's device in one op (a GPU would raise here too)."""


class OnDevice(torch.Tensor):
    """A tensor on the fake device: reports device "meta", holds its values in `inner` (CPU)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=FAKE,
            requires_grad=inner.requires_grad,
        )
        r.inner = inner
        return r

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 (torch's signature)
        return f"OnDevice({self.inner!r})"

    def tolist(self):  # a GPU tensor's .tolist() copies to the host; so does this
        return self.cpu().tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError(
            "can't convert meta device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return OnDevice(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"an OnDevice tensor outside fake_device(): {func}")


def on_device(t: torch.Tensor) -> bool:
    return isinstance(t, OnDevice) or (hasattr(t, "to_local") and isinstance(t.to_local(), OnDevice))


def host_values(t: torch.Tensor) -> torch.Tensor:
    """The CPU values of a tensor on the fake device (a CPU tensor as it is)."""
    return t.inner if isinstance(t, OnDevice) else t


def _fake(dev) -> bool:
    return dev is not None and torch.device(dev) == FAKE


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class FakeDeviceMode(TorchDispatchMode):
    """Runs ops on wrapped tensors' CPU values; refuses CPU tensors mixed into them (see module)."""

    def __init__(self):
        super().__init__()
        self.mismatches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        wrapped = any(isinstance(t, OnDevice) for t in flat)
        to_fake = _fake(kwargs.get("device"))
        if not wrapped and not to_fake:
            return func(*args, **kwargs)
        name = func._schema.name
        if wrapped and name not in _TRANSFERS:
            other = [
                t for t in flat
                if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and (t.dim() > 0 or t.device.type != "cpu")
            ]  # fmt: skip
            if other:
                where = "a CPU tensor" if other[0].device.type == "cpu" else f"a tensor on {other[0].device}"
                msg = f"{func}: {where} {_describe(other[0])} meets tensors on the rank's device"
                self.mismatches.append(msg)
                raise DeviceMismatch(msg)
        unwrapped_args = tree_map(host_values, args)
        unwrapped_kwargs = tree_map(host_values, kwargs)
        target = kwargs.get("device")
        if to_fake:
            unwrapped_kwargs["device"] = torch.device("cpu")
        if name == "aten::histc" and not unwrapped_args[0].is_floating_point():
            # libraries take integer histc on accelerators (HF's MoE experts); the CPU kernel has none
            x = unwrapped_args[0]
            out = func(x.float(), *unwrapped_args[1:], **unwrapped_kwargs).to(x.dtype)
        else:
            out = func(*unwrapped_args, **unwrapped_kwargs)
        if target is not None and not to_fake:  # an explicit copy to the host: stays a CPU tensor
            return out
        if name == "aten::copy_":  # in place into its first argument: that one's device
            return args[0]
        return tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)


class _FromDataMode(TorchFunctionMode):
    """`torch.tensor(data, device=meta)` and `torch.as_tensor`: built on the CPU and moved (their
    copy to the device bypasses dispatch modes and would make a real meta tensor, without values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _fake(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to(FAKE)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_device() -> Iterator[torch.device]:
    """The fake device for the block; modules moved with `.to(dev)` keep their Parameter objects
    (swap on conversion), as a real `.to("cuda")` does, so an optimizer built before still holds them."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    mode = FakeDeviceMode()
    try:
        with mode, _FromDataMode():
            yield FAKE
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:  # megatron's CUDA shims answer the rank's device: back to the CPU for later tests
            from miles_platform.training import megatron_shims

            megatron_shims.set_shim_device("cpu")
        except (ImportError, AttributeError):
            pass
