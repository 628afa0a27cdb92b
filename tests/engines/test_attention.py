"""When flash attention's window means the engine's rule (``attention.window_fits``): cases worked out by hand."""

from __future__ import annotations

import pytest

from slotread.engines.diffusion_gemma.attention import window_fits


@pytest.mark.parametrize(
    ("queries", "keys", "causal", "left", "fits"),
    [
        (937, 937, True, 1023, True),  # the encoder's own tokens, causal within the window
        (60, 1023, False, 963, True),  # a question's tokens after 1,500 cached instructions (held: 1,023)
        (937, 163, False, 86, False),  # a 937-token segment after a 163-token parent: flash hides all keys from row 0
        (164, 163, False, 10, False),  # one query more than keys
        (390, 4, False, 633, True),  # instructions after the 4-token template head: the window reaches every key
        (163, 163, False, 10, True),
        (5, 9, False, None, True),  # no window: flash's right bound never applies
        (5, 9, False, -3, False),  # a window that hides every key is left to the bias path
    ],
)
def test_window_fits(queries: int, keys: int, causal: bool, left: int | None, fits: bool) -> None:
    assert window_fits(queries, keys, causal, left) is fits
