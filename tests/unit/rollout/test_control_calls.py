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
    return head + b"\r\n\r\n" + body


def _accepting(on_connection):
    """A loopback listening socket that runs `on_connection(c)` for each accepted connection on a
    thread of its own -> (the socket, its http URL, one entry per connection accepted)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    accepted: list[int] = []

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            accepted.append(1)
            threading.Thread(target=on_connection, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}", accepted


def _serve(resets: list[int]):
    """A loopback HTTP server: answers the first request of each connection and keeps it alive; a
    second request on that connection is reset (RST) unanswered, as a stalled engine that resumed does."""

    def conn(c):
        with c:
            _read_request(c)
            c.sendall(OK)
            if _read_request(c):  # the pooled connection's next request: reset it
                resets.append(1)
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    srv, url, _ = _accepting(conn)
    return srv, url


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


def _server(handler):
    """A loopback HTTP server calling `handler(conn, request_bytes)` for each request of each
    connection (until it returns False); -> (socket, url, connections accepted)."""

    def conn(c):
        with c:
            while True:
                req = _read_request(c)
                if not req or handler(c, req) is False:
                    return

    return _accepting(conn)


def _no_httpx(monkeypatch):
    """httpx's client fails the test if a control call reaches it."""

    class Refuse:
        def request(self, *a, **kw):
            raise AssertionError("the control call went through httpx")

    monkeypatch.setattr(engine_client, "_sync_client", Refuse())
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


def test_control_calls_share_one_kept_alive_stdlib_connection(monkeypatch):
    """The control calls (three a weight update) go over a pooled stdlib connection, not httpx's
    client (~0.25 ms of CPU a call against ~0.7-1.4); the request is httpx's: JSON body, bearer key."""
    _no_httpx(monkeypatch)
    seen = []

    def answer(c, req):
        seen.append(req)
        c.sendall(OK)

    srv, url, accepted = _server(answer)
    try:
        for path in ("/pause_generation", "/continue_generation", "/weights_checksum"):
            assert engine_client.post(url, path, {"names": ["a", "é"]}, api_key="k") == {"success": True}
        assert engine_client.get(url, "/get_server_info", api_key="k") == {"success": True}
    finally:
        srv.close()
    assert len(accepted) == 1  # one TCP connection for the four calls
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /pause_generation HTTP/1.1")
    assert b"Authorization: Bearer k" in head and b"Content-Type: application/json" in head
    assert body == '{"names":["a","é"]}'.encode()
    assert seen[3].startswith(b"GET /get_server_info HTTP/1.1")


def test_a_connection_idle_past_the_keepalive_is_not_reused(monkeypatch):
    _no_httpx(monkeypatch)
    monkeypatch.setattr(engine_client, "KEEPALIVE_S", 0.05)

    def answer(c, req):
        c.sendall(OK)

    srv, url, accepted = _server(answer)
    try:
        engine_client.post(url, "/pause_generation")
        import time

        time.sleep(0.1)
        engine_client.post(url, "/continue_generation")
    finally:
        srv.close()
    assert len(accepted) == 2


def test_a_connection_the_server_closes_is_not_pooled(monkeypatch):
    _no_httpx(monkeypatch)
    monkeypatch.setattr(engine_client, "CONTROL_ATTEMPTS", 1)  # no resend hides a reused dead connection
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)

    def answer(c, req):
        c.sendall(close)
        return False

    srv, url, accepted = _server(answer)
    try:
        assert engine_client.post(url, "/pause_generation") == {"success": True}
        assert engine_client.post(url, "/continue_generation") == {"success": True}
    finally:
        srv.close()
    assert len(accepted) == 2


def test_control_call_failures_are_httpx_errors_naming_the_request(monkeypatch):
    """What `_control`'s resend, `actor_died` and the health monitor catch."""
    _no_httpx(monkeypatch)
    monkeypatch.setattr(engine_client, "CONTROL_ATTEMPTS", 1)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    with pytest.raises(httpx.ConnectError) as err:
        engine_client.post(f"http://127.0.0.1:{port}", "/pause_generation")
    assert str(err.value.request.url) == f"http://127.0.0.1:{port}/pause_generation"

    def hang_up(c, req):
        return False  # closed without an answer

    srv, url, _ = _server(hang_up)
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            engine_client.post(url, "/continue_generation")
    finally:
        srv.close()

    def stall(c, req):
        import time

        time.sleep(1.0)

    srv, url, _ = _server(stall)
    try:
        with pytest.raises(httpx.ReadTimeout):
            engine_client.post(url, "/pause_generation", timeout=0.2)
    finally:
        srv.close()


def test_an_answer_that_is_not_json_is_its_text_and_an_error_status_raises(monkeypatch):
    _no_httpx(monkeypatch)

    def answer(c, req):
        c.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found")

    srv, url, _ = _server(answer)
    try:
        with pytest.raises(engine_client.EngineHTTPError) as err:
            engine_client.post(url, "/weights_checksum")
    finally:
        srv.close()
    assert err.value.status == 404 and err.value.body == "not found"


def test_a_proxied_control_call_keeps_httpx(monkeypatch):
    """The environment's proxy (httpx's trust_env) still carries the calls it covers."""
    calls = []

    class Recorder:
        def request(self, method, url, **kw):
            calls.append((method, url, kw["content"]))
            return httpx.Response(200, content=BODY)

    monkeypatch.setattr(engine_client, "_sync_client", Recorder())
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert engine_client.post("http://engine.example:30000", "/pause_generation", {"mode": "abort"}) == {
        "success": True
    }
    assert calls == [("POST", "http://engine.example:30000/pause_generation", b'{"mode":"abort"}')]


def test_an_https_engine_is_reached_with_the_platform_tls_context(monkeypatch, tmp_path):
    """An https engine URL: the pooled connection verifies the server against `client_tls()`."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    _no_httpx(monkeypatch)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "engine")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    trusting = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    monkeypatch.setattr(engine_client, "client_tls", lambda: trusting)

    def conn(c):
        try:
            with server_ctx.wrap_socket(c, server_side=True) as tls:
                while _read_request(tls):
                    tls.sendall(OK)
        except (OSError, ssl.SSLError):
            pass

    srv, url, _ = _accepting(conn)
    url = url.replace("http://", "https://")
    try:
        assert engine_client.post(url, "/pause_generation") == {"success": True}
        assert engine_client.post(url, "/continue_generation") == {"success": True}
        monkeypatch.setattr(engine_client, "client_tls", ssl.create_default_context)  # not trusted
        monkeypatch.setattr(engine_client, "CONTROL_ATTEMPTS", 1)
        engine_client._pool._idle.clear()
        with pytest.raises(httpx.ConnectError):
            engine_client.post(url, "/pause_generation")
    finally:
        srv.close()
