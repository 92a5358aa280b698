"""Why a request did not reach its engine, whichever hop said so: one refusal kind per reason, the same from the preprocessor replica to the engine client to the ingress.

| kind              | said by                      | why                                                                  | the client gets |
|-------------------|------------------------------|----------------------------------------------------------------------|-----------------|
| `image`           | preprocessor                 | an image is the client's mistake (unreachable, not an image, a limit) | 400             |
| `image_too_large` | preprocessor                 | more pixels decoded at once than a preprocessor replica ever holds   | 413             |
| `invalid`         | engine client                | the engine guard refuses the prompt (too long, a bad token id)       | 400             |
| `overloaded`      | engine client                | its engine holds `max_in_flight` requests                            | 429             |
| `busy`            | preprocessor, engine client  | a preprocessor replica's queue is full, or none was reachable in time | 503, Retry-After |
| `lost`            | any link                     | the request, a job or an answer was lost on a link, or the replica at its other end died, twice | 503, Retry-After |
| `dead`            | engine client                | its engine died                                                      | 503, Retry-After |
| `not_ready`       | engine client                | its engine was not ready in time                                     | 503, Retry-After |
| `internal`        | preprocessor, engine client  | a bug of ours, logged where it happened                              | 500             |
| `cancelled`       | engine client                | the caller aborted the request first                                 | (the client left) |

A refusal travels as data (`Refusal`), never as an exception across a Ray call (Serve logs each such
exception with its traceback, which a client must not be able to cause at will). A loss on a link is
found there and raised as `LinkLost` in the process that found it; a request lost before its first
output is sent once more (the preprocessing job by the engine client, the request by the router),
and a second loss is refused `lost`. The ingress raises each refusal as its typed error
(`refusal_error`), which `mmserve/openai/errors.py` maps to the HTTP answer above.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ..engine import EngineDeadError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from ..multimodal.errors import ImageInputError, ImagesTooLargeError, PreprocessorBusyError

RefusalKind = Literal[
    "image", "image_too_large", "invalid", "overloaded", "busy", "lost", "dead", "not_ready", "internal", "cancelled"
]


class Refusal(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request, or its images, went no further (the table above)."""

    kind: RefusalKind
    message: str
    # The request field at fault, for the client (OpenAI's `error.param`).
    param: str | None = None
    retry_after_s: int | None = None


class LinkLost(Exception):
    """A message, a job or an answer was lost on a link, or the replica at the link's other end died."""


class GatewayBusyError(Exception):
    """A tier between the ingress and the engines is full, or lost the request before any output:
    the caller should retry shortly."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def refusal_of(exc: ImageInputError | PreprocessorBusyError) -> Refusal:
    """What a preprocessor replica answers for the errors of its images."""
    if isinstance(exc, PreprocessorBusyError):
        return Refusal("busy", str(exc), "messages", exc.retry_after_s)
    return Refusal("image_too_large" if isinstance(exc, ImagesTooLargeError) else "image", str(exc), "messages")


def busy(message: str) -> Refusal:
    return Refusal("busy", f"{message}; retry shortly", retry_after_s=1)


def refusal_error(refusal: Refusal) -> Exception:
    """The typed error a refusal stands for in the ingress."""
    kind, message = refusal.kind, refusal.message
    if kind == "image":
        return ImageInputError(message)  # the message already names the image
    if kind == "image_too_large":
        return ImagesTooLargeError(message)
    if kind == "overloaded":
        return EngineOverloadedError(message)
    if kind in ("busy", "lost"):
        return GatewayBusyError(message, retry_after_s=refusal.retry_after_s or 1)
    if kind == "dead":
        return EngineDeadError(message)
    if kind == "not_ready":
        return EngineNotReadyError(message)
    if kind == "internal":
        return RuntimeError(f"the request failed in the gateway: {message}")
    return InvalidRequestError(message, refusal.param)  # "invalid"; "cancelled" reaches no client
