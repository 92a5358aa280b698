"""A built-in engine that can be told to die: `python -m tests.support.fatal_builtin_engine --handshake ...`.

It answers one extra utility call, `mmserve_test_fatal`, by failing the way a vLLM engine core
fails (ENGINE_CORE_DEAD on the output socket, exit code 1), for tests of the gateway's handling
of dead engines. Test-only: the production engine has no such hook.
"""

from __future__ import annotations

import sys
from typing import Any

from mmserve.builtin_engine import builtin_engine_command
from mmserve.builtin_engine.__main__ import main
from mmserve.builtin_engine.engine import BuiltinEngine, FatalEngineError

MODULE = "tests.support.fatal_builtin_engine"


class FatalOnRequestEngine(BuiltinEngine):
    def utilities(self) -> dict[str, Any]:
        return {**super().utilities(), "mmserve_test_fatal": self._die}

    def _die(self) -> None:
        raise FatalEngineError("fatal error requested by the mmserve_test_fatal utility")


def fatal_engine_command(handshake: str, **options: Any) -> list[str]:
    """`builtin_engine_command`'s argv, starting this engine instead."""
    cmd = builtin_engine_command(handshake, **options)
    cmd[cmd.index("mmserve.builtin_engine")] = MODULE
    return cmd


if __name__ == "__main__":
    sys.exit(main(engine_class=FatalOnRequestEngine))
