import numpy as np
import pytest

from slotread.core.assignments import listing_order, shifts, to_option_order


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [
        (77, 1, (0,)),
        (77, 4, (0, 19, 38, 57)),  # floor(j * 77 / 4)
        (10, 3, (0, 3, 6)),
        (3, 5, (0, 1, 2)),  # at most n distinct assignments
        (2, 8, (0, 1)),  # a yes/no question: as given, then swapped
    ],
)
def test_shifts_spread_the_assignments_evenly(n: int, k: int, expected: tuple[int, ...]) -> None:
    assert shifts(n, k) == expected


def test_listing_order_rotates_the_options_over_the_labels() -> None:
    assert listing_order(4, 0) == (0, 1, 2, 3)
    # shift 1: label A (position 0) lists option 1, ..., label D lists option 0
    assert listing_order(4, 1) == (1, 2, 3, 0)


def test_a_read_under_a_shift_maps_back_to_its_options() -> None:
    # options a, b, c, d listed under shift 3: positions show d, a, b, c; the read favours position 0 (d)
    read = np.array([5.0, 1.0, 2.0, 3.0])
    assert to_option_order(read, 3).tolist() == [1.0, 2.0, 3.0, 5.0]


@pytest.mark.parametrize("n", [2, 5, 77])
def test_every_shift_round_trips(n: int) -> None:
    option_values = np.arange(n, dtype=np.float64) * 1.5
    for shift in shifts(n, n):
        listed = option_values[list(listing_order(n, shift))]
        assert to_option_order(listed, shift).tolist() == option_values.tolist()
