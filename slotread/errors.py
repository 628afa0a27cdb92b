"""Every exception slotread raises.

    SlotreadError                  base class; never raised itself
    ├── InvalidRequest             the caller's request is malformed (HTTP 422, CLI exit 2);
    │                              carries FastAPI-style ``detail`` items {loc, msg, type}
    ├── PromptTooLong              a rendered prompt exceeds the model's limit (HTTP 413)
    ├── UnknownModel               the request names a model this server does not serve (HTTP 404)
    ├── ModelLoadError             a model cannot be fetched, verified or loaded, or its tokenizer
    │                              cannot provide the labels slotread needs; says which model and why
    ├── BodyTooLarge               the request body, or what it decompresses to, is over the limit (413)
    ├── UnsupportedEncoding        the request body's Content-Encoding is not gzip, zstd or identity (415)
    ├── AuthenticationFailed       the server checks API keys and the request has none or a wrong one (401)
    ├── Overloaded                 no decision slot is free and none frees up in time (529, retry-after)
    │   └── UpstreamTimeout        the remote replicas, busy but alive, did not answer a read by its deadline
    ├── NotReady                   the model is still loading, or failed to load (503)
    ├── WireError                  a vLLM-style completions body breaks the engine wire contract
    │                              (``engines/remote/wire.py``); ``param`` names the field (400)
    ├── UpstreamUnavailable        no remote replica could take a read: none in rotation, all busy, or the one
    │                              resend of a read that failed on a replica failed too (503, retry-after)
    ├── UpstreamError              a remote replica refused a read as malformed (4xx) or answered it
    │                              malformed: the gateway and the replica disagree on the wire, not the
    │                              caller's fault (502)
    ├── ReadAbandoned              a read's caller left (its connection closed) before the engine got to it:
    │                              it is not read (an engine server's reads past a gateway's deadline)
    ├── EngineFault                the engine returned unusable scores (NaN or infinite label logits): a fault
    │                              of the engine or the model, never of the request (500, logged)
    ├── EvalError                  an evaluation cannot run: a dataset that is missing or malformed
    │                              (says where it looked), or a run folder holding another run
    ├── CalibrationError           a calibration artifact cannot be read, or two claim one question;
    │                              says which file and why (the server refuses to start)
    ├── ExampleBankError           an example bank cannot be read, or two serve one question schema;
    │                              says which bank and why (the server refuses to start)
    └── SettingsError              a setting out of range, or settings that cannot work together
                                   (``settings.py``); says which (CLI exit 1, the server refuses to start)

Only the edges (cli, the server) turn these into exit codes or status codes.
"""

from __future__ import annotations

from typing import Any, TypedDict


class ErrorDetail(TypedDict):
    """One validation problem, in pydantic/FastAPI's shape."""

    loc: list[str | int]
    msg: str
    type: str


class SlotreadError(Exception):
    """Base class of every error slotread raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its message and fields, not its constructor's arguments (which differ between
        # subclasses): an engine process's errors reach the server with their type (engines/process.py).
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(kind: type[SlotreadError], args: tuple[Any, ...], fields: dict[str, Any]) -> SlotreadError:
    """A pickled ``SlotreadError`` again, its ``__init__`` not called."""
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(fields)
    return error


class InvalidRequest(SlotreadError):
    """The request is malformed; ``detail`` lists every problem found, each located."""

    def __init__(self, detail: list[ErrorDetail]) -> None:
        self.detail = detail
        super().__init__("; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in detail))

    @classmethod
    def at(cls, loc: list[Any], msg: str, type: str = "value_error") -> InvalidRequest:
        """One problem at one location."""
        return cls([{"loc": list(loc), "msg": msg, "type": type}])


class PromptTooLong(SlotreadError):
    """A rendered prompt has more tokens than the model (or the configured limit) accepts."""

    def __init__(self, tokens: int, limit: int) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(f"the prompt has {tokens} tokens; the limit is {limit}")


class UnknownModel(SlotreadError):
    """The request names a model that is not served here."""

    def __init__(self, name: str, served: list[str]) -> None:
        self.name = name
        super().__init__(f"model {name!r} is not served here; available: {', '.join(served)}")


class ModelLoadError(SlotreadError):
    """A model cannot be fetched, verified or loaded; the message names the model and the reason."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"cannot load model {model!r}: {reason}")


class BodyTooLarge(SlotreadError):
    """The request body is larger than the server accepts (compressed or after decompression)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the request body is over the limit of {limit} bytes (after decompression)")


class UnsupportedEncoding(SlotreadError):
    """The request body's Content-Encoding is not one the server decodes."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        super().__init__(f"Content-Encoding {encoding!r} is not supported; use zstd, gzip or none")


class AuthenticationFailed(SlotreadError):
    """The server checks API keys and the request carries none, or one it does not know."""


class Overloaded(SlotreadError):
    """No decision slot is free and none freed up in time; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class UpstreamTimeout(Overloaded):
    """The remote replicas did not answer a read before the decision's deadline. They are busy, not gone
    (a replica that is gone leaves the rotation and the read goes elsewhere): a load problem, answered
    as one (529 with retry-after)."""


class NotReady(SlotreadError):
    """The server is up but cannot decide yet: the model is still loading, or failed to load."""


class WireError(SlotreadError):
    """A ``/v1/completions`` request or response body breaks the wire contract; ``param`` names the field
    (the message names it too).

    The engine server answers it 400 in vLLM's error shape; a client reading a response that raises it
    got an answer it cannot use.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        self.message = message
        self.param = param
        super().__init__(message)


class UpstreamUnavailable(SlotreadError):
    """No remote replica could take a read in time; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class UpstreamError(SlotreadError):
    """A remote replica refused a read as malformed (4xx) or answered one malformed; the message says
    which and why.

    A read the gateway built from a valid request should never be refused, so this is not retried on
    another replica: it would be refused there too. (A 5xx is the replica's own failure: the read is
    sent again elsewhere.)
    """


class ReadAbandoned(SlotreadError):
    """A read's caller left before the engine got to it, so it was not read: the engine's time goes to
    the reads someone still waits for (``serve.batcher``)."""


class EngineFault(SlotreadError):
    """The engine returned label logits that are not finite; the message names the question. Answering with
    them would put NaN in the response (no JSON encoder takes it), so the decision stops here."""


class EvalError(SlotreadError):
    """An evaluation cannot run; the message says what is missing or wrong, and where."""


class CalibrationError(SlotreadError):
    """A calibration artifact cannot be read or breaks the format; the message names the file and the problem."""


class ExampleBankError(SlotreadError):
    """An example bank cannot be read or breaks the format; the message names the bank and the problem."""


class SettingsError(SlotreadError):
    """A setting (a flag, an environment variable or a Settings field) is out of range, or settings cannot
    work together; the message names them."""
