"""The engine-client deployment's plain class, without Ray: it starts its built-in engine, serves into a caller's channel, reports, refuses past its limit."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import msgspec

from deployments.engine_client_server import EngineClientServer, EngineClientSettings
from mmserve.builtin_engine.settings import DEFAULT_MODEL_DIR
from mmserve.engine import EngineAddresses
from mmserve.engine.outputs import CallerChannel
from mmserve.multimodal import PixelMode, ProcessedImages, load_image_family, pixel_dtype_for
from mmserve.transit.refusals import Refusal
from mmserve.vision import decode_rgb
from mmserve.wire import EngineCoreRequest, SamplingParams
from tests.support.defaults import builtin_engine_options, engine_client_settings, image_limits
from tests.support.images import image_uri


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], None, SamplingParams(max_tokens=4, temperature=0.0), None, 0.0, None, None, None)


def _settings(max_model_len: int) -> EngineClientSettings:
    """An engine client that starts its own built-in engine."""
    return engine_client_settings(
        addresses=EngineAddresses("tcp://127.0.0.1:0"), handshake_timeout_s=120.0, engine_wait_timeout_s=120.0,
        builtin_engine=builtin_engine_options(model_dir=DEFAULT_MODEL_DIR, max_model_len=max_model_len),
    )


def test_serves_reports_and_refuses_past_its_in_flight_limit():
    async def run():
        settings = _settings(max_model_len=256)
        server = EngineClientServer(settings)
        await server.start()
        try:
            channel = CallerChannel()
            admission = await server.add(_request("a"), None, channel)
            outputs = []
            while not (outputs and outputs[-1].finished):
                taken, failures, _ = await asyncio.wait_for(channel.take(), 30)
                assert not failures
                outputs += taken
            tokens = [t for o in outputs for t in o.new_token_ids]
            info = await server.info()
            server.config = dataclasses.replace(settings, max_in_flight=0)
            refused = await server.add(_request("b"), None, channel)
            return admission, tokens, channel.request_ids, info, refused
        finally:
            await server.shutdown()

    admission, tokens, still_tracked, info, refused = asyncio.run(run())
    assert admission.refused is None and admission.accepted is None  # a text request: the prompt is unchanged
    assert len(tokens) == 4
    assert (info.state, info.builtin, info.max_model_len, info.requests_sent) == ("ready", True, 256, 1)
    assert info.builtin_pid is not None
    assert refused.refused is not None and refused.refused.kind == "overloaded"
    assert still_tracked == set()


def test_a_prompt_the_engine_guard_refuses_is_an_answer_not_an_exception():
    async def run():
        settings = _settings(max_model_len=8)
        server = EngineClientServer(settings)
        await server.start()
        try:
            too_long = EngineCoreRequest("c", list(range(1, 20)), None, SamplingParams(max_tokens=4), None, 0.0, None, None, None)
            return await server.add(too_long, None, CallerChannel()), server.client.num_in_flight
        finally:
            await server.shutdown()

    admission, in_flight = asyncio.run(run())
    assert admission.refused is not None and admission.refused.kind == "invalid"
    assert in_flight == 0


def test_the_preprocessors_refusals_are_the_requests_as_they_are():
    refusals = [
        Refusal("image", "image 2: not an image", "messages"),
        Refusal("image_too_large", "image 1: too many pixels", "messages"),
        Refusal("busy", "busy decoding other images", "messages", retry_after_s=1),
        Refusal("lost", "image preprocessing failed: lost twice; retry shortly", retry_after_s=1),
    ]

    async def run():
        server = EngineClientServer(_settings(max_model_len=64))
        await server.start()
        try:
            return [await server.add(_request(f"i{i}"), images, CallerChannel()) for i, images in enumerate(refusals)]
        finally:
            await server.shutdown()

    assert [admission.refused for admission in asyncio.run(run())] == refusals


def test_a_lost_node_fails_every_request_with_its_reason_and_stops_the_builtin_engine():
    async def run():
        server = EngineClientServer(_settings(max_model_len=4096))
        await server.start()
        try:
            channel = CallerChannel()
            long = EngineCoreRequest("long", [1, 2, 3], None, SamplingParams(max_tokens=3000, temperature=0.0), None, 0.0, None, None, None)
            await server.add(long, None, channel)
            await asyncio.wait_for(channel.take(), 30)  # generating
            builtin = server.builtin
            assert builtin is not None and builtin.is_alive()
            await server.node_lost("the engine's node left the Ray cluster")
            _, failures, _ = await asyncio.wait_for(channel.take(), 5)
            return failures, builtin.is_alive(), server.unrecoverable
        finally:
            await server.shutdown()

    failures, builtin_alive, unrecoverable = asyncio.run(run())
    assert failures == [("long", "the engine's node left the Ray cluster")]
    assert not builtin_alive
    assert unrecoverable == "the engine's node left the Ray cluster"


def _image_request(request_id: str, placeholder: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [1, 2, placeholder, 3], None, SamplingParams(max_tokens=4, temperature=0.0), None, 0.0, None, None, None
    )


def test_recalled_images_the_engine_does_not_hold_are_processed_anew_or_the_request_refused():
    """Images recalled without pixels (`RecentImages`) go by hash only only while the engine holds
    them: otherwise `reprocess` gets their pixels first; a refusal then is the request's answer."""
    family = load_image_family(DEFAULT_MODEL_DIR)
    processed = ProcessedImages(
        [family.process(decode_rgb(base64.b64decode(image_uri(64, 48, seed=5).split(",", 1)[1]), image_limits()), pixel_dtype_for(PixelMode.DEVICE_NORMALIZE, "bfloat16"))],
        family.placeholder_token_id, family.name,
    )  # fmt: skip
    recalled = msgspec.structs.replace(processed, images=[msgspec.structs.replace(processed.images[0], fields=[])])
    calls: list[str] = []

    def reprocess(answer):
        async def again():
            calls.append("reprocess")
            return answer

        return again

    async def run():
        server = EngineClientServer(_settings(max_model_len=4096))
        await server.start()
        try:
            pad = family.placeholder_token_id
            busy = Refusal("busy", "the image preprocessing queue is full; retry shortly", "messages", retry_after_s=1)
            refused = await server.add(_image_request("r1", pad), recalled, CallerChannel(), reprocess(busy))
            channel = CallerChannel()
            admitted = await server.add(_image_request("r2", pad), recalled, channel, reprocess(processed))
            sent_after_refill = (await server.info()).bytes_sent
            by_hash = await server.add(_image_request("r3", pad), recalled, channel, reprocess(processed))
            info = await server.info()
            return refused, admitted, by_hash, info, info.bytes_sent - sent_after_refill
        finally:
            await server.shutdown()

    refused, admitted, by_hash, info, by_hash_bytes = asyncio.run(run())
    assert refused.refused is not None and (refused.refused.kind, refused.refused.retry_after_s) == ("busy", 1)
    assert admitted.refused is None and by_hash.refused is None
    assert calls == ["reprocess", "reprocess"]  # r1 (refused), r2 (the engine held nothing); not r3
    assert info.mm_items_skipped == 1 and by_hash_bytes < 4096
