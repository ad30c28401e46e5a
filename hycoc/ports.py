"""Is a TCP port free to listen on? Checked by ``hycoc verify-server`` and ``hycoc serve-ray`` before they load a
model or start Ray, so a busy port is named in one line at once. No torch, no Ray: importing it costs nothing.
"""

from __future__ import annotations

import socket


def check_port(host: str, port: int, *, reuse_address: bool = True) -> int:
    """Bind host:port once and let it go: returns ``port``, or for port 0 the free port the OS picked. Raises OSError
    (errno EADDRINUSE for a busy port, EADDRNOTAVAIL for an address not on this machine) so that a command can name
    the port in one line before loading a model. reuse_address: set SO_REUSEADDR as the server that binds it next
    does (aiohttp/asyncio on POSIX: yes, so a port in TIME_WAIT after a restart is not "busy"; Ray Serve's proxy:
    no). The port is free when this returns, not reserved: another process may take it before the server binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if reuse_address:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return probe.getsockname()[1]


__all__ = ["check_port"]
