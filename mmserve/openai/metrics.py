"""Per-request records, Prometheus metrics and the one structured log line per request.

Metrics live in a per-ingress-replica registry served at `/metrics` on the Serve endpoint
(scrape each ingress replica, or sum over them). Engine-side values (state, requests in
flight, bytes sent) are read from the engine clients at scrape time.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from .body_memory import BudgetLease

logger = logging.getLogger("mmserve.requests")

# The request line goes to the replica's log file only, never to its stderr (Serve's console handler
# honours `log_to_stderr`, as for its controller's routine lines): a line on stderr is read by Ray's log
# monitor, published through GCS and printed by `serve run`'s driver, four processes' work per request.
_FILE_ONLY = {"log_to_stderr": False}

# The status recorded for a request whose client went away before its answer (nginx's
# convention): neither a success nor the server's fault.
CLIENT_CLOSED = 499


def send_request_log_to(serve_logger: logging.Logger) -> None:
    """Make the per-request lines appear where the replica's own lines go.

    Inside a Ray worker nothing configures `mmserve.requests` (the root logger has no handler
    at INFO), so its lines were dropped; Serve configures only its own logger, with the handler
    that writes the replica's log file. Idempotent."""
    logger.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)
    if serve_logger.handlers:
        logger.propagate = False

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclass
class RequestRecord:
    """What one request did; filled as it goes, logged once when it ends."""

    endpoint: str
    stream: bool = False
    started: float = field(default_factory=time.monotonic)
    # Wall-clock arrival at the ingress: the engine request's `arrival_time`, as vLLM sets it.
    arrival_time: float = field(default_factory=time.time)
    request_id: str | None = None
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_images: int = 0
    preprocess_ms: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    # The request's share of the ingress byte budget, given back as its bytes go (at the latest
    # when the request ends).
    lease: BudgetLease | None = field(default=None, repr=False)

    def log_fields(self) -> dict:
        now = time.monotonic()
        ttft = None if self.first_token_at is None else round((self.first_token_at - self.started) * 1e3, 2)
        return {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "status": self.status,
            "outcome": "ok" if self.status < 400 and self.error is None else (
                "client_closed" if self.status == CLIENT_CLOSED else "error"),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "images": self.num_images,
            "preprocess_ms": None if self.preprocess_ms is None else round(self.preprocess_ms, 2),
            "ttft_ms": ttft,
            "total_ms": round((now - self.started) * 1e3, 2),
            "finish_reasons": self.finish_reasons,
            "error": self.error,
        }


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmserve_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.latency = Histogram("mmserve_request_seconds", "End-to-end request latency", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("mmserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mmserve_inter_token_latency_seconds", "Time between streamed outputs", buckets=_ITL_BUCKETS, registry=r)
        self.preprocess = Histogram("mmserve_preprocess_seconds_per_image", "Preprocessing time per image", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mmserve_prompt_tokens", "Prompt tokens sent to engines", registry=r)
        self.completion_tokens = Counter("mmserve_completion_tokens", "Tokens generated", registry=r)
        self.in_flight = Gauge("mmserve_ingress_requests_in_flight", "Requests in flight in this ingress replica", registry=r)
        self.body_budget_held = Gauge(
            "mmserve_ingress_body_budget_held_bytes", "Bytes of this ingress replica's body budget held by requests", registry=r)
        self.body_budget_limit = Gauge(
            "mmserve_ingress_body_budget_limit_bytes", "This ingress replica's body budget (limits.ingress_body_budget_bytes)", registry=r)
        self.engine_up = Gauge("mmserve_engine_ready", "1 if the engine is ready, else 0", ["engine"], registry=r)
        self.engine_in_flight = Gauge("mmserve_engine_requests_in_flight", "Engine requests in flight (queue depth)", ["engine"], registry=r)
        self.engine_bytes = Gauge("mmserve_engine_bytes_sent", "Bytes sent to the engine since its client started", ["engine"], registry=r)
        self.engine_images_recalled = Gauge(
            "mmserve_engine_image_requests_recalled",
            "Image requests sent by hash only, not preprocessed: the engine held their images (since its client started)",
            ["engine"], registry=r,
        )  # fmt: skip
        self.resize_path = Gauge("mmserve_image_resize_path_info", "1 for the exact image resize in use (pillow-simd, numba-exact or numpy-exact)", ["path"], registry=r)

    def set_resize_path(self, active: str) -> None:
        for path in ("pillow-simd", "numba-exact", "numpy-exact"):
            self.resize_path.labels(path).set(1 if path == active else 0)

    def observe_finished(self, record: RequestRecord) -> None:
        self.requests.labels(record.endpoint, str(record.status)).inc()
        self.latency.labels(record.endpoint).observe(time.monotonic() - record.started)
        if record.first_token_at is not None:
            self.ttft.observe(record.first_token_at - record.started)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.completion_tokens.inc(record.completion_tokens)
        if record.preprocess_ms is not None and record.num_images:
            self.preprocess.observe(record.preprocess_ms / 1e3 / record.num_images)
        logger.info("request %s", json.dumps(record.log_fields(), separators=(",", ":")), extra=_FILE_ONLY)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
