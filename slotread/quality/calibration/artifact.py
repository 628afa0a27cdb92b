"""The calibration artifact: what was fitted for one question schema on one model, as a small JSON file.

    {
      "format": "slotread-calibration/1",
      "model": "qwen2.5-coder-1.5b-instruct",
      "schema": "<sha256 hex of the question's render-relevant fields, quality.artifact.schema_hash>",
      "question": {"type": "choice", "options": ["activate_my_card", ...]},
      "methods": {
        "temperature": {"temperature": 1.83},
        "contextual": {"states": ["N/A", "", "[empty]"], "content_free": {"<shift>": [p_cf in option order]}},
        "binned": {"edges": [upper edges, ascending], "values": [bin values, non-decreasing], "counts": [items per bin]}
      },
      "conformal": {"<method>": [1 − p(gold) per calibration item]},
      "fitted_on": {"request": {"x_permutations": 1, ...}, "items": 154, "ids": [...], "ids_sha256": "...", ...}
    }

The header (``format`` to ``question``, and ``fitted_on``) is every artifact's (``quality.artifact``);
every part but ``model``, ``schema`` and ``question`` is optional: the server writes artifacts that
hold only content-free distributions; ``slotread calibrate`` writes all of it. ``fitted_on.request``
holds the read options the temperature, bins and conformal scores were fitted under;
``fitted_on.class_counts`` the items of each class, and ``fitted_on.balanced`` whether they were drawn
class-balanced (``slotread calibrate --balance``). Older artifacts lack both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slotread.core.questions import CalibrationMethod
from slotread.errors import CalibrationError
from slotread.quality.artifact import Artifact, parse_header, write_json
from slotread.quality.calibration.methods import TopLabelBins

FORMAT = "slotread-calibration/1"
#: Methods whose conformal scores an artifact may hold: batch calibration changes with traffic.
CONFORMAL_METHODS: tuple[CalibrationMethod, ...] = ("none", "contextual", "temperature", "binned")


@dataclass(frozen=True, eq=False)
class Calibration(Artifact):
    """One (model, schema)'s fitted calibration; arrays are float64 in option order."""

    temperature: float | None = None
    #: shift → mean label distribution of the content-free reads under that assignment
    content_free: Mapping[int, np.ndarray] = field(default_factory=dict)
    content_free_states: tuple[str, ...] = ()
    #: top-label bins fitted on the contextual answers (``x_calibration: binned``)
    bins: TopLabelBins | None = None
    #: method → nonconformity scores of the calibration items under that method
    conformal: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def permutations(self) -> int:
        """The ``x_permutations`` the temperature and conformal scores were fitted under."""
        return int(self.fitted_on.get("request", {}).get("x_permutations", 1))

    def to_json(self) -> dict[str, Any]:
        """The artifact as JSON data (see the module docstring)."""
        methods: dict[str, Any] = {}
        if self.temperature is not None:
            methods["temperature"] = {"temperature": self.temperature}
        if self.content_free:
            methods["contextual"] = {
                "states": list(self.content_free_states),
                "content_free": {str(s): p.tolist() for s, p in sorted(self.content_free.items())},
            }
        if self.bins is not None:
            methods["binned"] = {
                "edges": self.bins.edges.tolist(),
                "values": self.bins.values.tolist(),
                "counts": self.bins.counts.tolist(),
            }
        return {
            **self.header(FORMAT),
            "methods": methods,
            "conformal": {m: s.tolist() for m, s in self.conformal.items()},
            "fitted_on": dict(self.fitted_on),
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> Calibration:
        """Check and build an artifact; raises CalibrationError naming ``source`` and the problem."""
        try:
            return _parse(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CalibrationError(f"{source}: not a slotread calibration artifact: {exc}") from None

    def save(self, path: Path) -> None:
        """Write the artifact atomically (a reader never sees half a file)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> Calibration:
        """Read an artifact file; raises CalibrationError naming the file and the problem."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{path}: cannot read it as JSON: {exc}") from None
        return cls.from_json(data, str(path))


def _distribution(values: Any, n: int, what: str) -> np.ndarray:
    p = np.asarray(values, dtype=np.float64)
    if p.shape != (n,) or not np.all(p > 0) or abs(p.sum() - 1) > 1e-6:
        raise ValueError(f"{what} must be {n} positive probabilities summing to 1")
    return p


def _bins(data: Any) -> TopLabelBins:
    edges, values, counts = (np.asarray(data[key], dtype=np.float64) for key in ("edges", "values", "counts"))
    if not (values.ndim == 1 and edges.shape == (len(values) - 1,) and counts.shape == values.shape):
        raise ValueError("methods.binned needs B values and counts and B − 1 edges")
    if np.any(np.diff(edges) <= 0) or np.any(np.diff(values) < 0) or not np.all((values > 0) & (values < 1)):
        raise ValueError("methods.binned needs ascending edges and non-decreasing values in (0, 1)")
    return TopLabelBins(edges, values, counts)


def _parse(data: Any) -> Calibration:
    header = parse_header(data, FORMAT)
    n = len(header["options"])
    methods = data.get("methods", {})
    temperature = methods.get("temperature", {}).get("temperature")
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"the temperature must be a positive number, got {temperature!r}")
    contextual = methods.get("contextual", {})
    content_free = {
        int(shift): _distribution(p, n, f"content_free[{shift}]")
        for shift, p in contextual.get("content_free", {}).items()
    }
    binned = methods.get("binned")
    bins = None if binned is None else _bins(binned)
    conformal = {}
    for method, scores in data.get("conformal", {}).items():
        values = np.asarray(scores, dtype=np.float64)
        if method not in CONFORMAL_METHODS or values.ndim != 1 or not np.all((values >= 0) & (values <= 1)):
            raise ValueError(f"conformal[{method!r}] must be scores in [0, 1] of one of {CONFORMAL_METHODS}")
        conformal[method] = values
    return Calibration(
        **header,
        temperature=None if temperature is None else float(temperature),
        content_free=content_free,
        content_free_states=tuple(contextual.get("states", ())),
        bins=bins,
        conformal=conformal,
    )
