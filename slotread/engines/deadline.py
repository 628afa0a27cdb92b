"""By when a caller needs its reads answered: a decision's deadline, for the engines that can stop waiting.

The server sets it around each decision (``serve.service``: the request's arrival plus
``--request-deadline``); the remote engine waits on its replicas until then and no longer
(``engines/remote/pool.py``). A read in process cannot be interrupted, so the in-process engines
do not look at it. A context variable, because the deadline belongs to the decision a thread is
answering, and the pipeline between the server and the engine has no business carrying it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: ``time.monotonic()`` by which the current decision must be answered; None: no deadline
_answer_by: ContextVar[float | None] = ContextVar("slotread_answer_by", default=None)


def answer_by() -> float | None:
    """The current decision's deadline (``time.monotonic()``), or None where none was set."""
    return _answer_by.get()


@contextmanager
def answering_by(moment: float) -> Iterator[None]:
    """Reads in this block (in this thread) are needed by ``moment`` (``time.monotonic()``)."""
    token = _answer_by.set(moment)
    try:
        yield
    finally:
        _answer_by.reset(token)
