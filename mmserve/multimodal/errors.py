"""Errors about a request's images: always the client's fault, always a 400."""


class ImageInputError(ValueError):
    """An image could not be used: unreachable, refused by policy, not an image, over a limit."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        prefix = f"image {index + 1}: " if index is not None else ""
        super().__init__(prefix + message)
        self.index = index
