"""What the launcher's user reads: messages, errors, and the end of an app's log.

A :class:`StartAppError` is a problem that the CLI prints as one line, without a traceback.
Output is flushed at once: it interleaves with long waits on the apps' processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LOG_TAIL_LINES: int = 40


class StartAppError(RuntimeError):
    """A problem reported to the user as one clear message (no traceback)."""


def say(message: str = "") -> None:
    """Print ``message`` on stdout, flushed."""
    print(message, flush=True)


def err(message: str) -> None:
    """Print ``error: message`` on stderr, flushed."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """Return the last ``n`` lines of a text file (empty when it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            # Logs may be large: read only as much of the end as the lines need.
            chunk = min(size, max(64 * 1024, n * 400))
            handle.seek(size - chunk)
            data = handle.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:] if n > 0 else []


def print_log_tail(log_file: str, n: int = LOG_TAIL_LINES) -> None:
    """Show the last ``n`` lines of an app's log on stderr, framed: why a start failed."""
    lines = tail_lines(Path(log_file), n)
    print(f"---- last {len(lines)} lines of {log_file} ----", file=sys.stderr)
    for line in lines:
        print(f"  | {line}", file=sys.stderr)
    print("---- end of log ----", file=sys.stderr, flush=True)
