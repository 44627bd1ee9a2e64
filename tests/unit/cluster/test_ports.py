"""free_port draws below the kernel's ephemeral range (outgoing connections take local ports only
inside it) and hands out a port a listener can bind at once; distinct draws rarely collide."""

import os
import socket

import pytest

from miles_platform.cluster.ports import LOWEST, ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    lo, hi = ephemeral_range()
    assert LOWEST < lo < hi
    ports = [free_port() for _ in range(50)]
    assert all(LOWEST <= p < lo for p in ports)
    assert len(set(ports)) >= 45  # random over ~12k ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
        s.listen()


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    import miles_platform.cluster.ports as ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        seq = iter([taken, taken])  # the port in use, twice; then random draws (a neighbour of
        real = ports.random.SystemRandom()  # `taken` may be in use too: another pytest worker's)

        class Rng:
            def randrange(self, a, b):
                return next(seq, None) or real.randrange(a, b)

        monkeypatch.setattr(ports.random, "SystemRandom", Rng)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65535, 65535))
        monkeypatch.setattr(ports, "LOWEST", 1024)
        assert ports.free_port() not in (taken,)
        assert next(seq, None) is None  # both draws of the taken port were tried and passed over


def _listening(port: int) -> set[str]:
    import os

    import psutil

    return {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid == os.getpid()
    }


def _fds() -> set[int]:
    return {int(f) for f in os.listdir("/proc/self/fd")}


def _leaked(before: set[int], port: int) -> set[int]:
    """New fds of sockets on `port`: a leaked store socket. Other new fds, and fds of `before` closed
    since, are another thread's (a full run's worker has Ray, the fork server and store threads
    opening and closing files meanwhile: measured, a new fd 113 in one run, fd 92 closed in another);
    a double close is checked on a file the test itself holds."""
    import psutil

    mine = {c.fd for c in psutil.Process().net_connections("tcp") if c.laddr and c.laddr.port == port}
    return (_fds() - before) & mine


def test_a_rendezvous_store_listens_on_its_host_only():
    import torch.distributed as dist

    from miles_platform.cluster.ports import tcp_store

    # torch's own TCPStore server listens on every interface (`::`, or 0.0.0.0 without IPv6),
    # whatever host it is given
    plain = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    assert _listening(plain.port) and _listening(plain.port) != {"127.0.0.1"}
    port = free_port()
    master = tcp_store("127.0.0.1", port, 2, True, timeout_s=10, wait_for_workers=False)
    assert _listening(port) == {"127.0.0.1"}
    client = tcp_store("127.0.0.1", port, 2, False, timeout_s=10)
    client.set("k", "v")
    assert master.get("k") == b"v"
    # a port another listener holds: a clear OSError, no store, no socket left behind
    before = _fds()
    with pytest.raises(OSError):
        tcp_store("127.0.0.1", port, 2, True, timeout_s=1, wait_for_workers=False)
    assert _listening(port) == {"127.0.0.1"} and _fds() == before


def test_a_store_that_fails_after_torch_took_its_socket_closes_it_once():
    """torch closes the fd it was handed when its constructor fails later (here: no worker joins
    within the timeout); tcp_store closes only its own. A second close of the same fd number would
    close whatever another thread opened under that number meanwhile."""
    from torch.distributed import DistStoreError

    from miles_platform.cluster.ports import tcp_store

    port = free_port()
    before = _fds()
    with pytest.raises(DistStoreError):
        tcp_store("127.0.0.1", port, 2, True, timeout_s=0.2, wait_for_workers=True)
    assert _leaked(before, port) == set() and not _listening(port)
    # and the number torch freed is not closed again: open a file, fail once more, the file is fine
    with open(os.devnull) as f:
        with pytest.raises(DistStoreError):
            tcp_store("127.0.0.1", port, 2, True, timeout_s=0.2, wait_for_workers=True)
        os.fstat(f.fileno())
    assert _leaked(before, port) == set()


def test_gloo_goes_on_loopback_for_a_loopback_rendezvous_and_the_users_choice_wins(monkeypatch):
    import psutil

    import miles_platform.cluster.ports as ports

    lo = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(ports, "_IFNAME_SET_HERE", None)
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        ports.gloo_on_loopback(host)
        assert os.environ.get("GLOO_SOCKET_IFNAME") == lo, host
    ports.gloo_on_loopback("192.0.2.7")  # a group on another address: what this module set is cleared
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    ports.gloo_on_loopback("no-such-host.invalid")  # a name that does not resolve: not loopback, no error
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's
    for host in ("127.0.0.1", "192.0.2.7"):
        ports.gloo_on_loopback(host)
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


@pytest.mark.parametrize(
    ("addr", "loopback"),
    [("127.0.0.1:6379", True), ("LOCALHOST:6379", True), ("[::1]:6379", True), ("::1", True),
     ("localhost", True), ("10.0.0.1:6379", False), ("192.0.2.7", False), ("ray://127.0.0.1:10001", False),
     ("auto", False), ("no-such-host.invalid:6379", False)],
)  # fmt: skip
def test_a_gcs_address_on_loopback_is_told_apart(addr, loopback):
    """A driver joins a loopback GCS in Ray's single-machine mode (ray_cluster.init_ray)."""
    from miles_platform.cluster.ray_cluster import _is_loopback_address

    assert _is_loopback_address(addr) is loopback
