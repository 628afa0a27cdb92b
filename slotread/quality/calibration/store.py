"""One model's calibration state: fitted artifacts, content-free distributions, batch priors.

Thread-safe: the server's decision threads share one store. Artifacts come from a directory of JSON
files (``slotread serve --calibration DIR``); content-free distributions read at answer time are kept
in memory (the most recent ``MAX_LEARNED`` schemas) and, with a directory, written back to it, so a
restarted server reads them from disk instead of the model.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from slotread.errors import CalibrationError
from slotread.quality.artifact import file_stem, load_directory
from slotread.quality.calibration.artifact import Calibration

logger = logging.getLogger(__name__)

#: Schemas whose content-free distributions are kept in memory beyond the loaded artifacts.
MAX_LEARNED = 4096
#: Batch priors: keys (schema, shift) kept, pseudo-answers of the uniform prior, and the number of
#: answers after which the running mean turns into an exponential one (old traffic fades out).
BATCH_KEYS = 4096
BATCH_PSEUDO_COUNT = 16
BATCH_WINDOW = 1000


class BatchPriors:
    """Running means of answers' raw label distributions per key, shrunk toward uniform.

    prior m = (N·mean + c·u) / (N + c), with u uniform over the n options, c = ``pseudo_count``, and
    N = min(answers seen, ``window``). The mean is cumulative for the first ``window`` answers, then
    exponential: mean += (p − mean) / window. With nothing seen m = u, so calibration changes nothing;
    the least recently used keys beyond ``max_keys`` are forgotten.
    """

    def __init__(
        self, pseudo_count: float = BATCH_PSEUDO_COUNT, window: int = BATCH_WINDOW, max_keys: int = BATCH_KEYS
    ) -> None:
        self.pseudo_count = pseudo_count
        self.window = window
        self.max_keys = max_keys
        self._means: OrderedDict[Hashable, tuple[int, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._means)

    def _prior(self, key: Hashable, n: int) -> np.ndarray:
        uniform = np.full(n, 1.0 / n)
        if key not in self._means:
            return uniform
        count, mean = self._means[key]
        seen = min(count, self.window)
        return (seen * mean + self.pseudo_count * uniform) / (seen + self.pseudo_count)

    def priors_then_update(self, keys: Sequence[Hashable], raw: np.ndarray) -> np.ndarray:
        """The prior of each read's key as it stood before this answer, then fold the reads in.

        ``raw`` is (R, n): each read's uncalibrated distribution, read under ``keys[r]``.
        """
        with self._lock:
            priors = np.stack([self._prior(key, raw.shape[1]) for key in keys])
            for key, p in zip(keys, raw, strict=True):
                count, mean = self._means.pop(key, (0, np.zeros_like(p)))
                count += 1
                self._means[key] = (count, mean + (p - mean) / min(count, self.window))
            while len(self._means) > self.max_keys:
                self._means.popitem(last=False)
            return priors


class CalibrationStore:
    """The calibration artifacts of one model, by schema, and what it learns while serving.

    Raises CalibrationError if an artifact in ``directory`` cannot be read, or two claim one schema.
    """

    def __init__(self, model: str, directory: Path | None = None) -> None:
        self.model = model
        self.directory = directory
        self._artifacts: dict[str, tuple[Calibration, Path]] = {}
        self._learned: OrderedDict[str, Calibration] = OrderedDict()
        self._lock = threading.Lock()
        self.batch = BatchPriors()
        if directory is not None:
            self._artifacts = load_directory(
                directory, "*.json", Calibration.load, model, what="calibration artifacts", clash="both calibrate"
            )

    def artifact(self, schema: str) -> Calibration | None:
        """The fitted artifact of a schema, if one was loaded."""
        found = self._artifacts.get(schema)
        return found[0] if found else None

    def content_free(self, schema: str) -> Mapping[int, np.ndarray]:
        """Shift → content-free distribution of a schema, from its artifact and what was read since."""
        with self._lock:
            learned = self._learned.get(schema)
            if learned is not None:
                self._learned.move_to_end(schema)
            fitted = self.artifact(schema)
            return {
                **(fitted.content_free if fitted else {}),
                **(learned.content_free if learned else {}),
            }

    def learn_content_free(self, found: Calibration) -> None:
        """Keep newly read content-free distributions (``found``: an artifact holding only those) and, with
        a directory, merge them into the schema's artifact file (created if there is none)."""
        with self._lock:
            known = self._learned.pop(found.schema, None)
            merged = (
                found if known is None else replace(known, content_free={**known.content_free, **found.content_free})
            )
            self._learned[found.schema] = merged
            while len(self._learned) > MAX_LEARNED:
                self._learned.popitem(last=False)
            if self.directory is None:
                return
            try:
                self._persist(found)
            except (OSError, CalibrationError) as exc:  # the answer does not need the file: say so, go on
                logger.warning(
                    "content-free reads of schema %s not written to %s: %s", found.schema, self.directory, exc
                )

    def _persist(self, found: Calibration) -> None:
        loaded = self._artifacts.get(found.schema)
        path = loaded[1] if loaded else self.directory_path(found.schema)
        on_disk = Calibration.load(path) if path.exists() else found
        on_disk = replace(
            on_disk,
            content_free={**on_disk.content_free, **found.content_free},
            content_free_states=found.content_free_states,
        )
        on_disk.save(path)
        if loaded:
            self._artifacts[found.schema] = (on_disk, path)

    def directory_path(self, schema: str) -> Path:
        """Where a new artifact of ``schema`` is written: ``<model>.<schema[:16]>.json`` in the directory."""
        assert self.directory is not None
        return self.directory / f"{file_stem(self.model, schema)}.json"
