"""Errors about a request's images: the client's mistake (400), a request too large for a
preprocessor replica (413), or a replica busy with other images (503); the preprocessor answers each
as a refusal (`mmserve/transit/refusals.py`)."""

from __future__ import annotations


class ImageInputError(ValueError):
    """An image could not be used: unreachable, refused by policy, not an image, over a limit."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        prefix = f"image {index + 1}: " if index is not None else ""
        super().__init__(prefix + message)
        self.index = index


class ImagesTooLargeError(ImageInputError):
    """The request needs more pixels decoded at once than a preprocessor replica ever holds: it
    would be refused whenever it came, so it is not a 503 but a 413."""


class PreprocessorBusyError(Exception):
    """The replica's pixel budget is taken by other requests' images: retry shortly (503)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
