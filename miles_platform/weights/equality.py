"""`--check-weight-update-equal` over HTTP, the same for embedded, external and SGLang engines.

Each engine answers SGLang's `POST /get_weights_by_name` {"name": <HF name>, "truncate_size": n}
with the first n rows of that parameter as float32 values (a bare JSON list). The trainer's tensor,
cast to the engine's serving dtype (fp32 for Qwen3.5's A_log at any dtype, as SGLang: models/gdn.py),
must match them bit for bit. A small model is compared whole;
a big one by a row prefix of every tensor, so the check stays a few MB of JSON per tensor.

An engine that serves our `POST /weights_checksum` extension (the embedded engine) is checked in
one request instead: the xxh3-128 of every tensor's served bytes against the trainer's tensor cast
to the serving dtype, every element of every tensor. A differing checksum is then read back with
`/get_weights_by_name` for the report. Engines without it (SGLang answers 404) get the per-tensor path.
"""

from __future__ import annotations

import numpy as np
import torch

from miles_platform.models.gdn import served_dtype
from miles_platform.rollout.client import EngineHTTPError, post
from miles_platform.training.precision import DTYPES  # the one dtype-name table

MAX_CHECKED_ELEMENTS = 1 << 20  # per tensor (~20 MB of JSON at worst)


def checked_rows(t: torch.Tensor) -> int:
    """Rows of `t` compared: all of them up to MAX_CHECKED_ELEMENTS elements, else a prefix (>= 1)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return 1
    per_row = max(1, t[0].numel())
    return max(1, min(t.shape[0], MAX_CHECKED_ELEMENTS // per_row))


def _checksum_mismatch(url, weights, dtype, api_key, timeout) -> tuple[bool, list[str]]:
    """(served, names whose checksum, dtype or shape differ); served=False when the engine has no
    `/weights_checksum` or refused it, so the caller falls back to values."""
    from miles_platform.weights.checksum import checksum

    try:
        got = post(url, "/weights_checksum", {"names": list(weights)}, api_key=api_key, timeout=timeout)
    except EngineHTTPError:  # no such endpoint (SGLang: 404), or it refused: the values path says why
        return False, []
    bad = []
    for name, t in weights.items():
        want = t.detach().to("cpu", served_dtype(name, dtype)).contiguous()
        have = got.get(name) if isinstance(got, dict) else None
        if (
            not isinstance(have, dict)
            or have.get("shape") != list(want.shape)
            or have.get("dtype") != str(want.dtype).removeprefix("torch.")
            or have.get("xxh3_128") != checksum(want)
        ):
            bad.append(name)
    return True, bad


def first_mismatch(
    url: str,
    weights: dict[str, torch.Tensor],
    rollout_dtype: str,
    api_key: str | None = None,
    timeout: float = 120.0,
) -> str | None:
    """None when the engine at `url` holds `weights` (in `rollout_dtype`), else what differs first."""
    dtype = DTYPES[rollout_dtype]
    served, bad = _checksum_mismatch(url, weights, dtype, api_key, timeout)
    if served and not bad:
        return None
    if served:  # say how they differ: values of the first differing tensor
        why = _values_mismatch(url, {bad[0]: weights[bad[0]]}, dtype, api_key, timeout)
        return (
            why
            or f"engine {url} tensor {bad[0]}: served bytes (xxh3-128, dtype or shape) differ from the trainer's"
        )
    return _values_mismatch(url, weights, dtype, api_key, timeout)


def _values_mismatch(url, weights, dtype, api_key, timeout) -> str | None:
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
        want = t.detach()[:n].to("cpu", served_dtype(name, dtype)).to(torch.float32)
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
