"""Build the fused CPU kernels now (``make kernels`` runs this): ``python -m
server.continuous_batching.model.cpu_kernels [--isa LEVEL ...]``. Without ``--isa`` it builds
every level this CPU can run (the tests run each), the CPU's best first. Exits 0 even when
they cannot be built (the engine then runs torch ops), after saying why."""

from __future__ import annotations

import argparse
import logging
import time

from .. import cpu_isa
from . import ISA_FLAGS, build_directory, load


def main() -> None:
    """Build (or find) the extension for each level and print where it is."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    best = cpu_isa.probe().best_level
    runnable = [lvl for lvl in cpu_isa.LEVELS[: cpu_isa.LEVELS.index(best) + 1] if lvl in ISA_FLAGS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--isa",
        action="append",
        choices=sorted(ISA_FLAGS),
        help=f"a level to build (repeatable; default: all this CPU runs: {', '.join(runnable)})",
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_isa.probe().model}; best ISA level: {best}")
    if not runnable:
        print("no fused kernels for this CPU (no AVX2): the engine runs torch ops")
    for isa in args.isa or runnable[::-1]:
        start = time.perf_counter()
        if load(isa) is None:
            print(f"fused CPU kernels ({isa}): NOT built (see above); the engine uses torch ops")
            continue
        elapsed = time.perf_counter() - start
        print(f"fused CPU kernels ({isa}): ready in {build_directory(isa)} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
