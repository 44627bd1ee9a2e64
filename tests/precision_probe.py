"""What dtype each parameter carries when its module runs (after FSDP's unshard): the probe the
precision-rule tests (tests/unit/training/test_precision_fsdp.py, tests/gpu) judge a plan by."""

from __future__ import annotations


def forward_param_dtypes(model, run) -> tuple[dict[str, str], object]:
    """({normalized fqn: dtype name} seen by forward pre-hooks while `run()` runs, its result)."""
    from miles_platform.training.precision import dtype_name, normalize_fqn

    seen: dict[str, str] = {}

    def hook(prefix):
        def fn(mod, _args):
            for name, p in mod.named_parameters(recurse=False):
                seen[normalize_fqn(f"{prefix}.{name}" if prefix else name)] = dtype_name(p.dtype)

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()]
    out = run()
    for h in handles:
        h.remove()
    return seen, out
