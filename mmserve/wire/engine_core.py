"""EngineCore request and output messages.

Mirrors `vllm.v1.engine` of vLLM 0.32. `EngineCoreRequest`, `EngineCoreOutputs`,
`EngineCoreOutput` and `UtilityOutput` are `array_like` msgspec structs there: positional
msgpack arrays whose field *order* is the contract. Newer vLLM releases append fields at the
end (0.33 appends `error` to `EngineCoreOutput`); msgspec ignores trailing elements it does
not know, which is what makes our decoding tolerant. Fields we never read are typed `Any`
so that a change in their inner shape cannot break decoding.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from .multimodal import NUMPY_DTYPE_BY_TORCH, MultiModalFeatureSpec
from .sampling import SamplingParams


class RequestType(bytes, enum.Enum):
    """Mirrors `EngineCoreRequestType`: the first frame of every front-end → engine message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    """Mirrors `vllm.v1.engine.FinishReason` (an int on the wire)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error", "repetition")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Mirrors `vllm.v1.engine.EngineCoreRequest` (array-like; the first nine are required).

    Trailing fields after `data_parallel_rank` keep vLLM's order; only the ones we may set
    are spelled out (with those before them), everything after `reasoning_parser_kwargs` is left
    to the engine's defaults.
    """

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[MultiModalFeatureSpec] | None
    sampling_params: SamplingParams | None
    pooling_params: None
    arrival_time: float
    lora_request: None
    cache_salt: str | None
    data_parallel_rank: int | None
    prompt_embeds: None = None
    prompt_is_token_ids: None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: None = None
    resumable: bool = False
    external_req_id: None = None
    # Where an engine with a reasoning parser starts applying structured outputs: True from the first
    # token, False after the reasoning ends, None: the engine reads the prompt (vLLM's default).
    reasoning_ended: bool | None = None
    # What an engine with a reasoning parser builds the request's parser with: `{"chat_template_kwargs":
    # ...}` (Qwen3's `enable_thinking`), None without a reasoning parser.
    reasoning_parser_kwargs: dict[str, Any] | None = None


class EngineCoreEvent(msgspec.Struct):
    """Mirrors `EngineCoreEvent` (a map): QUEUED=1, SCHEDULED=2, PREEMPTED=3."""

    type: int
    timestamp: float


class WireArray(msgspec.Struct, array_like=True, gc=False):
    """A numpy array as vLLM's encoder writes it: `[dtype.str, shape, data]`. `data` is the raw
    bytes inline (msgpack ext 3), or the index of an out-of-band frame, which `OutputDecoder`
    replaces with that frame's bytes, so a decoded array is always self-contained."""

    dtype: str
    shape: list[int]
    data: Any

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Mirrors `vllm.v1.outputs.LogprobsLists` (a NamedTuple): the sample logprobs of one
    request's new tokens, one row per token: the sampled token first, then the top-k."""

    logprob_token_ids: WireArray  # [num_tokens, k + 1]
    logprobs: WireArray  # [num_tokens, k + 1], float32
    sampled_token_ranks: WireArray  # [num_tokens]
    cu_num_generated_tokens: list[int] | None = None


class OutputTensor(msgspec.Struct, array_like=True, gc=False):
    """A torch tensor in an engine output, as vLLM's encoder writes it (`MsgpackEncoder._encode_tensor`):
    `[torch dtype name, shape, data]`, data inline or the index of an out-of-band frame, which
    `OutputDecoder` resolves as for `WireArray`. (`WireTensor` is the sending side's.)"""

    dtype: str
    shape: list[int]
    data: Any

    def array(self) -> np.ndarray:
        numpy_dtype = NUMPY_DTYPE_BY_TORCH.get(self.dtype)
        if numpy_dtype is None:
            raise ValueError(f"the engine sent a tensor of dtype {self.dtype!r}, which this gateway does not read")
        return np.frombuffer(self.data, dtype=numpy_dtype).reshape(self.shape)


class LogprobsTensors(msgspec.Struct, array_like=True, gc=False):
    """Mirrors `vllm.v1.outputs.LogprobsTensors` (a NamedTuple): one chunk of a request's prompt
    logprobs, one row per prompt position from the second on: the prompt token first, then the top-k."""

    logprob_token_ids: OutputTensor  # [positions, k + 1], int64
    logprobs: OutputTensor  # [positions, k + 1], float32
    selected_token_ranks: OutputTensor  # [positions]: the prompt token's rank
    cu_num_generated_tokens: list[int] | None = None
    cu_num_generated_tokens_tensor: Any = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Mirrors `vllm.v1.engine.EngineCoreOutput`: the new tokens of one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs_tensors: LogprobsTensors | None = None
    pooling_output: Any = None
    finish_reason: FinishReason | None = None
    # Matched stop token id (int), or a stop string (str), or None (EOS / length).
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] | None = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    trace_headers: Any = None
    prefill_stats: Any = None
    routed_experts: Any = None
    num_nans_in_logits: int = 0
    # Non-empty: the engine lost these cached items; resend the request with their data.
    mm_cache_miss_hashes: list[str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """Mirrors `vllm.v1.engine.UtilityOutput`.

    `result` is vLLM's `UtilityResult`, written as `[type_info, value]` (type_info is None
    unless the engine allows pickle-typed results, which we never enable).
    """

    call_id: int
    failure_message: str | None = None
    result: Any = None

    @property
    def value(self) -> Any:
        if isinstance(self.result, (list, tuple)) and len(self.result) == 2:
            return self.result[1]
        return self.result


class SchedulerStats(msgspec.Struct):
    """Mirrors the fields we read of `vllm.v1.metrics.stats.SchedulerStats` (a map)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Mirrors `vllm.v1.engine.EngineCoreOutputs`: one message on the output socket."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None
    wave_complete: int | None = None
    start_wave: int | None = None
    weight_version: str | None = None


# The single frame an engine sends on its output socket before a fatal exit.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
