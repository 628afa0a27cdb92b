"""The typed results the commands print: every number in its place, the optional ones only when present."""

from slotread.eval.fitting import HeldOut

METRICS = {
    "held_out_items": 9.0,
    "cross_fitted": 1.0,
    "trusted": 0.0,
    "accuracy": 0.5,
    "accuracy_half_width": 0.25,
    "nll": 1.234,
    "ece": 0.1,
    "plain_accuracy": 0.4,
    "plain_ece": 0.2,
    "read_seconds": 3.0,
    "train_seconds": 1.5,
}


def test_held_out_numbers_print_in_one_line() -> None:
    held = HeldOut.of(METRICS)
    assert (held.items, held.cross_fitted, held.trusted, held.alone, held.lexical_seconds) == (9, True, False, {}, None)
    assert str(held) == (
        "held out (cross-fitted): accuracy 50.0% ± 25.0% (plain read 40.0%), ECE 0.100 (plain read 0.200), NLL 1.234"
    )
    assert "rest on 9 items (fewer than 300)" in held.untrusted(300)


def test_partners_alone_print_in_the_order_fit_reports_them() -> None:
    partners = {"lexical_accuracy": 0.3, "head_accuracy": 0.45, "vote_accuracy": 0.35, "lexical_seconds": 2.0}
    held = HeldOut.of({**METRICS, "cross_fitted": 0.0, **partners})
    assert held.alone == {"head": 0.45, "vote": 0.35, "lexical": 0.3} and held.lexical_seconds == 2.0
    assert str(held).startswith(
        "held out: accuracy 50.0% ± 25.0% (plain read 40.0%, head alone 45.0%, vote alone 35.0%, lexical alone 30.0%), "
    )
