"""`--check-weight-update-equal` over HTTP, the same for embedded, external and SGLang engines.

Each engine answers SGLang's `POST /get_weights_by_name` {"name": <HF name>, "truncate_size": n}
with the first n rows of that parameter as float32 values (a bare JSON list). The trainer's tensor,
cast to the engine's serving dtype, must match them bit for bit. A small model is compared whole;
a big one by a row prefix of every tensor, so the check stays a few MB of JSON per tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from miles_platform.rollout.client import EngineHTTPError, post

MAX_CHECKED_ELEMENTS = 1 << 20  # per tensor (~20 MB of JSON at worst)
SERVING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def checked_rows(t: torch.Tensor) -> int:
    """Rows of `t` compared: all of them up to MAX_CHECKED_ELEMENTS elements, else a prefix (>= 1)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return 1
    per_row = max(1, t[0].numel())
    return max(1, min(t.shape[0], MAX_CHECKED_ELEMENTS // per_row))


def first_mismatch(
    url: str,
    weights: dict[str, torch.Tensor],
    rollout_dtype: str,
    api_key: str | None = None,
    timeout: float = 120.0,
) -> str | None:
    """None when the engine at `url` holds `weights` (in `rollout_dtype`), else what differs first."""
    dtype = SERVING_DTYPES[rollout_dtype]
    for name, t in weights.items():
        n = checked_rows(t)
        body = {"name": name, "truncate_size": n}
        try:
            got = post(url, "/get_weights_by_name", body, api_key=api_key, timeout=timeout)
        except EngineHTTPError as e:
            return (
                f"engine {url} did not return tensor {name} from /get_weights_by_name ({e}); SGLang "
                "serves it only for model classes that implement get_weights_by_name (e.g. Llama); "
                "for others run without --check-weight-update-equal (--ci-disable-weight-update-checker)"
            )
        want = t.detach()[:n].to("cpu", dtype).to(torch.float32)
        try:
            have = torch.from_numpy(np.asarray(got, dtype=np.float32))
        except (TypeError, ValueError):
            return (
                f"engine {url} answered /get_weights_by_name for {name} with {str(got)[:200]!r}, not values"
            )
        if have.shape != want.shape:
            return (
                f"engine {url} tensor {name}: first {n} rows have shape {tuple(have.shape)}, "
                f"the trainer's {tuple(want.shape)}"
            )
        if not torch.equal(have, want):
            diff = (have - want).abs().max().item()
            return f"engine {url} tensor {name} differs from the trainer's (max abs diff {diff:.3g}, first {n} rows)"
    return None
