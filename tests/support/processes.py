"""Process checks for tests (Linux /proc)."""

from __future__ import annotations


def pid_gone(pid: int) -> bool:
    """The process has exited: no longer listed, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the open and the read: ESRCH)
        return True
