"""The documentation pages in headless Chromium: served whole by the server (no CDN), they list the
operations, and /docs lets a user try ``/v1/systemone``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.serve.browser import Page, browser, screenshot_on_failure
from tests.serve.live import Live

OPERATIONS = [
    "/v1/systemone",
    "/v1/decisions",
    "/v1/chat/completions",
    "/v1/models",
    "/healthz",
    "/readyz",
    "/metrics",
]
#: swagger-ui's element for POST /v1/systemone: operations-{tag}-{FastAPI's operation id}
SYSTEM_ONE = "#operations-decisions-systemone_v1_systemone_post"


def loaded_from(page: Page) -> set[str]:
    """The origins of every script, style sheet and document the page loaded. Images are left out: redoc's
    footer asks its CDN for a logo and hides it when that fails, which offline it does."""
    urls = page.evaluate(
        "return performance.getEntriesByType('resource').filter(e => e.initiatorType !== 'img').map(e => e.name)"
    )
    return {"/".join(url.split("/")[:3]) for url in urls}


def test_docs_lists_the_operations_and_tries_systemone(smollm2_server: Live, tmp_path: Path) -> None:
    with browser() as page, screenshot_on_failure(page, tmp_path / "docs.png"):
        page.open(smollm2_server.url + "/docs")
        page.wait_for(".opblock-summary-path")
        assert page.texts(".opblock-summary-path") == OPERATIONS
        page.click(f"{SYSTEM_ONE} .opblock-summary-control")
        page.click(f"{SYSTEM_ONE} .try-out__btn")
        page.click(f"{SYSTEM_ONE} .execute")
        status = f"{SYSTEM_ONE} .live-responses-table tbody .response-col_status"
        page.wait_for_text(status, "200")
        body = json.loads(page.text(f"{SYSTEM_ONE} .live-responses-table tbody .response-col_description pre"))
        assert list(body["answers"]) == ["urgent", "intent", "frustration"]
        assert loaded_from(page) == {smollm2_server.url}


def test_redoc_lists_the_operations(smollm2_server: Live, tmp_path: Path) -> None:
    with browser() as page, screenshot_on_failure(page, tmp_path / "redoc.png"):
        page.open(smollm2_server.url + "/redoc")
        page.wait_for_text("h2", "Answer bounded questions about a state")
        text = page.text("body")
        assert all(f"/v1/{name}" in text for name in ("systemone", "decisions", "models"))
        assert loaded_from(page) == {smollm2_server.url}
