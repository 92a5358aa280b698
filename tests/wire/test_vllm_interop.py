"""Our wire code against vLLM 0.32's own serializers (vllm imported here, in tests only).

Every engine request the OpenAI layer builds for a range of requests is encoded by our codec
and decoded by vLLM's `MsgpackDecoder(EngineCoreRequest)`: the values must be the ones we
meant. Outputs encoded by vLLM's `MsgpackEncoder` — including fields appended by newer
versions — must decode with ours.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os

import msgspec
import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from mmserve.engine import admit  # noqa: E402
from mmserve.multimodal import ImageBatchRequest, attach_images, load_image_family  # noqa: E402
from mmserve.multimodal.preprocessor import ImagePreprocessor  # noqa: E402
from mmserve.transit.engine_link import EngineEvent  # noqa: E402
from mmserve.wire import EngineCoreOutput, FinishReason, OutputDecoder, RequestEncoder  # noqa: E402
from mmserve.transit.router import EngineLimits  # noqa: E402
from mmserve.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from mmserve.openai.serving import OpenAIServer  # noqa: E402
from serve_app.config import BUILTIN_MODEL_DIR, AppConfig  # noqa: E402
from serve_app.settings import serving_settings  # noqa: E402
from tests.support.defaults import fetch_policy, preprocessor_limits  # noqa: E402

# The reference implementation: installed by scripts/setup.sh; a missing vllm is a failure, not a skip.
import torch  # noqa: E402
import vllm.v1.engine as vllm_engine  # noqa: E402
import vllm.v1.serial_utils as serial  # noqa: E402

MAX_MODEL_LEN = 1024


def _png_uri(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class CapturingRouter:
    """Stands in for the engine clients: records each admitted engine request."""

    def __init__(self) -> None:
        self.requests = []
        self.preprocessor = ImagePreprocessor(load_image_family(BUILTIN_MODEL_DIR), fetch_policy(), preprocessor_limits(), cache_bytes=0)

    async def limits(self, wait: bool = True) -> EngineLimits:
        return EngineLimits(max_model_len=MAX_MODEL_LEN, engine_kind="vllm", dtype="bfloat16")

    def preprocess(self, request: ImageBatchRequest, group: str = "", choices: int = 1):
        return request

    async def generate(self, request, images=None):
        processed = await self.preprocessor.process(images) if images is not None else None
        if processed is not None:
            request = attach_images(request, processed)
        admitted = admit(request, MAX_MODEL_LEN)
        self.requests.append(admitted)
        yield EngineEvent(outputs=[EngineCoreOutput(admitted.request_id, [5], finish_reason=FinishReason.LENGTH)])


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
CHAT_BODIES = [
    {"messages": CHAT, "temperature": 0, "max_tokens": 12},
    {"messages": CHAT, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "max_tokens": 8},
    {"messages": CHAT, "stop": ["\n", "END"], "stop_token_ids": [7, 9], "include_stop_str_in_output": True},
    {"messages": CHAT, "n": 2, "seed": 11, "temperature": 1.0, "max_tokens": 4},
    {"messages": CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"17": -5.0}},
    {"messages": CHAT, "ignore_eos": True, "min_tokens": 3, "max_completion_tokens": 9},
    {"messages": CHAT, "response_format": {"type": "json_object"}},
    {"messages": CHAT, "structured_outputs": {"regex": "[a-z]+"}},
    {"messages": CHAT, "skip_special_tokens": False, "spaces_between_special_tokens": False},
    {"messages": CHAT, "include_reasoning": False},  # reasoning_ended: True, after fields left at their defaults
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": _png_uri(300, 200)}},
        {"type": "image_url", "image_url": {"url": _png_uri(84, 56)}}]}], "max_tokens": 5},
]


@pytest.fixture(scope="module")
def captured() -> list:
    router = CapturingRouter()
    server = OpenAIServer(serving_settings(AppConfig()), router)

    # With a reasoning parser the request also carries its `reasoning_parser_kwargs` (the field after
    # `reasoning_ended`) and keeps the special tokens (an engine-based parser's `adjust_request`).
    with_reasoning = OpenAIServer(serving_settings(AppConfig.model_validate({"reasoning_parser": "qwen3"})), router)

    async def run_all() -> None:
        for body in CHAT_BODIES:
            await server.chat(ChatCompletionRequest.model_validate(body))
        await server.completion(CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 4, "seed": 5}))
        body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False, "x": [1]}, "reasoning_effort": "low"}
        await with_reasoning.chat(ChatCompletionRequest.model_validate(body))

    asyncio.run(run_all())
    assert len(router.requests) == len(CHAT_BODIES) + 3  # n=2 fans out into two engine requests
    return router.requests


def _tensor_to_numpy(tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def test_every_request_decodes_with_vllms_decoder_to_the_same_values(captured):
    encoder = RequestEncoder()
    decoder = serial.MsgpackDecoder(vllm_engine.EngineCoreRequest)
    assert {ours.reasoning_ended for ours in captured} == {None, True}
    assert [ours.reasoning_parser_kwargs for ours in captured][-1] == {
        "chat_template_kwargs": {"enable_thinking": False, "x": [1], "add_generation_prompt": True,
                                 "continue_final_message": False, "reasoning_effort": "low"}}  # fmt: skip
    for ours in captured:
        frames = encoder.encode_add(ours)
        assert frames[0] == b"\x00"
        theirs = decoder.decode(frames[1:])
        assert theirs.request_id == ours.request_id
        assert theirs.prompt_token_ids == ours.prompt_token_ids
        assert theirs.arrival_time == ours.arrival_time
        assert theirs.data_parallel_rank is None and theirs.pooling_params is None and theirs.lora_request is None
        assert (theirs.client_index, theirs.current_wave, theirs.priority, theirs.resumable) == (ours.client_index, 0, 0, False)
        assert theirs.reasoning_ended == ours.reasoning_ended and theirs.external_req_id is None
        assert theirs.reasoning_parser_kwargs == ours.reasoning_parser_kwargs
        sp, mine = theirs.sampling_params, ours.sampling_params
        for field in msgspec.structs.fields(mine):
            value = getattr(mine, field.name)
            decoded = getattr(sp, field.name)
            if field.name == "stop_token_ids":
                assert decoded == (value or [])
            elif field.name == "stop":
                assert decoded == (value or [])
            elif field.name == "bad_words":
                assert decoded == (value or [])
            elif field.name == "_all_stop_token_ids":
                assert decoded == value | set(mine.stop_token_ids or [])
            elif field.name == "structured_outputs":
                assert (decoded is None) == (value is None)
                if value is not None:
                    for sub in msgspec.structs.fields(value):
                        assert getattr(decoded, sub.name) == getattr(value, sub.name), sub.name
            elif field.name in ("top_p", "top_k", "min_p") and mine.temperature < 1e-5:
                assert decoded == value  # greedy: normalised identically on both sides
            else:
                assert decoded == value, field.name
        if ours.mm_features is None:
            assert theirs.mm_features is None
            continue
        assert len(theirs.mm_features) == len(ours.mm_features)
        for spec, mine_spec in zip(theirs.mm_features, ours.mm_features):
            assert spec.modality == "image"
            assert spec.identifier == spec.mm_hash == mine_spec.mm_hash and len(spec.mm_hash) == 64
            assert (spec.mm_position.offset, spec.mm_position.length) == (mine_spec.mm_position.offset, mine_spec.mm_position.length)
            assert spec.mm_position.is_embed is None
            assert set(spec.data) == {"pixel_values", "image_grid_thw"}
            for key, elem in spec.data.items():
                mine_elem = mine_spec.data[key]
                assert np.array_equal(_tensor_to_numpy(elem.data), mine_elem.data.array)
                assert str(elem.data.dtype).removeprefix("torch.") == mine_elem.data.dtype
            assert type(spec.data["pixel_values"].field).__name__ == "MultiModalFlatField"
            assert spec.data["pixel_values"].field.slices == [[slice(0, spec.data["pixel_values"].data.shape[0], None)]]
            assert type(spec.data["image_grid_thw"].field).__name__ == "MultiModalBatchedField"
            assert spec.data["image_grid_thw"].field.keep_on_cpu is True


def test_large_tensors_travel_out_of_band_small_ones_inline(captured):
    image_request = next(r for r in captured if r.mm_features)
    frames = RequestEncoder().encode_add(image_request)
    pixel_arrays = [f.data["pixel_values"].data.array for f in image_request.mm_features]
    oob = frames[2:]
    assert len(oob) == len(pixel_arrays)
    for frame, array in zip(oob, pixel_arrays):
        assert frame is array  # the caller's array itself, not a copy
    assert len(frames[1]) < 4096  # the grid tensors (24 bytes) are inline in the body


def test_abort_and_utility_decode_with_vllm():
    encoder = RequestEncoder()
    generic = serial.MsgpackDecoder()
    abort = encoder.encode_abort(["a", "b"])
    assert abort[0] == b"\x01" and generic.decode(abort[1:]) == ["a", "b"]
    utility = encoder.encode_utility(0, 7, "is_sleeping", [])
    assert utility[0] == b"\x03" and generic.decode(utility[1:]) == [0, 7, "is_sleeping", []]


def _vllm_outputs():
    from vllm.v1.metrics.stats import SchedulerStats

    return vllm_engine.EngineCoreOutputs(
        engine_index=0,
        outputs=[
            vllm_engine.EngineCoreOutput("r1", [1, 2, 3]),
            vllm_engine.EngineCoreOutput("r2", [9], finish_reason=vllm_engine.FinishReason.STOP, stop_reason=9,
                                         events=[vllm_engine.EngineCoreEvent.new_event(vllm_engine.EngineCoreEventType.SCHEDULED)],
                                         num_nans_in_logits=0, mm_cache_miss_hashes=["h"]),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25),
        utility_output=vllm_engine.UtilityOutput(4, result=serial.UtilityResult(True)),
        finished_requests={"r2"},
    )


def _check(decoded) -> None:
    assert [o.request_id for o in decoded.outputs] == ["r1", "r2"]
    assert decoded.outputs[0].new_token_ids == [1, 2, 3] and decoded.outputs[0].finish_reason is None
    assert decoded.outputs[1].finish_reason is FinishReason.STOP and decoded.outputs[1].stop_reason == 9
    assert decoded.outputs[1].events[0].type == 2
    assert decoded.outputs[1].mm_cache_miss_hashes == ["h"]
    assert decoded.scheduler_stats.num_running_reqs == 2 and decoded.scheduler_stats.num_waiting_reqs == 1
    assert decoded.utility_output.call_id == 4 and decoded.utility_output.value is True
    assert decoded.finished_requests == ["r2"]


def test_outputs_encoded_by_vllm_decode_with_ours():
    frames = serial.MsgpackEncoder().encode(_vllm_outputs())
    _check(OutputDecoder().decode([bytes(f) for f in frames]))


def test_outputs_with_fields_appended_by_newer_vllm_still_decode():
    body = bytes(serial.MsgpackEncoder().encode(_vllm_outputs())[0])
    raw = msgspec.msgpack.decode(body)
    for output in raw[1]:
        # vLLM 0.32 writes all 18 EngineCoreOutput fields; 0.33 appends `error` as the 19th.
        assert len(output) == 18
        output.extend(["engine error text", {"future": 1}])
    raw.extend([None, "another future field"])
    _check(OutputDecoder().decode([msgspec.msgpack.encode(raw)]))


def test_pickle_ext_types_are_refused():
    # In pooling_output, a field the decoder does not type (any ext would be accepted there).
    bad = msgspec.msgpack.encode([0, [["r", [1], None, None, msgspec.msgpack.Ext(1, b"\x80\x04K\x01.")]]])
    with pytest.raises(ValueError, match="pickle"):
        OutputDecoder().decode([bad])


@pytest.mark.parametrize("top_k", [2, 40])  # 40: arrays of 256 bytes or more travel out of band
def test_sample_logprobs_encoded_by_vllm_decode_with_ours_inline_and_out_of_band(top_k):
    from vllm.v1.outputs import LogprobsLists

    rng = np.random.default_rng(top_k)
    ids = rng.integers(0, 150_000, (3, top_k + 1)).astype(np.int32)
    values = rng.standard_normal((3, top_k + 1)).astype(np.float32)
    ranks = np.array([1, 4, 2], dtype=np.int64)
    outputs = vllm_engine.EngineCoreOutputs(outputs=[vllm_engine.EngineCoreOutput(
        "r1", [1, 2, 3], new_logprobs=LogprobsLists(ids, values, ranks))])
    frames = serial.MsgpackEncoder().encode(outputs)
    assert (len(frames) > 1) == (ids.nbytes >= 256)
    decoded = OutputDecoder().decode([bytes(f) for f in frames]).outputs[0].new_logprobs
    assert np.array_equal(decoded.logprob_token_ids.array(), ids)
    assert np.array_equal(decoded.logprobs.array(), values)
    assert np.array_equal(decoded.sampled_token_ranks.array(), ranks)
    # Self-contained: it travels on to the ingress re-encoded, without the frames.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(decoded), type=type(decoded))
    assert np.array_equal(again.logprobs.array(), values)


@pytest.mark.parametrize("top_k", [1, 20])  # 20: tensors of 256 bytes or more travel out of band
def test_prompt_logprobs_encoded_by_vllm_decode_with_ours_inline_and_out_of_band(top_k):
    import torch
    from vllm.v1.outputs import LogprobsTensors

    rng = np.random.default_rng(top_k)
    ids = rng.integers(0, 150_000, (5, top_k + 1)).astype(np.int64)
    values = rng.standard_normal((5, top_k + 1)).astype(np.float32)
    ranks = np.array([1, 4, 2, 9, 3], dtype=np.int64)
    tensors = LogprobsTensors(torch.from_numpy(ids), torch.from_numpy(values), torch.from_numpy(ranks))
    outputs = vllm_engine.EngineCoreOutputs(outputs=[vllm_engine.EngineCoreOutput("r1", [], new_prompt_logprobs_tensors=tensors)])
    frames = serial.MsgpackEncoder().encode(outputs)
    assert (len(frames) > 1) == (ids.nbytes >= 256)
    decoded = OutputDecoder().decode([bytes(f) for f in frames]).outputs[0].new_prompt_logprobs_tensors
    assert decoded.logprob_token_ids.dtype == "int64" and decoded.logprobs.dtype == "float32"
    assert np.array_equal(decoded.logprob_token_ids.array(), ids)
    assert np.array_equal(decoded.logprobs.array(), values)
    assert np.array_equal(decoded.selected_token_ranks.array(), ranks)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(decoded), type=type(decoded))
    assert np.array_equal(again.logprobs.array(), values)
