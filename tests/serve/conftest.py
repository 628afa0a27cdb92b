"""The shared live server on SmolLM2-135M."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slotread.decider import Decider
from slotread.models.load import LoadedModel
from slotread.serve.app import create_app
from slotread.settings import Settings
from tests.serve.live import Live, live_server


@pytest.fixture(scope="session")
def smollm2_server(smollm2: LoadedModel) -> Iterator[Live]:
    """The server on SmolLM2-135M, auth off, default limits (shared by the tests that only read)."""
    with live_server(create_app(Settings(), Decider(smollm2))) as live:
        yield live
