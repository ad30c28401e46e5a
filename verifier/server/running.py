"""Running a `VerifierServer`: `serve` (blocking, for ``hycoc verify-server``) and `ServerThread` (in-process on
an ephemeral port, for tests and ``hycoc bench``)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..engine import VerifierEngine
from .app import VerifierServer
from .memory import freeze_startup_objects


def serve(
    engine: VerifierEngine,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    on_listening: Callable[[str], None] | None = None,
    **server_kwargs: Any,
) -> None:
    """Run the server until SIGINT or SIGTERM (blocking). ``on_listening(url)`` is called once the port is bound.
    One server per process: the objects loaded so far are frozen out of garbage collection first
    (`hycoc.verifier.server.memory.freeze_startup_objects`), so the periodic memory release can collect cycles.
    ``server_kwargs``: `VerifierServer`'s keywords (``limits``, ``row_cost``, a `ServerSettings` as ``settings`` or its
    fields by name, e.g. ``tree_rows=33``).

    port 0 picks a free port (the URL names it). Raises OSError when the address cannot be bound, ValueError /
    TypeError for a bad or unknown setting (before anything starts).
    """
    server = VerifierServer(engine, **server_kwargs)

    freeze_startup_objects()  # one server per process: later collections skip the model (memory module)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
                pass
        url = await server.start(host, port)
        try:
            if on_listening is not None:
                on_listening(url)
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(main())


class ServerThread:
    """A `VerifierServer` on its own event loop in a background thread (tests, ``hycoc bench``).

    ``with ServerThread(engine, tree_rows=33) as srv: ... srv.url ...`` listens on 127.0.0.1 and a free port by
    default. ``url`` is ``ws://HOST:PORT``, ``http_url`` the same with ``http://``. ``server`` is the
    `VerifierServer` (its ``metrics`` and ``sessions`` may be read from other threads between requests).
    """

    def __init__(self, engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0, **server_kwargs):
        self.server = VerifierServer(engine, **server_kwargs)
        self._host, self._port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.url: str | None = None

    @property
    def http_url(self) -> str:
        if self.url is None:
            raise RuntimeError("the server is not listening yet: start() it first")
        return "http" + self.url.removeprefix("ws")

    def start(self) -> ServerThread:
        """Start listening; returns once the port is bound (raises what binding raised)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="hycoc-verify-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure
        return self

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None  # set by start() before this thread begins
        asyncio.set_event_loop(loop)
        try:
            self.url = loop.run_until_complete(self.server.start(self._host, self._port))
        except BaseException as e:  # noqa: BLE001 -- handed to the starting thread
            self._failure = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self.server.stop())
        loop.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close every connection, stop listening and join the thread."""
        if self._thread is None or self._loop is None or not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
