"""Headless Chromium for the browser tests (the Dagster UI, the rollout viewer), one launcher:
skips with the reason when Playwright or the browser is missing or cannot start."""

import contextlib
import os
import tempfile

import pytest

CHROMIUM = "/usr/bin/chromium"  # make system-deps installs it
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip


@contextlib.contextmanager
def chromium(width: int, height: int):
    """A persistent Chromium context with its own throw-away profile, closed on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright not installed: pip install -e '.[ui-test]'")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: make system-deps (apt-get install chromium chromium-driver)")
    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="miles-chromium-") as profile:
        try:
            ctx = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": width, "height": height},
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any launch failure means "no usable browser here"
            pytest.skip(f"chromium cannot be launched: {str(e).splitlines()[0]}")
        try:
            yield ctx
        finally:
            ctx.close()
