"""A stalled engine must not kill a run (issue #49, item 6): a control call whose kept-alive
connection is reset is sent again, and an engine that stopped answering stops the run with one line
naming it and the resume command, not httpx's traceback."""

from __future__ import annotations

import socket
import struct
import threading

import httpx
import pytest

from miles_platform.config import RunConfig
from miles_platform.errors import ActorDied
from miles_platform.rollout import client as engine_client
from miles_platform.run_services import actor_died

BODY = b'{"success":true}'
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)


def _read_request(c: socket.socket) -> bytes:
    """One whole HTTP request (headers, then Content-Length bytes of body): a client may send the
    body in a second segment, which a bare recv() would take for the next request."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
    while len(body) < length:
        chunk = c.recv(65536)
        if not chunk:
            break
        body += chunk
    return data


def _serve(resets: list[int]):
    """A loopback HTTP server: answers the first request of each connection and keeps it alive; a
    second request on that connection is reset (RST) unanswered, as a stalled engine that resumed does."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def conn(c):
        with c:
            _read_request(c)
            c.sendall(OK)
            if _read_request(c):  # the pooled connection's next request: reset it
                resets.append(1)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=conn, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


def test_a_control_call_on_a_reset_connection_is_sent_again(monkeypatch):
    monkeypatch.setattr(engine_client, "_sync_client", None)  # a fresh pool: the reuse is ours
    resets: list[int] = []
    srv, url = _serve(resets)
    try:
        assert engine_client.post(url, "/pause_generation") == {"success": True}
        assert engine_client.post(url, "/continue_generation") == {"success": True}  # failed the run before
        assert resets  # the pooled connection was reset at least once, and the call still went through
    finally:
        srv.close()


def test_an_engine_that_stopped_answering_stops_the_run_in_one_line(tmp_path):
    cfg = RunConfig(rollout_batch_size=1, run_name="mine", save=str(tmp_path / "ckpt"))
    err = httpx.ConnectError(
        "All connection attempts failed", request=httpx.Request("POST", "http://127.0.0.1:9/generate")
    )
    died = actor_died(cfg, err)
    assert isinstance(died, ActorDied)
    msg = str(died)
    assert msg.startswith(
        "an engine of run 'mine' stopped answering (ConnectError http://127.0.0.1:9/generate"
    )
    assert (
        "--use-fault-tolerance" in msg and f"resume from the last checkpoint under {tmp_path / 'ckpt'}" in msg
    )
    assert "\n" not in msg
    router = actor_died(
        cfg, engine_client.EngineHTTPError("http://127.0.0.1:8", 503, {"error": "no workers"})
    )
    assert "HTTP 503" in str(router)
    assert (
        actor_died(cfg, engine_client.EngineHTTPError("http://127.0.0.1:8", 400, "bad")) is None
    )  # a bug: raw


@pytest.mark.parametrize("attempts", [1])
def test_without_the_resend_the_reset_fails(monkeypatch, attempts):
    """The same server with one attempt (the code before): the reset reaches the caller."""
    monkeypatch.setattr(engine_client, "_sync_client", None)
    monkeypatch.setattr(engine_client, "CONTROL_ATTEMPTS", attempts)
    srv, url = _serve([])
    try:
        engine_client.post(url, "/pause_generation")
        with pytest.raises(httpx.TransportError):
            engine_client.post(url, "/continue_generation")
    finally:
        srv.close()
