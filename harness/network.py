"""Ports and a TCP proxy that can black-hole: the network tricks of tests and benchmarks."""

from __future__ import annotations

import asyncio
import socket
import threading


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (for a process that binds it itself).

    In-thread servers should rather take a bound socket (``harness.servers.reserve_socket``):
    nothing can grab its port between the choice and the bind.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BlackholeProxy:
    """A TCP proxy (own thread and loop) in front of one port that can stop forwarding.

    Cut, it keeps accepting and holding connections but forwards nothing either way: the
    harshest way to lose a peer (e.g. Redis), since every call waits for its timeout instead
    of failing fast. Restored, it closes the connections it held so that clients reconnect,
    and forwards again.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.is_cut = False
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="blackhole-proxy")
        self._server: asyncio.base_events.Server | None = None

    def start(self) -> BlackholeProxy:
        """Listen on a free port (``self.port``)."""
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if self.is_cut:  # accepted, and then nothing: hold it until restored
                while not writer.is_closing() and await reader.read(65536):
                    pass
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_writer)
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        except OSError:
            pass
        finally:
            self._close_all([writer])

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.is_cut:  # cut: swallowed
                    writer.write(data)
                    await writer.drain()
        finally:
            self._close_all([writer])

    def _close_all(self, writers: list[asyncio.StreamWriter]) -> None:
        for writer in writers:
            self._writers.discard(writer)
            writer.close()

    def cut(self) -> None:
        """Stop forwarding (connections stay open, silent)."""
        self.is_cut = True

    def restore(self) -> None:
        """Close what was held during the cut and forward again."""

        def reopen() -> None:
            self._close_all(list(self._writers))
            self.is_cut = False

        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (reopen(), done.set()))
        done.wait(5)

    def stop(self) -> None:
        """Close everything and end the thread."""

        def shutdown() -> None:
            self._close_all(list(self._writers))
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(shutdown)
        self._thread.join(5)
