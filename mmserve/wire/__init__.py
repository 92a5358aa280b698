"""vLLM EngineCore wire protocol (vLLM 0.32), mirrored with msgspec: no vllm or torch import."""

from .codec import EngineDeadMessage, OutputDecoder, RequestEncoder
from .engine_core import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    OutputTensor,
    RequestType,
    SchedulerStats,
    UtilityOutput,
    WireArray,
)
from .handshake import EngineStatusMessage, EngineZmqAddresses, HandshakeInit, ReadyResponse
from .multimodal import (
    BatchedField,
    FieldElem,
    FlatField,
    MultiModalFeatureSpec,
    PlaceholderRange,
    SharedField,
    WireTensor,
)
from .sampling import SamplingParams, StructuredOutputsParams

# vLLM versions whose wire format this package mirrors and is tested against.
SUPPORTED_VLLM_VERSIONS = ("0.32.",)

__all__ = [
    "ENGINE_CORE_DEAD", "SUPPORTED_VLLM_VERSIONS",
    "BatchedField", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest",
    "EngineDeadMessage", "EngineStatusMessage", "EngineZmqAddresses", "FieldElem", "FinishReason",
    "FlatField", "HandshakeInit", "LogprobsLists", "LogprobsTensors", "MultiModalFeatureSpec", "OutputDecoder", "OutputTensor", "PlaceholderRange",
    "ReadyResponse", "RequestEncoder", "RequestType", "SamplingParams", "SchedulerStats",
    "SharedField", "StructuredOutputsParams", "UtilityOutput", "WireArray", "WireTensor",
]
