"""roll/utils/ports.py: free ports for rendezvous come from below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from roll.utils import ports


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LISTEN_PORTS_FROM <= port < low
        with socket.socket() as sock:
            sock.bind(("", port))


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LISTEN_PORTS_FROM, 60999))
    port = ports.free_port()
    with socket.socket() as sock:
        sock.bind(("", port))


def test_an_unreadable_range_file_gives_linuxs_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", str(tmp_path / "absent"))
    assert ports.ephemeral_range() == (32768, 60999)


def test_a_seeded_global_generator_does_not_make_two_processes_pick_alike():
    import random

    picked = []
    for _ in range(3):
        random.seed(7)  # as every worker seeds it (seed + rank)
        picked.append(ports.free_port())
    assert len(set(picked)) > 1
