"""``slotread calibrate`` and ``slotread fit`` as Python calls: settings in, an artifact written, its numbers out.

The data comes from ``eval.training`` (``calibration_data``, ``readout_data``: drawn, and refused where it
overlaps the evaluation data, before a model loads); the fitting is ``quality.calibration.train``'s and
``quality.readouts.train``'s. Each result is typed and prints as its command prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slotread.decider import Decider
from slotread.eval.datasets import class_counts
from slotread.eval.training import FittingData
from slotread.quality.calibration.artifact import Calibration
from slotread.quality.calibration.train import calibrate
from slotread.quality.readouts.readout import Readout
from slotread.quality.readouts.train import TRUSTED_ITEMS, fit_readout
from slotread.settings import CalibrateSettings, FitSettings

#: the partners whose accuracy alone ``fit_readout`` reports, in the order they are printed
ALONE = ("head", "vote", "lexical", "encoder")


def write_calibration(settings: CalibrateSettings, fitting: FittingData) -> CalibrateReport:
    """Fit the calibration of ``fitting``'s data with ``settings``' model and write it to ``settings.out``."""
    decider = Decider.from_settings(settings.decider())
    fields = {"x_seed": settings.seed, **settings.request_fields}
    fit = calibrate(decider, fitting.data, request_fields=fields, exclude=fitting.exclude)
    fit.calibration.save(settings.out)
    numbers = fit.summary()
    each_class = min(class_counts(fitting.data).values()) if fitting.data.balanced else None
    return CalibrateReport(
        fit.calibration, numbers["accuracy"], numbers["nll_raw"], numbers["nll_fitted"], each_class, settings.out
    )


def write_readout(settings: FitSettings, fitting: FittingData) -> FitReport:
    """Fit a readout on ``fitting``'s data with ``settings``' model and options; write it into ``settings.out``."""
    decider = Decider.from_settings(settings.decider())
    encoder = None
    if settings.encoder:
        from slotread.models.encoder import load_encoder

        encoder = load_encoder(settings.encoder, settings.cache_dir, settings.device)
    passed = {
        "features",
        "layout",
        "holdout",
        "l2",
        "drop_overlap",
        "vote",
        "retrieval",
        "lexical",
        "batch_size",
        "progress",
    }
    fit = fit_readout(
        decider,
        fitting.data,
        per_class=settings.per_class or None,
        seed=settings.sample_seed,
        request_fields={"x_seed": settings.seed, **settings.request_fields},
        exclude=fitting.exclude,
        encoder=encoder,
        **settings.model_dump(include=passed),
    )
    return FitReport(fit.readout, HeldOut.of(fit.metrics), fit.readout.save(settings.out))


@dataclass(frozen=True)
class CalibrateReport:
    """What ``slotread calibrate`` prints: the artifact, its in-sample numbers and where it went."""

    calibration: Calibration
    #: the raw answers' accuracy, and their NLL before (T = 1) and after the fitted temperature
    accuracy: float
    nll_raw: float
    nll_fitted: float
    #: items of each class, when the data was balanced
    each_class: int | None
    out: Path

    def __str__(self) -> str:
        calibration = self.calibration
        ece = calibration.fitted_on["ece"]
        balanced = "" if self.each_class is None else f" ({self.each_class} of each class)"
        return (
            f"{calibration.model}, schema {calibration.schema[:16]}, {calibration.fitted_on['items']} items{balanced}: "
            f"temperature {calibration.temperature:.4f} (NLL {self.nll_raw:.4f} -> {self.nll_fitted:.4f}, "
            f"raw accuracy {self.accuracy:.1%}); content-free shifts {sorted(calibration.content_free)}; "
            f"in-sample ECE {ece['contextual']:.3f} contextual -> {ece['binned']:.3f} binned "
            f"({len(calibration.bins.values) if calibration.bins else 0} bins); wrote {self.out}"
        )


@dataclass(frozen=True)
class HeldOut:
    """A fitted readout's held-out numbers (``ReadoutFit.metrics``), typed."""

    items: int
    cross_fitted: bool
    trusted: bool
    accuracy: float
    accuracy_half_width: float
    #: the label softmax's, on the same items
    plain_accuracy: float
    #: with partners: the accuracy of the head and of each partner on its own, by name (``ALONE``)
    alone: dict[str, float]
    ece: float
    plain_ece: float
    nll: float
    read_seconds: float
    train_seconds: float
    #: seconds the lexical classifier's cross-fitting took (a readout with ``--lexical``)
    lexical_seconds: float | None

    @classmethod
    def of(cls, metrics: dict[str, float]) -> HeldOut:
        """The numbers ``fit_readout`` reports."""
        alone = {name: metrics[f"{name}_accuracy"] for name in ALONE if f"{name}_accuracy" in metrics}
        same = ("accuracy", "accuracy_half_width", "plain_accuracy", "ece", "plain_ece", "nll")
        return cls(
            items=int(metrics["held_out_items"]),
            cross_fitted=bool(metrics["cross_fitted"]),
            trusted=bool(metrics["trusted"]),
            alone=alone,
            read_seconds=metrics["read_seconds"],
            train_seconds=metrics["train_seconds"],
            lexical_seconds=metrics.get("lexical_seconds"),
            **{name: metrics[name] for name in same},
        )

    def __str__(self) -> str:
        alone = "".join(f", {name} alone {accuracy:.1%}" for name, accuracy in self.alone.items())
        return (
            f"held out{' (cross-fitted)' if self.cross_fitted else ''}: accuracy {self.accuracy:.1%} "
            f"± {self.accuracy_half_width:.1%} (plain read {self.plain_accuracy:.1%}{alone}), "
            f"ECE {self.ece:.3f} (plain read {self.plain_ece:.3f}), NLL {self.nll:.3f}"
        )

    def untrusted(self, trusted_items: int) -> str:
        """Why figures from too few items (fewer than ``trusted_items``) are not to be trusted."""
        return (
            f"the held-out figures rest on {self.items} items (fewer than {trusted_items}), and the temperature "
            "and weights were fitted on them: do not trust them; measure the readout with slotread eval on other data"
        )


@dataclass(frozen=True)
class FitReport:
    """What ``slotread fit`` prints: the readout, its held-out numbers, the time taken and where it went."""

    readout: Readout
    held_out: HeldOut
    path: Path

    @property
    def warning(self) -> str | None:
        """Why not to trust the held-out numbers (too few items), if so."""
        return None if self.held_out.trusted else self.held_out.untrusted(TRUSTED_ITEMS)

    def __str__(self) -> str:
        readout, held = self.readout, self.held_out
        weights = f"; weights: vote {readout.vote_weight:.3f}" if readout.vote_neighbours else ""
        weights += f"; lexical {readout.lexical_weight:.3f}" if readout.lexical_weight is not None else ""
        weights += f"; encoder {readout.encoder_weight:.3f}" if readout.encoder is not None else ""
        lexical = (
            ""
            if held.lexical_seconds is None
            else f" (cross-fitting the lexical classifier {held.lexical_seconds:.1f} s)"
        )
        return (
            f"{readout.model}, schema {readout.schema[:16]}, {readout.fitted_on['items']} items "
            f"({held.items} held out, {readout.fitted_on['dropped_overlap']} overlapping dropped), "
            f"{readout.layout}, features {readout.features}, L2 {readout.l2:g}, temperature {readout.temperature:.3f}\n"
            f"{held}\n"
            f"reading {held.read_seconds:.1f} s, training {held.train_seconds:.1f} s{lexical}{weights}; "
            f"wrote {self.path}"
        )
