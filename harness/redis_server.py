"""A real ``redis-server`` on a port of its own, for the shared-state tests and the chaos runs.

Debian's package (``make test-tools`` installs it). The server keeps nothing on disk (no RDB,
no AOF): killed and started again on its port, it comes back empty, as a crashed cache would.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

from harness.network import free_port
from harness.waiting import async_wait_until, wait_until

#: What a missing redis-server is reported as (tests skip with it, or fail on CI).
MISSING = "redis-server is missing (make test-tools)"


def is_redis_installed() -> bool:
    """Whether ``redis-server`` is on PATH."""
    return shutil.which("redis-server") is not None


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (``port``: a free one), optionally with a
    password, its files in ``folder``; :meth:`start` again after :meth:`kill` reuses the port."""

    def __init__(self, folder: Path, port: int | None = None, password: str | None = None) -> None:
        self.folder = folder
        self.port = port or free_port()
        self.password = password
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, port: int | None = None, db: int = 0) -> str:
        """The client URL (through ``port``, e.g. a proxy's; default the server's own)."""
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{port or self.port}/{db}"

    def start(self) -> RedisServer:
        """Start the server (it does not answer yet: see :meth:`wait`)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(MISSING)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.folder)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def pong(self) -> bool:
        """Whether the server answers PING (after AUTH); raises when its process exited."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"redis-server exited ({self.process.returncode})")
        auth = f"AUTH {self.password}\r\n".encode() if self.password is not None else b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
            conn.sendall(auth + b"PING\r\n")
            data = b""
            while b"PONG" not in data and len(data) < 64:
                chunk = conn.recv(64)
                if not chunk:
                    break
                data += chunk
            return b"PONG" in data

    def wait(self, timeout: float = 10) -> RedisServer:
        """Wait until the server answers PING."""
        wait_until(self.pong, timeout, interval=0.05, ignoring=(OSError,), message="redis-server")
        return self

    async def wait_async(self, timeout: float = 10) -> None:
        """:meth:`wait` without blocking the event loop between polls."""
        await async_wait_until(
            self.pong, timeout, interval=0.05, ignoring=(OSError,), message="redis-server"
        )

    def kill(self) -> None:
        """SIGKILL the server: its connections reset, its keys are gone."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 10) -> None:
        """Terminate the server (SIGKILL when it does not exit in time)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
