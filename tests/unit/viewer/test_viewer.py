"""The rollout viewer over a small root (tests/viewer_root.py): the token, filters, sort, pages, the
`where` guard, sample pages shaded by what the trainer saw (or by the rollout's log-probs without a
`train_samples` table), multi-turn / OPD / R3 samples, diffusion images, and the CLI."""

import os
import re
import shutil
import signal
import subprocess
import sys
from html import unescape
from pathlib import Path

import duckdb
import httpx
import pytest
from fastapi.testclient import TestClient
from viewer_root import build_viewer_root

from miles_platform.viewer.server import create_app

TOKEN = "secret-token"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return build_viewer_root(str(tmp_path_factory.mktemp("viewer") / "root")).root


@pytest.fixture(scope="module")
def client(root) -> TestClient:
    c = TestClient(create_app(root, TOKEN))
    c.headers["Authorization"] = f"Bearer {TOKEN}"
    return c


def api(client: TestClient, **params) -> dict:
    r = client.get("/api/samples", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_route_but_health_needs_the_token_and_the_printed_url_sets_a_cookie(root):
    c = TestClient(create_app(root, TOKEN))
    assert c.get("/health").status_code == 200
    for path in ("/", "/samples?run=demo", "/sample?run=demo&rollout_id=0&index=0", "/api/samples?run=demo"):
        assert c.get(path).status_code == 401, path
    assert c.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get(f"/samples?run=demo&token={TOKEN}x", follow_redirects=False).status_code == 401
    r = c.get(f"/samples?run=demo&token={TOKEN}", follow_redirects=False)
    assert (
        r.status_code == 303 and r.headers["location"] == "/samples?run=demo"
    )  # the token leaves the address bar
    assert "httponly" in r.headers["set-cookie"].lower()
    assert c.get("/samples?run=demo").status_code == 200  # the cookie now


def test_filters_sort_and_pages(client):
    assert api(client, run="demo")["total"] == 16
    v2 = api(client, run="demo", version=2)["rows"]  # version 2 was trained on rollout 1
    assert len(v2) == 8 and {r["rollout_id"] for r in v2} == {1}
    assert api(client, run="demo", rollout_from=0, rollout_to=0)["total"] == 8
    rows = api(client, run="demo", min_reward=1)["rows"]
    assert len(rows) == 6 and all(r["reward"] >= 1 for r in rows)
    rows = api(client, run="demo", status="truncated")["rows"]
    assert len(rows) == 4 and {r["status"] for r in rows} == {"truncated"}
    assert api(client, run="demo", truncated="no")["total"] == 12
    assert api(client, run="agent", truncated="yes")["total"] == 1  # a turn stopped at its length limit
    rows = api(client, run="demo", min_len=2, max_len=32)["rows"]
    assert len(rows) == 8 and {r["response_length"] for r in rows} == {19, 32}
    rows = api(client, run="demo", where="json_extract_string(metadata, '$.source') = 'gsm8k'")["rows"]
    assert len(rows) == 8 and all(r["index"] % 2 for r in rows)
    rewards = [r["reward"] for r in api(client, run="demo", sort="reward", desc="1", page_size=200)["rows"]]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] > rewards[-1]
    lengths = [r["response_length"] for r in api(client, run="demo", sort="length")["rows"]]
    assert lengths == sorted(lengths)
    pages = [api(client, run="demo", page=p, page_size=5) for p in (1, 2, 3, 4)]
    seen = [(r["rollout_id"], r["index"]) for p in pages for r in p["rows"]]
    assert [len(p["rows"]) for p in pages] == [5, 5, 5, 1] and len(set(seen)) == 16
    html = client.get("/samples", params={"run": "demo", "page_size": 5, "page": 2}).text
    assert "16 samples" in html and "page 2 / 4" in html and 'id="next"' in html


@pytest.mark.parametrize(
    "where, message",
    [
        ("reward > 0; DROP VIEW rollouts", "';' is not allowed"),
        ("reward > (SELECT max(mean_reward) FROM policy_versions)", "subqueries are not allowed"),
        ("reward IN (SELECT 1 FROM read_text('/etc/passwd'))", "subqueries are not allowed"),
        ("1 = 1) UNION (SELECT 1", "not more SQL"),
        ("1 = 1) GROUP BY ALL HAVING (1 = 1", "not more SQL"),
        ("no_such_column = 1", "no_such_column"),
        ("reward >", "syntax error"),
    ],
)
def test_a_where_that_is_not_one_expression_over_rollouts_is_refused_with_400(client, where, message):
    r = client.get("/api/samples", params={"run": "demo", "where": where})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    page = client.get("/samples", params={"run": "demo", "where": where})  # the form stays, with the message
    assert page.status_code == 400 and 'id="error"' in page.text and 'name="where"' in page.text


def test_a_where_stays_inside_its_select_and_the_connection_reads_only_the_root(client, root):
    # balanced only with the parentheses around it: still the run's samples, never every run's
    assert api(client, run="demo", where="1 = 1) OR (1 = 1")["total"] == 16
    assert api(client, run="demo", where="reward > 0.5 -- a comment")["total"] == 6
    from miles_platform.viewer.queries import ViewerStore

    with ViewerStore(root).connection() as con:
        assert (
            con.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 22
        )  # demo 16, agent 1, diffusion 4, vlm 1
        for sql in ("SELECT * FROM read_text('/etc/hostname')", "CREATE TABLE t (a INT)",
                    "SET enable_external_access = true"):  # fmt: skip
            with pytest.raises(duckdb.Error):
                con.execute(sql)


def test_bad_parameters_name_themselves(client):
    for params, word in (({"sort": "prompt"}, "sort="), ({"min_reward": "x"}, "min_reward="),
                         ({"page_size": 10_000}, "page_size"), ({"version": 9}, "no committed policy version 9")):  # fmt: skip
        r = client.get("/api/samples", params={"run": "demo", **params})
        assert r.status_code in (400, 404) and word in r.json()["error"]["message"], r.text


def test_a_sample_is_shaded_by_what_the_trainer_saw(client):
    r = client.get("/api/sample", params={"run": "demo", "rollout_id": 1, "index": 1})
    got = r.json()
    assert got["train"]["step"] == 1 and got["default_shade"] == "advantage"
    assert got["shades"] == ["advantage", "gap", "loss_mask", "logprob"]
    html = client.get("/sample", params={"run": "demo", "rollout_id": 1, "index": 1}).text
    assert 'class="on" data-shade="advantage"' in html
    assert html.count('<span class="tok') == got["sample"]["response_length"]
    assert "rgba(215, 30, 30" in html  # reward 0.5 < 1: negative advantage, red
    tokens = [unescape(t) for t in re.findall(r'<span class="tok[^"]*"[^>]*>(.*?)</span>', html)]
    assert len(tokens) > 5 and "".join(tokens) == got["sample"]["response"]  # the run's tokenizer, per token
    assert 'class="tok clip"' in html  # train_samples.clipped
    gap = client.get("/sample", params={"run": "demo", "rollout_id": 1, "index": 1, "shade": "gap"}).text
    assert (
        "rgba(0, 150, 60" in gap and "rgba(215, 30, 30" in gap
    )  # the trainer above the engine on some tokens, below on others
    mask = client.get(
        "/sample", params={"run": "demo", "rollout_id": 1, "index": 1, "shade": "loss_mask"}
    ).text
    assert mask.count("rgba(110, 110, 110") == 1  # the last token masked out
    assert 'id="group"' in html and html.count('class="card') == 4  # the prompt's group, side by side
    # rollout 0 has no train_samples rows: the rollout's log-probs
    html = client.get("/sample", params={"run": "demo", "rollout_id": 0, "index": 0}).text
    assert 'class="on" data-shade="logprob"' in html and "no train_samples row" in html


def test_without_a_train_samples_table_it_shades_by_rollout_log_prob(root, tmp_path):
    bare = shutil.copytree(root, tmp_path / "root")
    shutil.rmtree(bare / "tables" / "train_samples")
    os.remove(bare / "catalog.duckdb")  # rebuilt over the copy's own paths
    c = TestClient(create_app(str(bare), TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})
    got = c.get("/api/sample", params={"run": "demo", "rollout_id": 1, "index": 1}).json()
    assert got["train"] is None and got["shades"] == ["loss_mask", "logprob"]
    assert "rgba(230, 120, 0" in c.get("/sample", params={"run": "demo", "rollout_id": 1, "index": 1}).text


def test_multi_turn_tool_calls_teacher_log_probs_and_routed_experts(client):
    html = client.get("/sample", params={"run": "agent", "rollout_id": 0, "index": 0}).text
    assert html.count('<div class="turn assistant">') == 2 and html.count('<div class="turn tool">') == 1
    assert "calculator" in html and '<td class="text call-result">4</td>' in html
    assert 'data-shade="teacher"' in html  # OPD
    assert "10 tokens × 2 layers × top-2" in html and "experts L0 [2, 3]" in html  # R3, layer 0
    assert "[10]" in html  # no tokenizer for this run: token ids
    teacher = client.get(
        "/sample", params={"run": "agent", "rollout_id": 0, "index": 0, "shade": "teacher"}
    ).text
    assert "rgba(215, 30, 30" in teacher  # token 1: the teacher finds it far less likely


def test_diffusion_samples_are_an_image_grid(client):
    html = client.get("/samples", params={"run": "diffusion"}).text
    assert html.count("<img src=") == 4 and 'id="samples"' not in html
    png = client.get("/image", params={"run": "diffusion", "rollout_id": 0, "index": 2})
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    page = client.get("/sample", params={"run": "diffusion", "rollout_id": 0, "index": 2}).text
    assert 'class="big"' in page and page.count("<img ") == 3  # the image and its group of 2


def test_a_vision_language_sample_shows_the_images_it_saw(root, client):
    """The sample page shows the image(s) of its image_hashes, served from the run's prompt data by
    hash with the viewer's token; a hash outside the run's data, or a malformed one, is refused."""
    import hashlib

    page = client.get("/sample", params={"run": "vlm", "rollout_id": 0, "index": 0}).text
    srcs = re.findall(r'src="(/prompt_image[^"]+)"', page)
    assert len(srcs) == 1 and "<b>Images</b>" in page
    r = client.get(unescape(srcs[0]))
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert hashlib.sha256(r.content).hexdigest()[:32] in srcs[0]  # the bytes of that hash
    assert TestClient(create_app(root, TOKEN)).get(unescape(srcs[0])).status_code == 401  # the token
    other = client.get("/prompt_image", params={"run": "vlm", "hash": "0" * 32})
    assert other.status_code == 404 and "not in run 'vlm'" in unescape(other.text)
    assert client.get("/prompt_image", params={"run": "vlm", "hash": "../etc"}).status_code == 400
    assert client.get("/prompt_image", params={"run": "demo", "hash": "0" * 32}).status_code == 404


def test_the_cli_serves_on_loopback_with_the_printed_token_and_stops_on_sigterm(root, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    missing = subprocess.run([sys.executable, "-m", "miles_platform.cli", "viewer", "--storage-root",
                              str(tmp_path / "none")], capture_output=True, text=True, env=env)  # fmt: skip
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles_platform.cli", "viewer", "--storage-root", root, "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        url = line.split(" on ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url, line
        base = url.split("/?")[0]
        assert httpx.get(f"{base}/samples?run=demo").status_code == 401
        with httpx.Client(follow_redirects=True) as browser:
            page = browser.get(url.replace("/?", "/samples?run=demo&"))
            assert page.status_code == 200 and "16 samples" in page.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
