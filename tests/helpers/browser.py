"""Debian's chromium, headless, driven through its chromedriver by selenium (the playground's browser test).

Nothing is downloaded: the browser and the driver are the system's (`apt-get install chromium chromium-driver`,
which .ci/run does), and the flags keep chromium from reaching the network on its own (updates, sync, field
trials) and from needing a sandbox, a GPU or a large /dev/shm, none of which a CI container has. The browser's
console is kept (goog:loggingPrefs), so that a test can read what the page logged, a blocked resource included.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
)


def missing_programs() -> list[str]:
    """The browser's programs not on PATH (the test says which to install)."""
    return [program for program in (CHROMIUM, CHROMEDRIVER) if shutil.which(program) is None]


@contextlib.contextmanager
def chromium(profile: Path, logs: Path, window: tuple[int, int] = (1280, 1000)) -> Iterator[WebDriver]:
    """A headless chromium with a fresh profile in `profile`, its driver's log in `logs`, `window` pixels wide
    and high; quit when the block ends."""
    options = Options()
    options.binary_location = str(shutil.which(CHROMIUM))
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(shutil.which(CHROMEDRIVER)), log_output=str(logs / "chromedriver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def console_lines(driver: WebDriver) -> list[str]:
    """What the page logged to its console since the last call (levels and messages)."""
    return [f"{entry['level']} {entry['message']}" for entry in driver.get_log("browser")]
