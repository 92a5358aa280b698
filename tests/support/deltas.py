"""Streamed deltas compared with vLLM's: tool-call ids are random on both sides."""

from __future__ import annotations


def without_tool_call_ids(shown: dict) -> dict:
    """A delta's JSON with each tool call's id (checked to be vLLM-shaped) replaced by "ID"."""
    for call in shown.get("tool_calls", ()):
        if "id" in call:
            assert call["id"].startswith("chatcmpl-tool-")
            call["id"] = "ID"
    return shown
