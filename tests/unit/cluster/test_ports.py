"""free_port draws below the kernel's ephemeral range (outgoing connections take local ports only
inside it) and hands out a port a listener can bind at once; distinct draws rarely collide."""

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
        seq = iter([taken, taken, taken + 1 if taken + 1 < 65536 else taken - 1])

        class Rng:
            def randrange(self, a, b):
                return next(seq)

        monkeypatch.setattr(ports.random, "SystemRandom", Rng)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65535, 65535))
        monkeypatch.setattr(ports, "LOWEST", 1024)
        assert ports.free_port() not in (taken,)


def _listening(port: int) -> set[str]:
    import os

    import psutil

    return {
        c.laddr.ip
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid == os.getpid()
    }


def test_a_rendezvous_store_listens_on_its_host_only():
    import torch.distributed as dist

    from miles_platform.cluster.ports import tcp_store

    # torch's own TCPStore server listens on every interface, whatever host it is given
    plain = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    assert _listening(plain.port) == {"::"}
    port = free_port()
    master = tcp_store("127.0.0.1", port, 2, True, timeout_s=10, wait_for_workers=False)
    assert _listening(port) == {"127.0.0.1"}
    client = tcp_store("127.0.0.1", port, 2, False, timeout_s=10)
    client.set("k", "v")
    assert master.get("k") == b"v"
    # a port another listener holds: a clear OSError, no store, no socket left behind
    with pytest.raises(OSError):
        tcp_store("127.0.0.1", port, 2, True, timeout_s=1, wait_for_workers=False)
    assert _listening(port) == {"127.0.0.1"}
