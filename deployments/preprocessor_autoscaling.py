"""The preprocessor's autoscaling policy: replicas for the image requests they hold.

Serve's default policy counts a replica's ongoing Serve calls, but most of the preprocessor's work
arrives over the preprocessing link, and each engine client attached there holds one Serve call
open for as long as it uses the replica. So each replica reports the image requests it is working
on or holding in its queue (`PreprocessorDeployment.record_autoscaling_stats`), and the deployment
wants `their sum / target_ongoing_requests` replicas; Serve rounds up and applies min/max and the
up/down delays around it. Serve pickles this module by value into its controller, so it imports
nothing of this repository.
"""

from __future__ import annotations

from typing import Any

# The metric each preprocessor replica reports: image requests it works on or holds queued.
PREPROCESSOR_REQUESTS_METRIC = "preprocessor_requests"


def preprocessor_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve autoscaling policy (called with `ray.serve.config.AutoscalingContext`): the replicas the
    reported load needs; the current number while no replica has reported."""
    held = (ctx.aggregated_metrics or {}).get(PREPROCESSOR_REQUESTS_METRIC) or {}
    if not held:
        return ctx.current_num_replicas, {}
    return sum(held.values()) / ctx.config.get_target_ongoing_requests(), {}
