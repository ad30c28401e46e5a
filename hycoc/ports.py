"""Is a TCP port free to listen on? Checked by ``hycoc verify-server`` and ``hycoc serve-ray`` before they load a
model or start Ray, so a busy port is named in one line at once. Is a verifier's URL one a client can connect to?
Checked by ``hycoc run --server`` and ``hycoc loadtest --server`` before they load anything. No torch, no Ray:
importing it costs nothing.
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


#: What a verifier's URL looks like: `ws_url_problem`'s fix, and the example its refusals give.
WS_URL_FORM = "expected ws://HOST:PORT"


def ws_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a verifier's address (``ws://HOST:PORT`` or ``wss://HOST:PORT``) and the fix,
    as one phrase ("port 99999 is out of range 1-65535: expected ws://HOST:PORT ..."), or None when a client can
    try to connect to it. Checks the scheme, that there is a host, and that a port, when given, is a number in
    1-65535: urllib raises ValueError for a bad port only when it is read, deep inside the WebSocket client's
    connect, so a command checks it here first and names the URL in one line."""
    from urllib.parse import urlsplit

    if not url.startswith(("ws://", "wss://")):
        return WS_URL_FORM
    fix = f"{WS_URL_FORM} with a port in 1-65535, as hycoc verify-server prints it (e.g. ws://127.0.0.1:8765)"
    try:
        parts = urlsplit(url)
    except ValueError:  # "Invalid IPv6 URL": an unclosed bracket
        return f"the host is not a valid address: {fix}"
    try:
        port = parts.port
    except ValueError:  # "Port out of range 0-65535", "Port could not be cast to integer value as 'abc'"
        raw = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        return f"port {raw} is out of range 1-65535: {fix}" if raw.isdigit() else f"port {raw!r} is not a number: {fix}"
    if not parts.hostname:
        return f"no host: {fix}"
    if port == 0:
        return f"port 0 is out of range 1-65535: {fix}"
    return None


__all__ = ["WS_URL_FORM", "check_port", "ws_url_problem"]
