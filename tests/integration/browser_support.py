"""A real browser for the dashboard tests: Debian's `chromium`, headless, driven by Selenium
through the system `chromedriver` (never one Selenium would download).

`find_browser()` looks for both; `install_browser()` runs apt-get for them where that can work
(root, apt-get present), as CI does. The tests skip, saying why, where neither finds one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
DRIVERS = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
APT_PACKAGES = ("chromium", "chromium-driver")
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
)


@dataclass(frozen=True)
class Browser:
    binary: str
    driver: str


def find_browser() -> Browser | None:
    binary = next((p for p in BROWSERS if os.access(p, os.X_OK)), None)
    driver = next((p for p in DRIVERS if os.access(p, os.X_OK)), None) or shutil.which(
        "chromedriver"
    )
    return Browser(binary, driver) if binary and driver else None


def install_browser(timeout: float = 1200.0) -> str | None:
    """Installs chromium and its driver with apt-get; returns why it could not, else None."""
    if shutil.which("apt-get") is None:
        return "no apt-get to install chromium with"
    if os.geteuid() != 0:
        return "not root: cannot apt-get install chromium (run `make browser` as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *APT_PACKAGES]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{' '.join(cmd)} failed: {e}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-300:]}"
    return None


def ensure_browser() -> Browser | str:
    """The browser, installing it first where possible; else the reason there is none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    found = find_browser()
    if found is not None:
        return found
    why = install_browser()
    found = find_browser()
    if found is not None:
        return found
    return why or "chromium and chromedriver not found after installing them"


@contextmanager
def headless_chromium(browser: Browser, width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A WebDriver on a fresh, empty profile; quit (and the profile removed) afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="plait-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser.binary
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(browser.driver), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
