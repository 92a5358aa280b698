"""The `mmserve` package's log records in the replica's own log file, formatted as Serve's.

Serve attaches its handlers (the replica's log file, with the replica's id and format) to the
`ray.serve` logger only. A record of `mmserve.engine.client` (an engine's death, say) would
otherwise reach nobody's handler but Python's last resort: printed bare on the worker's stderr,
and never at INFO.
"""

from __future__ import annotations

import logging


def log_package_to_replica(package: str = "mmserve") -> None:
    serve_logger = logging.getLogger("ray.serve")
    package_logger = logging.getLogger(package)
    package_logger.handlers = list(serve_logger.handlers)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
