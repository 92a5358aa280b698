"""Ray's failures as the deployments read them: the error inside Ray's wrapping, in one line."""

from __future__ import annotations


def describe(exc: BaseException) -> str:
    """`exc`'s type and the first line of its message (Ray's carry whole tracebacks)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def innermost_cause(exc: BaseException) -> BaseException:
    """The innermost cause of a chain of Ray task errors (one wrapping per hop)."""
    seen = 0
    while seen < 8:
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc
