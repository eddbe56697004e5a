"""Build the fused CPU kernels now (``make venv`` runs this): ``python -m
server.continuous_batching.model.cpu_kernels``. Exits 0 even when they cannot be built (the
engine then runs torch ops), after saying why."""

from __future__ import annotations

import logging
import time

from . import build_directory, load


def main() -> None:
    """Build (or find) the extension and print where it is."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    module = load(verbose=False)
    if module is None:
        print("fused CPU kernels: NOT built (see the warning above); the engine will use torch ops")
        return
    print(f"fused CPU kernels: ready in {build_directory()} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
