"""A free TCP port, one place: process groups, engines, routers and tests all ask here.

The port is drawn below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999
by default). A port from `bind(0)` lies inside that range, where every outgoing connection of the
host (Ray's workers open many) takes its local port, and the kernel hands freed ports out again,
so between "free now" and the listener's bind another socket can take it (the likely cause of a gloo
rendezvous failing with EADDRINUSE in a full test run, 2026-12-03). Below the range only another
listener that picked the same port at random can.

`tcp_store` and `gloo_on_loopback` keep torch.distributed's listeners (the rendezvous store, gloo's
pairs) on the group's own address instead of every interface.
"""

from __future__ import annotations

import os
import random
import socket

LOWEST = 20000  # above the well-known and most registered service ports
TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now, below the ephemeral range where one is free; else the OS's
    pick (bind to 0, read it back, release)."""
    lo = ephemeral_range()[0]
    if lo - LOWEST > TRIES:
        rng = random.SystemRandom()
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, lo)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float, **kw):
    """torch's `TCPStore` whose server (the master's) listens on `host` only.

    Given any host, TCPStore binds its own server to every interface (`::`, measured with torch
    2.13); a socket bound to (`host`, `port`) here and handed over (`master_listen_fd`) keeps a
    run's rendezvous on 127.0.0.1 (or on the one address a GPU group names). Clients just connect.
    `kw`: TCPStore's own (`wait_for_workers`, ...).
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, int(port), world_size, False, timeout=timeout, **kw)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    fd = None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(socket.SOMAXCONN)
        # torch owns the fd it is given (it closes it itself, also when its constructor fails after
        # taking it), so it gets a dup of ours and ours is closed here in any case: one close each
        fd = os.dup(sock.fileno())
        return dist.TCPStore(host, int(port), world_size, True, timeout=timeout, master_listen_fd=fd, **kw)
    except BaseException:
        # torch failed before it took the fd (while ours is open, no other file has its inode)
        if fd is not None and _same_open_file(fd, sock.fileno()):
            os.close(fd)
        raise
    finally:
        sock.close()


def _same_open_file(fd: int, other: int) -> bool:
    try:
        a, b = os.fstat(fd), os.fstat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def is_loopback_host(host: str) -> bool:
    """`host` (an address, `[::1]`, or a name such as localhost) is on loopback: every address it
    resolves to is. A name that does not resolve is not."""
    import ipaddress

    h = host.strip("[]")
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)


_IFNAME_SET_HERE: str | None = None  # the GLOO_SOCKET_IFNAME gloo_on_loopback set (not the user's)


def gloo_on_loopback(host: str) -> None:
    """Make gloo's own listeners (one per process, for its pairs) bind the loopback interface when
    the group's rendezvous is on loopback: gloo otherwise binds the address the host name resolves
    to, a LAN address on many machines (127.0.0.1 on this project's VMs). It sets
    `GLOO_SOCKET_IFNAME` for the process (megatron makes its subgroups later, each reading it); a
    later group whose rendezvous is not on loopback clears what it set. A `GLOO_SOCKET_IFNAME` the
    user set wins either way."""
    global _IFNAME_SET_HERE

    current = os.environ.get("GLOO_SOCKET_IFNAME")
    if current and current != _IFNAME_SET_HERE:
        return  # the user's
    if not is_loopback_host(host):
        if current:  # ours, from an earlier loopback group: this one's pairs go where gloo picks
            del os.environ["GLOO_SOCKET_IFNAME"]
        _IFNAME_SET_HERE = None
        return
    try:
        import psutil

        names = [
            n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs)
        ]
    except Exception:  # noqa: BLE001 - no interface table: gloo's default
        return
    if names:
        os.environ["GLOO_SOCKET_IFNAME"] = _IFNAME_SET_HERE = names[0]
