"""Headless Chromium for page tests: Debian's ``chromium``, driven through its ``chromedriver`` by selenium.

    with browser() as page:
        page.open(url)
        page.wait_for("#main .title")
        page.fill("#state", "text")   # as typing would; page.select for a <select>
        page.click("button.go")
        page.text("#result")          # the element's visible text
        page.screenshot(path)         # a PNG of the window

Nothing is downloaded: selenium is given Debian's driver (``apt-get install chromium chromium-driver``,
which ``.ci/run`` does), so its driver manager never runs. Without them the test is skipped, except in CI
(``CI`` set), where it fails. ``screenshot_on_failure`` keeps a picture of the page a test failed on.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select
from selenium.webdriver.support.wait import WebDriverWait

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"


class Page:
    """One browser tab; selectors are CSS, waits are in seconds."""

    def __init__(self, driver: webdriver.Chrome, timeout: float) -> None:
        self.driver = driver
        self.timeout = timeout

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its document (not for what its scripts render: use ``wait_for``)."""
        self.driver.get(url)

    def wait_for(self, selector: str, timeout: float | None = None) -> WebElement:
        """The first element matching ``selector`` once it is visible."""
        wait = WebDriverWait(self.driver, self.timeout if timeout is None else timeout)
        return wait.until(expected_conditions.visibility_of_element_located((By.CSS_SELECTOR, selector)))

    def wait_for_text(self, selector: str, text: str, timeout: float | None = None) -> None:
        """Wait until some element matching ``selector`` shows ``text``."""
        wait = WebDriverWait(self.driver, self.timeout if timeout is None else timeout)
        wait.until(
            lambda driver: any(text in element.text for element in driver.find_elements(By.CSS_SELECTOR, selector))
        )

    def click(self, selector: str) -> None:
        """Scroll the first element matching ``selector`` into view once it is clickable, and click it."""
        wait = WebDriverWait(self.driver, self.timeout)
        element = wait.until(expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, selector)))
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()

    def fill(self, selector: str, text: str) -> None:
        """Replace the text of an input or textarea, as typing would (input events fire)."""
        element = self.wait_for(selector)
        element.clear()
        element.send_keys(text)

    def select(self, selector: str, value: str) -> None:
        """Choose the option of a <select> whose value is ``value``, as a person would."""
        Select(self.wait_for(selector)).select_by_value(value)

    def text(self, selector: str) -> str:
        """The visible text of the first element matching ``selector``."""
        return str(self.wait_for(selector).text)

    def texts(self, selector: str) -> list[str]:
        """The visible texts of every element matching ``selector`` (none: an empty list)."""
        return [element.text for element in self.all(selector)]

    def all(self, selector: str) -> list[WebElement]:
        """Every element matching ``selector``, visible or not."""
        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def attribute(self, selector: str, name: str) -> str:
        """An attribute or property of the first match, visible or not (``textContent`` reads hidden text)."""
        return str(self.driver.find_element(By.CSS_SELECTOR, selector).get_attribute(name) or "")

    def console_errors(self) -> list[str]:
        """The page's console errors so far (a refused script or style shows up here)."""
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def evaluate(self, script: str) -> Any:
        """The value of a JavaScript expression in the page (``return ...``)."""
        return self.driver.execute_script(script)

    def screenshot(self, path: Path) -> Path:
        """Save the window as a PNG."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path


def _installed() -> tuple[str, str]:
    chromium, driver = shutil.which(CHROMIUM), shutil.which(CHROMEDRIVER)
    if chromium is None or driver is None:
        missing = "chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(f"{missing} are not installed; .ci/run installs them")
        pytest.skip(f"needs {missing}")
    return chromium, driver


@contextmanager
def browser(width: int = 1280, height: int = 1600, timeout: float = 30.0) -> Iterator[Page]:
    """A headless Chromium window of ``width`` × ``height`` pixels, closed on exit."""
    chromium, driver = _installed()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: CI and these machines run as root, where Chromium's sandbox refuses to start.
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # for ``console_errors``
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield Page(chrome, timeout)
    finally:
        chrome.quit()


@contextmanager
def screenshot_on_failure(page: Page, path: Path) -> Iterator[None]:
    """Save a screenshot of ``page`` at ``path`` if the block raises, and name it in the failure."""
    try:
        yield
    except BaseException as exc:
        page.screenshot(path)
        exc.add_note(f"screenshot of the page: {path}")
        raise
