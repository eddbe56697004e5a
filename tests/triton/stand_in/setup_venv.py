"""Create the Python 3.12 virtualenv that runs the PyTriton server (``.venv-triton``).

PyTriton 0.7 bundles a tritonserver whose Python-backend stub fails under Python 3.11 and works
under 3.12, and it needs numpy<2; the project itself runs on 3.11 with numpy 2. So the Triton
server gets a venv of its own, built from ``requirements.txt`` beside this file. Standard
library only: it runs under any Python, the project's venv included.

The venv holds PyTriton and numpy only, no torch: the model runs in ``transformers_worker.py``
under the project's interpreter, which has the CPU torch (under 3.12 pip would find only PyPI's
CUDA build: the venv was 5.2 GB and two minutes with it). Seen here without a pip cache: about
100 MB downloaded, 355 MB installed (most of it PyTriton's bundled tritonserver), 25 seconds.

Usage::

    python tests/triton/stand_in/setup_venv.py [--venv .venv-triton] [--python /path/to/python3.12]

Idempotent: a stamp file holding the requirements' hash marks a finished install, so a second
run returns at once. Without a matching stamp (an interrupted install, or changed requirements)
the venv is built again from scratch: installing on top would never remove what is no longer
required.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT: Path = Path(__file__).resolve().parents[3]
REQUIREMENTS: Path = Path(__file__).resolve().with_name("requirements.txt")
DEFAULT_VENV: Path = REPO_ROOT / ".venv-triton"
#: Where the venv lives, if not in the default place.
VENV_ENV: str = "LLM_SUITE_TRITON_VENV"
#: An explicit Python 3.12 interpreter to build the venv with.
PYTHON_ENV: str = "LLM_SUITE_TRITON_PYTHON"
STAMP_NAME: str = ".installed"
REQUIRED_VERSION: tuple[int, int] = (3, 12)


class TritonVenvError(RuntimeError):
    """The venv could not be built."""


def _version_of(python: str) -> tuple[int, int] | None:
    """The (major, minor) of an interpreter, or None when it does not run (e.g. a pyenv shim)."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def find_python312() -> Path | None:
    """A working Python 3.12 interpreter: $LLM_SUITE_TRITON_PYTHON, PATH, then pyenv's."""
    candidates: list[str] = []
    if os.environ.get(PYTHON_ENV):
        candidates.append(os.environ[PYTHON_ENV])
    on_path = shutil.which("python3.12")
    if on_path:
        candidates.append(on_path)
    # pyenv's shim on PATH fails unless 3.12 is selected, so look at its versions directly.
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.12*/bin/python3.12"), reverse=True)
    for candidate in candidates:
        if _version_of(candidate) == REQUIRED_VERSION:
            return Path(candidate)
    return None


def venv_dir() -> Path:
    """The venv's folder ($LLM_SUITE_TRITON_VENV or ``.venv-triton`` in the repository)."""
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def venv_python(venv: Path) -> Path:
    """The venv's interpreter."""
    return venv / "bin" / "python"


def _requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def is_ready(venv: Path) -> bool:
    """True when ``venv`` holds a finished install of the current requirements."""
    stamp = venv / STAMP_NAME
    return (
        stamp.is_file()
        and venv_python(venv).exists()
        and stamp.read_text().strip() == _requirements_hash()
    )


@contextlib.contextmanager
def _locked(venv: Path) -> Iterator[None]:
    """Serialize builders (make and a test run may race for the same venv)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.with_name(venv.name + ".lock")  # beside the venv: it may be rebuilt
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise TritonVenvError(f"command failed ({result.returncode}): {' '.join(command)}")


def ensure_venv(venv: Path | None = None, python: Path | None = None) -> Path:
    """Build the venv if it is missing or stale; return its interpreter.

    Raises :class:`TritonVenvError` when no Python 3.12 exists or an install step fails.
    """
    venv = venv or venv_dir()
    if is_ready(venv):
        return venv_python(venv)
    with _locked(venv):
        if is_ready(venv):  # built by whoever held the lock before us
            return venv_python(venv)
        python = python or find_python312()
        if python is None:
            raise TritonVenvError(
                f"no Python {REQUIRED_VERSION[0]}.{REQUIRED_VERSION[1]} found (set {PYTHON_ENV})"
            )
        if venv.exists() and not (venv / "pyvenv.cfg").is_file():
            # A mistyped --venv must not cost someone a folder.
            raise TritonVenvError(f"refusing to replace {venv}: it is not a virtualenv")
        shutil.rmtree(venv, ignore_errors=True)
        _run([str(python), "-m", "venv", str(venv)])
        pip = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check"]
        _run([*pip, "-r", str(REQUIREMENTS)])
        (venv / STAMP_NAME).write_text(_requirements_hash() + "\n")
    return venv_python(venv)


def main(argv: list[str] | None = None) -> int:
    """Command line: build the venv, print its interpreter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=None, help=f"default: {DEFAULT_VENV}")
    parser.add_argument("--python", type=Path, default=None, help="a Python 3.12 interpreter")
    args = parser.parse_args(argv)
    try:
        print(ensure_venv(args.venv, args.python))
    except TritonVenvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
