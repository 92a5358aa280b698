"""An engine client's answers over the link, raised in the ingress as the same `add` over Ray would have raised them."""

from __future__ import annotations

import pytest

from deployments.engine_connection import _admission
from mmserve.engine import EngineDeadError, EngineNotReadyError
from mmserve.protocol import AddAnswer, AddFailed, Admission, RequestRefused


def test_an_admission_is_handed_on():
    refused = Admission(refused=RequestRefused("overloaded", "full"), replica="r1")
    assert _admission(AddAnswer("a", admission=refused)) == refused


@pytest.mark.parametrize(("kind", "error"), [("dead", EngineDeadError), ("not_ready", EngineNotReadyError), ("internal", RuntimeError)])
def test_a_failure_is_raised_typed(kind, error):
    with pytest.raises(error, match="the reason"):
        _admission(AddAnswer("a", failed=AddFailed(kind, "the reason")))


def test_an_empty_answer_is_an_error_not_an_admission():
    with pytest.raises(RuntimeError, match="neither"):
        _admission(AddAnswer("a"))
