"""Image payloads cut into pieces for the Ray call to the preprocessor, and joined back."""

from __future__ import annotations

import pytest

from deployments.inline_args import MAX_CUT_CHARS, PIECE_CHARS, cut_payloads, join_payloads


@pytest.mark.parametrize(
    "sizes",
    [[PIECE_CHARS + 1], [3 * PIECE_CHARS], [3 * PIECE_CHARS + 7], [40, PIECE_CHARS, 0, 2 * PIECE_CHARS + 1], [MAX_CUT_CHARS]],
)
def test_cut_pieces_fit_the_inline_limit_and_join_gives_the_payloads_back(sizes):
    # A letter of its own per payload (and one more at each end): any mix-up of pieces shows.
    payloads = [("<" + chr(ord("a") + i) * size + ">")[:size] for i, size in enumerate(sizes)]
    cut = cut_payloads(payloads)
    assert cut is not None
    counts, pieces = cut
    assert len(counts) == len(payloads)
    assert all(0 < len(piece) <= PIECE_CHARS for piece in pieces if piece) and sum(counts) == len(pieces)
    assert counts == [max(1, -(-len(p) // PIECE_CHARS)) for p in payloads]
    assert join_payloads(counts, tuple(pieces)) == payloads


@pytest.mark.parametrize("sizes", [[], [10], [PIECE_CHARS], [PIECE_CHARS // 2, PIECE_CHARS // 2], [MAX_CUT_CHARS + 1], [MAX_CUT_CHARS, 1]])
def test_payloads_that_go_inline_already_or_are_cheaper_whole_are_not_cut(sizes):
    assert cut_payloads(["x" * size for size in sizes]) is None


def test_join_refuses_pieces_that_do_not_match_their_counts():
    with pytest.raises(ValueError):
        join_payloads([2, 1], ("a", "b"))
    with pytest.raises(ValueError):
        join_payloads([0, 2], ("a", "b"))
