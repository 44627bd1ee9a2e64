"""A free TCP port, one place: process groups, engines, routers and tests all ask here.

The port is drawn below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999
by default). A port from `bind(0)` lies inside that range, where every outgoing connection of the
host (Ray's workers open many) takes its local port, and the kernel hands freed ports out again,
so between "free now" and the listener's bind another socket can take it (the likely cause of a gloo
rendezvous failing with EADDRINUSE in a full test run, 2026-12-03). Below the range only another
listener that picked the same port at random can.
"""

from __future__ import annotations

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
