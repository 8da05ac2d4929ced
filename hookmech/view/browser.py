"""Headless Chromium for looking at `hookmech view` pages: the browser test, the load-time bench and
the screenshots of docs/guide.md drive Debian's `chromium` through its `chromedriver` with selenium
(the dev extra). Nothing here downloads a browser or a driver."""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..errors import HookmechError

# selenium is optional: imported where used


def browser_missing() -> str | None:
    """Return why no headless Chromium can run here (a sentence), or None when one can."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (the dev extra)")
    if missing:
        return f"no {', no '.join(missing)} here (apt-get install chromium chromium-driver; pip install -e .[dev])"
    return None


def headless_chromium(width: int = 1400, height: int = 1800) -> Any:
    """Return a selenium WebDriver of headless Chromium (window `width` x `height`, browser console
    logged), from the system's `chromium` and `chromedriver`; raise `HookmechError` when missing."""
    reason = browser_missing()
    if reason is not None:
        raise HookmechError(reason)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not fetch a browser or a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"  # found by browser_missing
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(60)
    return driver
