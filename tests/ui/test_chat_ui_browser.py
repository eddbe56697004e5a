"""The chat page in a real browser: ``streamlit run chat_ui_app.py`` + headless Chromium.

Streamlit runs as a subprocess on a free 127.0.0.1 port, pointed at a real gateway (the
``sb_gateway`` fixture: a real static-batching server with the default model behind it).
Chromium and ChromeDriver are Debian's (``/usr/bin/chromium``, ``/usr/bin/chromedriver``),
driven by selenium; ``make test`` installs them when missing (``make chromium``). Nothing is
downloaded at run time.

Set ``CHAT_UI_SCREENSHOT=path.png`` to keep a screenshot of the answered page.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit", reason="the chat UI needs the 'ui' extra (pip install -e .[ui])")
pytest.importorskip("selenium", reason="the browser test needs selenium (the 'ui' extra)")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from harness.network import free_port  # noqa: E402
from harness.servers import ServerThread  # noqa: E402
from harness.waiting import wait_until  # noqa: E402
from tests.support.paths import REPO_ROOT  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
QUESTION = "What is the capital of France?"
CHAT_INPUT = 'textarea[data-testid="stChatInputTextArea"]'
CHAT_MESSAGE = '[data-testid="stChatMessage"]'


@pytest.fixture(scope="module")
def chat_ui(sb_gateway: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``streamlit run chat_ui_app.py`` on a free port; yields its URL."""
    port = free_port()
    log_file = tmp_path_factory.mktemp("chat_ui") / "streamlit.log"
    command = [
        sys.executable, "-m", "streamlit", "run", str(REPO_ROOT / "chat_ui_app.py"),
        "--server.headless", "true", "--server.address", "127.0.0.1",
        "--server.port", str(port), "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer",
        "--", "--gateway-url", sb_gateway.url,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def healthy() -> bool:
        if process.poll() is not None:
            pytest.fail(f"streamlit exited with {process.returncode}: {log_file.read_text()}")
        return httpx.get(f"{url}/_stcore/health", timeout=2, trust_env=False).text == "ok"

    try:
        wait_until(
            healthy,
            60,
            interval=0.2,
            ignoring=(httpx.HTTPError,),
            message=lambda: f"streamlit to become healthy; its log:\n{log_file.read_text()}",
        )
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """Headless Debian Chromium through Debian's ChromeDriver."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        why = f"{' and '.join(missing)} missing: install the Debian packages chromium and "
        why += "chromium-driver (make chromium)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs them; a missing browser there is a broken setup
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def test_question_answered_in_browser(chat_ui: str, browser: WebDriver) -> None:
    browser.get(chat_ui)
    wait = WebDriverWait(browser, 60)
    # The box is enabled once the page has listed the gateway's models.
    box = wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, CHAT_INPUT)))
    box.send_keys(QUESTION)
    box.send_keys(Keys.ENTER)

    def answered(driver: WebDriver) -> bool:
        messages = driver.find_elements(By.CSS_SELECTOR, CHAT_MESSAGE)
        # The stats caption comes last: once it shows, the stream has ended.
        return len(messages) >= 2 and "tokens/s" in messages[-1].text

    wait.until(answered)
    messages = browser.find_elements(By.CSS_SELECTOR, CHAT_MESSAGE)
    assert QUESTION in messages[0].text
    assert "Paris" in messages[-1].text, messages[-1].text
    assert "Paris" in browser.find_element(By.TAG_NAME, "body").text
    screenshot = os.environ.get("CHAT_UI_SCREENSHOT")
    if screenshot:
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(screenshot)
