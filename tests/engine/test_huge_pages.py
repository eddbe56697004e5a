"""Huge pages for the CB server's weights and KV cache (``server.continuous_batching.huge_pages``):
the kernel's mode read from sysfs, torch's switch set unless the environment says."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.continuous_batching import huge_pages


@pytest.mark.parametrize(
    "text,mode,is_on",
    [
        ("always [madvise] never\n", "madvise", True),
        ("[always] madvise never\n", "always", True),
        ("always madvise [never]\n", "never", False),
    ],
)
def test_mode_read_from_the_kernel_setting(tmp_path, monkeypatch, text, mode, is_on) -> None:
    setting = tmp_path / "enabled"
    setting.write_text(text)
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    assert huge_pages.system_mode(setting) == mode
    assert huge_pages.enable_for_torch(setting) is is_on
    assert huge_pages.os.environ[huge_pages.ENV] == "1"


def test_the_users_choice_stands_and_no_setting_means_none(tmp_path, monkeypatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.enable_for_torch(setting) is False
    assert huge_pages.os.environ[huge_pages.ENV] == "0"
    assert huge_pages.system_mode(Path(tmp_path / "missing")) is None
    assert huge_pages.enable_for_torch(Path(tmp_path / "missing")) is False
