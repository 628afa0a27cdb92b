"""Headless Chromium for page tests: start it, open a URL, wait for a selector, click, fill, select, read,
screenshot.

Drives Debian's ``chromium`` through its ``chromium-driver`` with Selenium, never a downloaded browser
or driver (the machines are offline). ``available()`` says whether both are installed, so page tests
can skip with the reason where they are not.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

BROWSER = "chromium"
DRIVER = "chromedriver"


def available() -> str | None:
    """None when the browser and its driver are installed, else what is missing."""
    missing = [name for name in (BROWSER, DRIVER) if shutil.which(name) is None]
    return None if not missing else f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)"


class Browser:
    """One headless Chromium window."""

    def __init__(self, driver: webdriver.Chrome, timeout_s: float) -> None:
        self.driver = driver
        self.timeout_s = timeout_s

    def open(self, url: str) -> None:
        self.driver.get(url)

    def wait_for(self, selector: str, timeout_s: float | None = None) -> WebElement:
        """The first element matching the CSS ``selector`` once it is visible."""
        wait = WebDriverWait(self.driver, timeout_s or self.timeout_s)
        element: WebElement = wait.until(expected_conditions.visibility_of_element_located((By.CSS_SELECTOR, selector)))
        return element

    def all(self, selector: str) -> list[WebElement]:
        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def click(self, selector: str) -> None:
        self.wait_for(selector).click()

    def fill(self, selector: str, text: str) -> None:
        """Replace the text of an input or textarea, as typing would (input events fire)."""
        element = self.wait_for(selector)
        element.clear()
        element.send_keys(text)

    def select(self, selector: str, value: str) -> None:
        """Choose the option of a <select> whose value is ``value``, as a person would."""
        Select(self.wait_for(selector)).select_by_value(value)

    def text(self, selector: str) -> str:
        """The visible text of the first visible match."""
        return str(self.wait_for(selector).text)

    def attribute(self, selector: str, name: str) -> str:
        """An attribute or property of the first match, visible or not (``textContent`` reads hidden text)."""
        return str(self.driver.find_element(By.CSS_SELECTOR, selector).get_attribute(name) or "")

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path

    def console_errors(self) -> list[str]:
        """The page's console errors so far (a refused script or style shows up here)."""
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]


@contextmanager
def browser(width: int = 1400, height: int = 1000, timeout_s: float = 60.0) -> Iterator[Browser]:
    """A headless Chromium of the given window size, closed on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which(BROWSER))
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(shutil.which(DRIVER))))
    try:
        yield Browser(driver, timeout_s)
    finally:
        driver.quit()
