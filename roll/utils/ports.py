"""TCP ports: a free one for a rendezvous (process groups, stores, engine servers), and whether
something answers at an address (a Ray GCS, a node's raylet)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` (every interface by default) right now; the caller binds it
    next, so a race with another process is possible but rare."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def answers(address: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
