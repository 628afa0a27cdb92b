"""One model's learned readouts, by schema, and the bank classifiers their partners read.

``ReadoutStore`` loads a directory of ``slotread fit`` artifacts (``quality.readouts.readout``) and says
before reading why a question cannot be answered with one. A readout with a lexical or an encoder
partner reads a classifier trained on its schema's example bank; that classifier is far larger than
the artifact, so it is fitted here, on the served bank, when the readouts load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np

from slotread.core.questions import Decision
from slotread.errors import ExampleBankError, InvalidRequest
from slotread.prompt.render import Layout
from slotread.quality.artifact import load_directory, schema_hash
from slotread.quality.examples.bank import ExampleBank, ExampleBanks
from slotread.quality.examples.dense import EmbeddingClassifier, bank_embedding_classifier
from slotread.quality.examples.lexical import TextClassifier, bank_classifier, floored
from slotread.quality.examples.meaning import Embed
from slotread.quality.examples.retrieval import Retrieval
from slotread.quality.readouts.readout import READOUT_FILES, Readout

logger = logging.getLogger(__name__)


class ReadoutStore:
    """The readouts of one model, by schema, from a directory of ``slotread fit`` artifacts.

    ``hidden_states`` says whether the engine returns hidden states (a remote one does not: only
    "logits" readouts can answer there). The lexical classifier of a readout with one is fitted on its
    schema's bank in ``banks`` here, once (logged with the time it took). Raises CalibrationError if an
    artifact cannot be read or two claim one schema; artifacts of other models are skipped.
    """

    def __init__(
        self,
        model: str,
        directory: Path | None = None,
        *,
        hidden_states: bool = True,
        banks: ExampleBanks | None = None,
        encoder: str | None = None,
        embed: Embed | None = None,
    ) -> None:
        self.model = model
        self.encoder = encoder
        #: how the served banks rank their examples: a readout's vote serves only under its own retrieval
        self.retrieval: Retrieval = banks.retrieval if banks is not None else "bm25"
        self.hidden_states = hidden_states
        self._readouts: dict[str, tuple[Readout, Path]] = {}
        self._lexical: dict[str, TextClassifier] = {}
        self._dense: dict[str, EmbeddingClassifier] = {}
        if directory is not None:
            self._readouts = load_directory(
                directory, READOUT_FILES, Readout.load, model, what="readouts", clash="are both readouts of"
            )
        for schema, (readout, path) in self._readouts.items():
            bank = banks.get(schema) if banks is not None else None
            if readout.lexical_weight is not None and bank is not None:
                self._lexical[schema] = fit_partner(bank_classifier, "lexical", readout.lexical_examples, bank, path)
            if readout.encoder is not None and readout.encoder == encoder and embed is not None and bank is not None:
                dense = partial(bank_embedding_classifier, embed=embed)
                self._dense[schema] = fit_partner(dense, "embedding", readout.encoder_examples, bank, path)

    def lexical(self, schema: str, state: str) -> np.ndarray:
        """q̃ (n,) of ``state`` from the lexical classifier of ``schema``'s readout (KeyError if none was fitted)."""
        return floored(self._lexical[schema].probabilities([state])[0])

    def dense(self, schema: str, state: str) -> np.ndarray:
        """ẽ (n,) of ``state`` from the embedding classifier of ``schema``'s readout (KeyError if none)."""
        return floored(self._dense[schema].probabilities([state])[0])

    def get(self, schema: str) -> Readout | None:
        """The readout of a schema, if one was loaded."""
        found = self._readouts.get(schema)
        return found[0] if found else None

    def layout_for(self, decision: Decision) -> Layout | None:
        """The prompt layout the readouts of ``decision``'s questions were fitted in (None if one is
        missing: ``readouts.apply.refuse_missing_readouts`` refuses that). Raises InvalidRequest when
        they differ: one decision is rendered in one layout."""
        found = [self.get(schema_hash(q, decision.instructions)) for q in decision.questions]
        layouts = {readout.layout for readout in found if readout is not None}
        if len(layouts) > 1:
            msg = (
                f"the readouts of these questions were fitted in different prompt layouts {sorted(layouts)}: ask apart"
            )
            raise InvalidRequest.at(["body", "x_readout"], msg)
        return layouts.pop() if layouts and None not in found else None

    def problem(self, question_id: str, schema: str, banked: bool) -> str | None:
        """Why question ``question_id`` (of ``schema``; ``banked``: an example bank serves it) cannot be
        answered with a readout here, or None."""
        readout = self.get(schema)
        where = f"question {question_id!r} on {self.model} (schema {schema[:16]})"
        if readout is None:
            return f"no readout is loaded for {where}; fit one with `slotread fit` and load it with --readout DIR"
        if readout.banked and not banked:
            partners = []
            if readout.vote_neighbours:
                partners.append(f"the vote of its {readout.vote_neighbours} nearest example-bank examples")
            if readout.lexical_weight is not None:
                partners.append("a text classifier trained on its example bank")
            if readout.encoder is not None:
                partners.append("an embedding classifier trained on its example bank")
            return (
                f"the readout of {where} adds {' and '.join(partners)}, and no bank serves this question; "
                "serve one with --example-bank"
            )
        if readout.vote_neighbours and readout.vote_retrieval != self.retrieval:
            return (
                f"the readout of {where} was fitted with the vote of its {readout.vote_retrieval}-nearest bank "
                f"examples, and this server ranks them by {self.retrieval}: serve it with --retrieval "
                f"{readout.vote_retrieval}"
            )
        if readout.lexical_weight is not None and schema not in self._lexical:
            return f"the readout of {where} has no lexical classifier: its readouts were loaded without its bank"
        if readout.encoder is not None and schema not in self._dense:
            return (
                f"the readout of {where} adds an embedding classifier of the sentence encoder {readout.encoder}: "
                f"serve that encoder (--encoder {readout.encoder}) and its bank"
            )
        if readout.features == "hidden+logits" and not self.hidden_states:
            return (
                f"the readout of {where} reads hidden states, which a remote engine does not return; "
                "fit one with `slotread fit --features logits` for this server"
            )
        return None


Classifier = TypeVar("Classifier", TextClassifier, EmbeddingClassifier)


def fit_partner(
    fit: Callable[[ExampleBank], Classifier], name: str, fitted_with: int, bank: ExampleBank, path: Path
) -> Classifier:
    """The ``name`` classifier of the readout at ``path``, fitted on the served ``bank`` by ``fit``; logs the
    time, and warns when the bank's size differs from the ``fitted_with`` examples the readout was fitted with."""
    started = time.perf_counter()
    try:
        classifier = fit(bank)
    except ValueError as exc:
        raise ExampleBankError(f"{bank.source}: cannot fit the {name} classifier of {path}: {exc}") from None
    logger.info(
        "the %s classifier of %s: fitted on %d examples of %s in %.1f s",
        name,
        path.name,
        len(bank),
        bank.source,
        time.perf_counter() - started,
    )
    if len(bank) != fitted_with:
        logger.warning(
            "%s was fitted with a bank of %d examples; %s serves %d: its %s weight may not fit",
            path,
            fitted_with,
            bank.source,
            len(bank),
            name,
        )
    return classifier
