"""Following several apps' log files at once, each line prefixed with its app's name.

``llm-suite serve`` in the foreground shows its apps' output as it happens, as ``vllm serve``
shows its own; the apps themselves keep writing to their log files, so the output stays there
for ``llm-suite logs`` after the foreground process is gone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TextIO

#: Access-log lines of the probes that run all the time (the launcher's and the gateway's
#: heartbeat: /health, and /v1/models on the servers); they would bury the lines that matter.
PROBE_LINE = re.compile(r'"GET /(health|v1/models) HTTP/[0-9.]+" 200\s*$')


class LogFollower:
    """Prints what was appended to each file since the last :meth:`pump`, line by line.

    Lines matching ``hide`` (by default the probes' access-log lines) are left out.
    """

    def __init__(
        self, files: dict[str, Path], out: TextIO | None = None, hide: re.Pattern[str] = PROBE_LINE
    ) -> None:
        self._files = files
        self._out = out or sys.stdout
        self._hide = hide
        # Start at the beginning: the start-up lines (model load, bind) are worth seeing.
        self._offsets = dict.fromkeys(files, 0)
        self._partial = dict.fromkeys(files, "")
        self._width = max((len(name) for name in files), default=0)

    def pump(self) -> None:
        """Print every complete new line of every file."""
        for name, path in self._files.items():
            try:
                with open(path, "rb") as handle:
                    handle.seek(self._offsets[name])
                    chunk = handle.read()
            except OSError:
                continue
            if not chunk:
                continue
            self._offsets[name] += len(chunk)
            text = self._partial[name] + chunk.decode("utf-8", errors="replace")
            *lines, self._partial[name] = text.split("\n")
            for line in lines:
                if self._hide.search(line):
                    continue
                self._out.write(f"{name:<{self._width}} | {line}\n")
        self._out.flush()
