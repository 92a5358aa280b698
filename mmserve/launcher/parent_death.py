"""Child processes that get SIGTERM when their parent dies, started without `preexec_fn`.

An engine must not outlive the process that started it (a killed replica or launcher would leave it
running, holding a connection and memory), so its children ask Linux for a signal when their parent
goes (`PR_SET_PDEATHSIG`). Not from `Popen(preexec_fn=...)`: that makes `subprocess` fork the whole
Ray worker and run Python in the copy, where a gRPC thread of Ray's can abort the process ("Other
threads are currently calling into gRPC, skipping fork() handlers", then SIGABRT). Without
`preexec_fn`, `subprocess` starts the child with `vfork`+`exec` and runs nothing of ours in between.

So the child is a tiny interpreter (`-S`: the standard library only) that makes the request itself,
checks that the parent it was started by is still its parent (if not, the parent died before the
request took effect and nobody would ever send the signal), and replaces itself with the real
command: same process id, environment and descriptors. The signal is sent when the *thread* that
started the child ends; start engines from a long-lived thread (an event loop's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

_SET_DEATH_SIGNAL_AND_EXEC = (
    "import ctypes, os, signal, sys\n"
    "PR_SET_PDEATHSIG = 1\n"
    "ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('mmserve: the parent process died before its child started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that the process it runs gets SIGTERM when this process (the calling thread)
    dies; on systems other than Linux, `argv` unchanged."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _SET_DEATH_SIGNAL_AND_EXEC, str(os.getpid()), *argv]
