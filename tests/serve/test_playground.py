"""The playground page: served from the package, off with a setting, and used in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.browser import Page, browser, screenshot_on_failure
from tests.serve.live import live_server

KEY = "playground-secret"


def app(**settings: Any) -> TestClient:
    # the lifespan never runs (no `with`), so no model is loaded: these routes need none
    return TestClient(create_app(Settings(**settings), lambda: pytest.fail("no model needed")))


def test_the_page_and_its_files_come_from_the_package() -> None:
    client = app()
    page = client.get("/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/playground/playground.js">' in page.text and "http" not in page.text
    for name, media_type in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        asset = client.get(f"/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media_type)
    assert client.get("/playground/index.html").status_code == 404
    assert client.get("/playground/../settings.py").status_code == 404
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/playground"


def test_the_playground_setting_turns_it_off() -> None:
    client = app(playground=False)
    assert client.get("/playground").status_code == 404
    assert client.get("/", follow_redirects=False).status_code == 404
    assert client.get("/playground/playground.js").status_code == 404


def _fill_question(page: Page, card: int, qid: str, kind: str, criteria: str, instructions: str) -> None:
    prefix = f"#questions-form .question:nth-of-type({card})"
    page.fill(f"{prefix} .q-id", qid)
    page.select(f"{prefix} .q-type", kind)
    page.fill(f"{prefix} .q-instructions", instructions)
    page.fill(f"{prefix} .q-criteria", criteria)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed (the page's curl snippet is run)")
def test_a_person_decides_in_the_page_with_auth_on(
    smollm2: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    shots = Path(os.environ.get("SLOTREAD_SCREENSHOTS", tmp_path))
    app = create_app(Settings(api_keys=keys), Decider(smollm2))
    with (
        live_server(app) as live,
        browser(1400, 1000, timeout=60) as page,
        screenshot_on_failure(page, shots / "playground-failure.png"),
    ):
        page.open(f"{live.url}/")
        page.wait_for("#questions-form .question")
        # without the key the page says what is missing
        page.click("#decide")
        assert "API key" in page.text("#error")

        page.fill("#api-key", KEY)
        page.fill("#state", "My card was charged twice for one order. Please fix it today!")
        for remove in page.all(".q-remove"):
            remove.click()
        page.click("#add-question")
        page.click("#add-question")
        _fill_question(page, 1, "billing", "noul", "", "Is the message about billing?")
        _fill_question(page, 2, "tone", "choice", "calm\nangry: upset or rude\nneutral", "How does the customer sound?")
        page.fill("#opt-permutations", "2")  # two option orders: each answer gets an error bar
        page.click("#decide")
        page.wait_for('.answer[data-question="tone"] .bar')

        response = json.loads(page.attribute("#response", "textContent"))
        answers = response["answers"]
        assert list(answers) == ["billing", "tone"]
        drawn: dict[str, dict[str, float]] = {}
        for bar in page.all(".bar"):
            drawn.setdefault(bar.get_attribute("data-question") or "", {})[bar.get_attribute("data-option") or ""] = (
                float(bar.get_attribute("data-p") or "nan")
            )
        billing, tone = answers["billing"], answers["tone"]
        assert drawn["billing"] == pytest.approx({"yes": billing["noul"], "no": 1 - billing["noul"]}, abs=1e-12)
        assert drawn["tone"] == pytest.approx(tone["probabilities"], abs=1e-12)
        assert list(drawn["tone"]) == ["calm", "angry", "neutral"]
        # each bar is as wide as its probability, and carries ± one standard error
        track = page.all('.bar[data-option="angry"] .track')[0].size["width"]
        fill = page.all('.bar[data-option="angry"] .fill')[0].size["width"]
        assert fill == pytest.approx(track * tone["probabilities"]["angry"], abs=1.5)
        assert len(page.all(".whisker")) == 5 and tone["x_reads"] == 2
        headline = page.text('.answer[data-question="tone"] .headline')
        assert headline == tone["choice"]
        assert f"confidence {tone['confidence']:.3f}" in page.text('.answer[data-question="tone"] .facts')

        # the same body from Python gives the same answers, and the snippets carry it without the key
        sent = {
            "state": "My card was charged twice for one order. Please fix it today!",
            "questions": {
                "billing": {"type": "noul", "instructions": "Is the message about billing?"},
                "tone": {
                    "type": "choice",
                    "instructions": "How does the customer sound?",
                    "criteria": {"calm": None, "angry": "upset or rude", "neutral": None},
                },
            },
            "x_permutations": 2,
        }
        with live.client(headers={"authorization": f"Bearer {KEY}"}) as client:
            assert client.post("/v1/systemone", json=sent).json()["answers"] == answers
        curl = page.attribute("#curl", "textContent")
        body = curl.split("<<'JSON'\n", 1)[1].rsplit("\nJSON", 1)[0]
        assert json.loads(body) == sent and KEY not in curl and "$SLOTREAD_API_KEY" in curl
        python = page.attribute("#python", "textContent")
        assert KEY not in python
        # both snippets run as they are, with the key in the environment, and get the page's answers
        monkeypatch.setenv("SLOTREAD_API_KEY", KEY)
        ran: dict[str, Any] = {}
        exec(python, ran)
        assert ran["response"].json()["answers"] == answers
        shell = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, check=True, timeout=60)
        assert json.loads(shell.stdout)["answers"] == answers
        if "SLOTREAD_SCREENSHOTS" in os.environ:
            page.driver.execute_script("window.scrollTo(0, 0)")
            page.screenshot(shots / "playground.png")
        # the same questions as JSON; a field the form cannot show keeps the page on the JSON tab
        page.click("#tab-json")
        assert json.loads(page.attribute("#questions-json", "value")) == sent["questions"]
        asked_if = {**sent["questions"], "tone": {**sent["questions"]["tone"], "ask_if": {"billing": [True]}}}
        page.fill("#questions-json", json.dumps(asked_if))
        page.click("#tab-form")
        assert "ask_if" in page.text("#error") and page.wait_for("#questions-json").is_displayed()
        assert (
            json.loads(page.attribute("#curl", "textContent").split("<<'JSON'\n", 1)[1].rsplit("\nJSON", 1)[0])[
                "questions"
            ]
            == asked_if
        )
        # nothing refused by the page's content security policy, no script error; the 401s before the key
        # was typed are the only failed loads
        assert [e for e in page.console_errors() if "status of 401" not in e] == []
