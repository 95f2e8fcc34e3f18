"""TCP port helpers for torch.distributed rendezvous. Standard library only: importable on a bare machine
(tests/device/check_accelerator.py runs with torch and transformers alone)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "reserve_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on this host (bound on `host`) for a torch.distributed rendezvous.

    The port is free when this returns, not when it is used: prefer `reserve_port` where the user binds later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound (not listening) to a free port of `host`, with SO_REUSEADDR: while it is open no other
    process is given that port, yet torch.distributed's TCPStore (which also sets SO_REUSEADDR) can listen on it.
    Close it once the store listens. Without it, a port picked by `free_port` can be taken between the pick and
    the store's bind (EADDRINUSE)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s
