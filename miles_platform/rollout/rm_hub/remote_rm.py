"""`--rm-type remote_rm`: POST {prompt, response, label, metadata} to `--rm-url`.

The service answers a bare number or `{"reward": number}`. Anything else, a non-2xx status or
an unreachable URL raises RemoteRewardError naming the URL.
"""

from __future__ import annotations

import httpx

from miles_platform.errors import MilesError
from miles_platform.tls import client_tls

TIMEOUT_S = 60.0


class RemoteRewardError(MilesError, RuntimeError):
    """The remote reward service failed or answered something that is not a reward."""


async def remote_rm(rewards, sample, response: str) -> float | dict:
    url = rewards.rm_url
    payload = {
        "prompt": sample.prompt,
        "response": response,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    try:
        async with httpx.AsyncClient(timeout=TIMEOUT_S, verify=client_tls()) as client:
            resp = await client.post(url, json=payload)
    except httpx.HTTPError as e:
        raise RemoteRewardError(f"--rm-url {url}: request failed: {type(e).__name__}: {e}") from e
    if not resp.is_success:
        raise RemoteRewardError(f"--rm-url {url}: HTTP {resp.status_code}: {resp.text[:200]!r}")
    try:
        body = resp.json()
    except ValueError as e:
        raise RemoteRewardError(f"--rm-url {url}: response is not JSON: {resp.text[:200]!r}") from e
    if isinstance(body, dict) and "reward" in body:
        body = body["reward"]
    if isinstance(body, bool) or not isinstance(body, int | float):
        raise RemoteRewardError(f"--rm-url {url}: expected a number or {{'reward': number}}, got {body!r}")
    return float(body)
