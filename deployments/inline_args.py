"""Image payloads cut into pieces that travel inside the Ray call to the preprocessor.

Ray sends an argument of up to 100 KiB (its `max_direct_call_object_size`) inside the call itself;
a bigger one is first put into the object store, pinned, fetched by the callee and freed. For the
data URI of a 640×480 JPEG (130 KB) that costs the caller, the callee and Ray's processes together
3.9 ms of CPU per call, against 2.1 ms for the same string cut into pieces below the limit, one
argument each (`bench/ray_args_bench.py`, medians of 3 runs). The gain shrinks with size (400 KB:
4.8 against 3.3; 1 MB: 5.2 against 5.0) and turns into a loss beyond (2 MB: 6.9 whole, 7.7 cut), so
only payloads up to 1 MiB in all are cut. The cut is only an encoding of the call: the preprocessor
joins the pieces back before anything reads them.
"""

from __future__ import annotations

# Characters per piece: below Ray's 100 KiB with room for its serialisation header (a data URI is
# ASCII, one byte per character; a piece of wider characters just takes the object-store path).
PIECE_CHARS = 96 * 1024
# Above this many characters in all, one argument through the object store costs less.
MAX_CUT_CHARS = 1024 * 1024


def cut_payloads(payloads: list[str]) -> tuple[list[int], list[str]] | None:
    """The payloads cut into pieces of at most `PIECE_CHARS`, with how many pieces each took; None
    when cutting gains nothing (they fit in one inline argument already) or costs more (over
    `MAX_CUT_CHARS` in all)."""
    total = sum(len(p) for p in payloads)
    if total <= PIECE_CHARS or total > MAX_CUT_CHARS:
        return None
    counts: list[int] = []
    pieces: list[str] = []
    for payload in payloads:
        parts = [payload[start : start + PIECE_CHARS] for start in range(0, len(payload), PIECE_CHARS)] or [""]
        counts.append(len(parts))
        pieces.extend(parts)
    return counts, pieces


def join_payloads(counts: list[int], pieces: tuple[str, ...] | list[str]) -> list[str]:
    """The inverse of `cut_payloads`."""
    if sum(counts) != len(pieces) or any(c < 1 for c in counts):
        raise ValueError(f"{len(pieces)} pieces do not make payloads of {counts} pieces")
    payloads: list[str] = []
    start = 0
    for count in counts:
        payloads.append("".join(pieces[start : start + count]))
        start += count
    return payloads
