"""Ray's token file is readable by this user only (issue #49, item 7): Ray writes ~/.ray/auth_token
with the umask's mode, 0644, and another local user read it and submitted a job as this user."""

from __future__ import annotations

import os
import stat

import pytest

from miles_platform.cluster.ray_cluster import secure_ray_token


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_absent_token_is_created_for_this_user_only(home):
    path = secure_ray_token()
    assert path == str(home / ".ray" / "auth_token")
    assert mode(path) == 0o600 and mode(home / ".ray") == 0o700
    assert len(open(path).read()) == 64
    assert secure_ray_token() == path and len(open(path).read()) == 64  # kept, not regenerated


def test_a_world_readable_token_is_tightened_and_kept(home, monkeypatch, caplog):
    (home / ".ray").mkdir()
    token = home / ".ray" / "auth_token"
    token.write_text("abc")
    os.chmod(token, 0o644)  # what Ray leaves with the default umask
    secure_ray_token()
    assert mode(token) == 0o600 and token.read_text() == "abc"
    assert "was readable by others (mode 644)" in caplog.text
    other = home / "mine"
    other.write_text("xyz")
    os.chmod(other, 0o640)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
    assert secure_ray_token() == str(other) and mode(other) == 0o600


def test_nothing_to_do_without_a_token_file(home, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert secure_ray_token() is None and not (home / ".ray").exists()
