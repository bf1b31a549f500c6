"""torch ``TCPStore`` rendezvous that stays on loopback when the run does.

torch's store master listens on every interface. On a single-node run Ray gives every worker the
node address 127.0.0.1 (see ``ray_start.start_local_ray``), so the process groups' stores
can listen on loopback too: the master binds the socket itself and hands it to torch.

    store = open_tcp_store("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def open_tcp_store(
    host: str,
    port: int,
    world_size: int,
    is_master: bool,
    timeout: datetime.timedelta,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``; a master on a loopback ``host`` listens there only."""
    listen_fd = None
    if is_master and is_loopback(host):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(max(128, world_size))
        listen_fd = sock.detach()  # torch owns the socket from here
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=listen_fd,
    )
