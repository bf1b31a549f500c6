"""TCP ports: a free one for a rendezvous (process groups, stores, engine servers), and whether
something answers at an address (a Ray GCS, a node's raylet)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Where free_port looks first: below the kernel's range for outgoing connections, so a port chosen
# now and bound a little later (a store's master binds it once its process is up) cannot meanwhile
# be handed to one of the connections that gloo, NCCL or Ray open in between.
LISTEN_PORTS_FROM = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` (every interface by default) right now, the caller binding it
    next: one below the ephemeral range where there is room (see ``LISTEN_PORTS_FROM``), else one
    the kernel picks."""
    low = ephemeral_range()[0]
    # SystemRandom: workers seed the global generator alike (seed + rank), so two roles' rank 0
    # would otherwise try the same ports in the same order.
    count = min(64, max(0, low - LISTEN_PORTS_FROM))
    candidates = random.SystemRandom().sample(range(LISTEN_PORTS_FROM, low), count)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default where unknown)."""
    try:
        low, high = (int(x) for x in Path(EPHEMERAL_RANGE_FILE).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def answers(address: str, timeout_s: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
