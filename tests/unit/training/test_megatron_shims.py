"""megatron-core on a machine without CUDA (training/megatron_shims.py): the functions megatron
compiles with its `jit_fuser` (`torch.compile`) run eagerly. On a CPU inductor compiled C++ for each
of them in each rank process, seconds per function to fuse a few elementwise ops (Qwen3.5's gated
attention output: ~2.9 s of a 3.5 s step, 2026-12-06)."""

import sys
import types

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are off with CUDA")


def compiled(value) -> bool:
    if not isinstance(value, types.FunctionType) or "_torchdynamo_orig_callable" not in vars(value):
        return False
    return (getattr(value._torchdynamo_orig_callable, "__module__", None) or "").startswith("megatron.")


def compiled_callables() -> list[str]:
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in vars(module).items():
            if compiled(value):
                found.append(f"{name}.{attr}")
            elif isinstance(value, type):
                found += [f"{name}.{attr}.{k}" for k, v in vars(value).items() if compiled(v)]
    return found


def test_megatron_jit_fuser_functions_run_eagerly_on_cpu():
    from megatron.core import jit
    from megatron.core.transformer.attention import SelfAttention

    from miles_platform.training import megatron_shims

    megatron_shims.apply_cpu_shims()
    assert compiled_callables() == []
    assert jit.jit_fuser is jit.noop_decorator  # modules imported later, experts' per-instance functions
    from megatron.core import activations  # noqa: F401  (a module of jit_fuser functions, imported after)

    assert compiled_callables() == []
    # and the eager gate computes what megatron's compiled one does
    x, gate = torch.randn(3, 4), torch.randn(3, 4)
    got = SelfAttention._apply_output_gate(None, x, gate)
    assert torch.equal(got, x * torch.sigmoid(gate))
    torch._dynamo.reset()
