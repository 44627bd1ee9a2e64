"""The fork server's wire protocol (cluster/forkserver.py), stdlib only: the launcher
(cluster/fork_exec.py) runs as `python -S <this dir>/fork_exec.py`, without site-packages, and
imports this file by path (~10 ms of interpreter start instead of ~75 ms with the package: it runs
once per actor a local cluster starts).

A message: a 4-byte big-endian length, then that many bytes of JSON; file descriptors (the
launcher's stdio) ride the header's `sendmsg` as SCM_RIGHTS."""

from __future__ import annotations

import json
import socket
import struct

# set by fork_exec in every process a server forks: a driver forked from a server (a test's
# `train` launched with warm_python) forks its actors from that one instead of starting its own
# (~5 s of imports per launch)
INHERITED = "MILES_FORK_SERVER"


def _send_msg(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    head = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return buf


def _recv_msg(sock: socket.socket, maxfds: int = 0) -> tuple[dict, list[int]]:
    fds: list[int] = []
    if maxfds:
        head, fds, _, _ = socket.recv_fds(sock, 4, maxfds)
        if len(head) < 4:
            head += _recv_exact(sock, 4 - len(head))
    else:
        head = _recv_exact(sock, 4)
    (n,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(sock, n)), fds
