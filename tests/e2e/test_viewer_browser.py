"""The rollout viewer in a real headless Chromium: open the printed URL, pick a run, filter, open a
sample and see its tokens shaded, then a multi-turn episode's turns and tool results. With MILES_UI_SCREENSHOTS=1 the sample page lands in
docs/viewer_sample.png (the README's picture)."""

import os
from pathlib import Path

import pytest
from browser import chromium
from viewer_root import build_viewer_root

from miles_platform.viewer.server import start_viewer

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def page():
    with chromium(1280, 860) as ctx:
        yield ctx.new_page()


def test_filter_open_a_sample_and_see_its_tokens_shaded(page, tmp_path):
    paths = build_viewer_root(str(tmp_path / "root"))
    viewer = start_viewer(paths.root)
    try:
        page.goto(viewer.url)  # the printed URL: the token goes into a cookie, the runs page shows
        assert "token" not in page.url
        page.click("text=demo")
        page.wait_for_selector("#samples")
        assert page.inner_text("#total") == "16 samples"

        page.select_option("select[name=version]", "2")  # the rollout that trained version 2
        page.fill("input[name=min_reward]", "1")
        page.select_option("select[name=sort]", "length")
        page.click("#apply")
        page.wait_for_function("document.querySelector('#total').innerText === '4 samples'")
        rewards = [float(t) for t in page.locator("td.reward").all_inner_texts()]
        lengths = [int(t) for t in page.locator("td.length").all_inner_texts()]
        assert rewards == [1.0] * 4 and lengths == sorted(lengths)

        page.fill("input[name=where]", "reward >")  # not an expression: refused, the form stays
        page.click("#apply")
        assert "syntax error" in page.inner_text("#error")
        page.fill(
            "input[name=where]", "response_length > 5 AND json_extract_string(metadata, '$.source') = 'math'"
        )
        page.click("#apply")
        page.wait_for_function("document.querySelector('#total').innerText === '2 samples'")

        page.locator("a.sample-link").first.click()
        page.wait_for_selector("#response")
        assert page.get_attribute(".shades a.on", "data-shade") == "advantage"
        shaded = page.locator("#response span.tok[style*=background]")
        assert shaded.count() == page.locator("#response span.tok").count() > 3
        assert "rgba(0, 150, 60" in shaded.first.evaluate("e => getComputedStyle(e).backgroundColor")
        assert page.locator("#group .card").count() == 4

        page.click(".shades a[data-shade=gap]")
        page.wait_for_selector(".shades a.on[data-shade=gap]")
        colors = {s.split(",")[0] for s in page.locator("#response span.tok").evaluate_all(
            "els => els.map(e => getComputedStyle(e).backgroundColor)")}  # fmt: skip
        assert {"rgba(0", "rgba(215"} <= colors  # the trainer above and below the engine
        if os.environ.get("MILES_UI_SCREENSHOTS") == "1":
            page.hover("#response span.tok >> nth=2")
            page.screenshot(path=str(REPO / "docs" / "viewer_sample.png"), full_page=True)

        page.goto(f"{viewer.base_url}/samples?run=agent")  # a multi-turn episode: its turns and tool calls
        page.locator("a.sample-link").first.click()
        page.wait_for_selector("#response .turn.tool")
        assert page.locator("#response .turn").count() == 3
        assert page.inner_text(".turn.tool .call-result") == "4"
    finally:
        viewer.stop()
