"""A free TCP port for a rendezvous (process groups, stores, engine servers)."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` (every interface by default) right now; the caller binds it
    next, so a race with another process is possible but rare."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
