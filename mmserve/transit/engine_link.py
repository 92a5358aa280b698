"""The gateway's own inter-tier protocol: what an ingress replica and an engine client send each other.

Not vLLM's wire (that is `mmserve/wire`, which mirrors vLLM only). Each ingress replica subscribes
once to each engine client (one long-lived Ray call, the control channel: its first item names the
engine client's inbox, its end says the engine client is gone); everything else travels over ZMQ
(`mmserve.transit.sockets`): the replica sends its requests and aborts (`LinkRequest`) to the engine
client's inbox, and the engine client sends back `OutputBatch`es: the answers to those requests and
the outputs of all the replica's requests since the previous batch, merged while the ingress lags.
An image request names its images (URLs, data URIs included) and the preprocessor, which the engine
client has process them itself, so the pixels come to it through the object store, never through
the ingress or the link. So Ray carries no call per request, and nothing per token. Everything is
msgpack-encoded, and numbered on its link (`sockets.LinkMessage`): a message lost either way fails
what the ingress replica has in flight on that engine client (the engine client aborts it, and says
so: `OutputBatch.lost`); an ingress replica that waits with nothing heard probes (`Probe`).
"""

from __future__ import annotations

import msgspec

from ..multimodal.types import ImageBatchRequest
from ..wire import EngineCoreOutput, EngineCoreRequest
from .refusals import Refusal
from .sockets import LinkMessage


class PromptAccepted(msgspec.Struct, frozen=True):
    """The prompt as sent to the engine (image placeholders expanded), which the ingress needs
    for usage and detokenization."""

    prompt_token_ids: list[int]
    num_images: int = 0
    # Time the preprocessing tier spent on this request's images; None: none, the engine client
    # recalled them (the engine held them all: `mmserve/multimodal/recent_images.py`).
    preprocess_ms: float | None = 0.0


class Admission(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's admission: it is with the engine (`accepted` for image requests, whose prompt
    grew), or it was refused (and nothing reached the engine)."""

    accepted: PromptAccepted | None = None
    refused: Refusal | None = None


class RequestFailed(msgspec.Struct, frozen=True):
    """A request the engine client had sent failed without finishing (its engine died)."""

    request_id: str
    message: str


class AddAnswer(msgspec.Struct, frozen=True):
    """The engine client's answer to a `TextRequest` or `ImageRequest`: its `Admission`."""

    request_id: str
    admission: Admission


class OutputBatch(LinkMessage, frozen=True, omit_defaults=True):
    """One message of an ingress replica's output stream from one engine client: its requests'
    outputs in arrival order, its requests that failed, and the answers to its requests; `lost`:
    messages from the ingress replica were lost on the way, and the engine client aborted every
    request of its. The `subscribe` call's one item is empty except for `replica`, which names the
    engine-client replica sending the stream, and `requests_address`, that replica's inbox for
    `LinkRequest`s."""

    outputs: list[EngineCoreOutput] = []
    failures: list[RequestFailed] = []
    answers: list[AddAnswer] = []
    replica: str | None = None
    requests_address: str | None = None
    lost: bool = False


class TextRequest(LinkMessage, frozen=True, tag="add"):
    """A request without images: answered by an `AddAnswer` in the caller's output batches."""

    caller: str
    request: EngineCoreRequest


class PreprocessorName(msgspec.Struct, frozen=True):
    """A preprocessor deployment, by its Serve application and deployment names, and the version of
    its settings: what it answered before for an image stands only while that is the same."""

    app: str
    deployment: str
    version: str = ""


class ImageRequest(LinkMessage, frozen=True, tag="add_images"):
    """A request with images: the engine client has `preprocessor` process `images` (the URLs,
    data URIs included: never pixels) and sends the request with the result; answered by an
    `AddAnswer` in the caller's output batches. The `n` > 1 choices of one request name the same
    `group` and their number (`choices`): the engine client processes their images once and shares them."""

    caller: str
    request: EngineCoreRequest
    images: ImageBatchRequest
    preprocessor: PreprocessorName
    group: str = ""
    choices: int = 1


class AbortRequests(LinkMessage, frozen=True, tag="abort"):
    """The caller gave these requests up (its client left, a stop string matched)."""

    caller: str
    request_ids: list[str]


class Probe(LinkMessage, frozen=True, tag="probe"):
    """The caller has requests in flight and has heard nothing for a while: the engine client
    answers with a numbered `OutputBatch` at once (`sockets.LINK_PROBE_S`)."""

    caller: str


# What an ingress replica sends an engine client's inbox.
LinkRequest = TextRequest | ImageRequest | AbortRequests | Probe


class EngineEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item of an engine request's stream inside the ingress: the accepted prompt (first,
    image requests only) or a batch of the engine's outputs, in arrival order; or, alone, the
    request's refusal."""

    outputs: list[EngineCoreOutput] = []
    accepted: PromptAccepted | None = None
    refused: Refusal | None = None


class EngineInfo(msgspec.Struct, frozen=True):
    """What the ingress needs to know about one engine."""

    state: str
    builtin: bool
    handshake_address: str | None
    death_reason: str | None = None
    vllm_version: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    num_in_flight: int = 0
    # The built-in engine's process id (None for external engines).
    builtin_pid: int | None = None
    bytes_sent: int = 0
    # ADD messages sent to the engine since this replica started.
    requests_sent: int = 0
    # The engine's own request counts, as of its last scheduler stats (None: none received).
    engine_running: int | None = None
    engine_waiting: int | None = None
    engine_kv_cache_usage: float | None = None
    # Images sent by hash only (the engine held them); requests resent after an engine cache miss.
    mm_items_skipped: int = 0
    mm_cache_miss_resends: int = 0
    # Requests received (`TextRequest`, `ImageRequest`) since this replica started; of them, with images.
    requests_received: int = 0
    image_requests_received: int = 0
    # Of those, requests whose images were recalled, not processed: the engine held them all
    # (`mmserve/multimodal/recent_images.py`).
    images_recalled: int = 0
    # Jobs sent to the preprocessor replicas (the `n` > 1 choices of one request share one).
    preprocessing_jobs: int = 0


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(OutputBatch)
_link_request_decoder: msgspec.msgpack.Decoder[LinkRequest] = msgspec.msgpack.Decoder(LinkRequest)  # type: ignore[arg-type]


def encode(message: OutputBatch | LinkRequest) -> bytes:
    return _encoder.encode(message)


def decode_link_request(data: bytes) -> LinkRequest:
    return _link_request_decoder.decode(data)


def unreadable_request_sender(data: bytes) -> tuple[str, str] | None:
    """(caller, request id) of a `TextRequest` or `ImageRequest` that `decode_link_request` could not read (a caller
    of another version, say), so that it can be answered instead of left waiting; None if even
    those cannot be found."""
    try:
        message = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(message, dict) or message.get("type") not in ("add", "add_images"):
        return None
    caller, request = message.get("caller"), message.get("request")
    request_id = request[0] if isinstance(request, list) and request else None
    if isinstance(caller, str) and isinstance(request_id, str):
        return caller, request_id
    return None


def decode_output_batch(data: bytes) -> OutputBatch:
    return _batch_decoder.decode(data)
