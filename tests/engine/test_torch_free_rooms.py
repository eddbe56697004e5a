"""The engine's plain-Python rooms, ``scheduling/`` and ``decoding/``, work without torch.

Their rules are unit-tested in milliseconds and read as plain Python only while no torch creeps
in, so each room is imported in a fresh interpreter where ``import torch`` fails (a meta-path
finder refuses it), and its source is read for torch imports that never run (those under
``TYPE_CHECKING``, which the import alone would not catch).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "server" / "continuous_batching"
ROOMS = ["scheduling", "decoding"]

#: Run in the subprocess: refuse torch, import every module named on the command line, and say
#: which were imported. Any ImportError (torch's or another) fails the run with its traceback.
IMPORT_WITHOUT_TORCH = """
import importlib, sys
from importlib.abc import MetaPathFinder

class NoTorch(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is unimportable here (asked for {name})")
        return None

sys.meta_path.insert(0, NoTorch())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the finder did not stop torch")
for name in sys.argv[1:]:
    importlib.import_module(name)
    print("imported", name)
"""


def _modules(room: str) -> list[str]:
    """The room's package and every module in it."""
    package = f"server.continuous_batching.{room}"
    found = pkgutil.iter_modules([str(ENGINE / room)], prefix=f"{package}.")
    return [package] + sorted(info.name for info in found)


def _torch_imports(path: Path) -> list[int]:
    """Line numbers of ``path``'s imports of torch, wherever they are (TYPE_CHECKING too)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name == "torch" or name.startswith("torch.") for name in names):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("room", ROOMS)
def test_the_room_imports_with_torch_unimportable(room: str) -> None:
    modules = _modules(room)
    assert len(modules) > 2, f"{room}/ has no modules to check"
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TORCH, *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [word for name in modules for word in ("imported", name)]


@pytest.mark.parametrize("room", ROOMS)
def test_the_room_names_no_torch_import_even_for_annotations(room: str) -> None:
    found = {
        str(path.relative_to(REPO)): lines
        for path in sorted((ENGINE / room).glob("*.py"))
        if (lines := _torch_imports(path))
    }
    assert found == {}, (
        f"torch imported in {found} (use an opaque alias such as decoding.steps.Logits)"
    )
