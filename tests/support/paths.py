"""Where things are: the repository root, whatever folder the tests run from."""

from __future__ import annotations

from pathlib import Path

#: The repository's root folder (configs/, the apps, start_app.py, chat_ui_app.py).
REPO_ROOT: Path = Path(__file__).resolve().parents[2]
