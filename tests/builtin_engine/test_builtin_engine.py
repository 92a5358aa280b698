"""The built-in engine, driven by mmserve's own EngineClient over the real EngineCore wire.

Every engine is a real subprocess (`python -m mmserve.builtin_engine`), as in production.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from tokenizers import Tokenizer

from mmserve.builtin_engine import DEFAULT_MODEL_DIR, builtin_engine_command
from mmserve.engine import EngineAddresses, EngineClient, EngineDeadError, EngineError
from mmserve.engine.client import EngineState, _InFlight
from mmserve.engine.outputs import RequestStream
from mmserve.engine.transport import EngineTransport
from mmserve.wire import (
    BatchedField,
    EngineCoreRequest,
    FieldElem,
    FinishReason,
    FlatField,
    MultiModalFeatureSpec,
    PlaceholderRange,
    RequestEncoder,
    SamplingParams,
    WireTensor,
)

from tests.support.defaults import builtin_engine_argv, builtin_engine_settings, engine_client_config
from tests.support.engine_outputs import output_queue
from tests.support.fatal_builtin_engine import fatal_engine_command

MODEL_DIR = DEFAULT_MODEL_DIR
EOS = 1988  # <|im_end|>
EOS2 = 1986  # <|endoftext|>, generation_config's second eos
IMAGE = 1998  # <|image_pad|>
VISION_START, VISION_END = 1995, 1996
MAX_MODEL_LEN = 1024



# Port 0: the front-end's socket binds a port the kernel picks and reports it. A port found free
# first and bound later can be taken in between (Ray starting beside the suite did, once).
ANY_PORT = "tcp://127.0.0.1:0"


class Engine:
    """An engine subprocess plus the EngineClient it talks to."""

    def __init__(self, *, step_ms: float = 1.0, max_num_seqs: int = 256, env: dict | None = None, command=builtin_engine_command) -> None:
        self.client = EngineClient(
            engine_client_config(EngineAddresses(ANY_PORT), handshake_timeout_s=60, health_check_interval_s=0.5, health_check_timeout_s=10)
        )
        self.client.bind()
        self.handshake = self.client.handshake_address
        # A fixed step time: these tests count steps, not a GPU's.
        cmd = command(self.handshake, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, step_interval_ms=step_ms,
                      step_us_per_sequence=0.0, step_us_per_prefill_token=0.0)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})

    async def start(self) -> Engine:
        await self.client.start()
        return self

    async def stop(self) -> None:
        await self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
async def engine():
    eng = await Engine().start()
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


_ids = iter(range(1_000_000))


def make_request(prompt: list[int], *, mm=None, request_id: str | None = None, **sampling) -> EngineCoreRequest:
    sampling.setdefault("temperature", 0.0)
    ignore_eos = sampling.get("ignore_eos", False)
    params = SamplingParams(
        **sampling,
        _eos_token_id=None if ignore_eos else EOS,
        _all_stop_token_ids={EOS, EOS2, *(sampling.get("stop_token_ids") or [])},
    )
    return EngineCoreRequest(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=prompt,
        mm_features=mm,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


async def run(client: EngineClient, request: EngineCoreRequest):
    """All tokens of a request and its final output."""
    tokens: list[int] = []
    last = None
    async for batch in client.generate(request):
        for out in batch:
            tokens.extend(out.new_token_ids)
            last = out
    return tokens, last


def prompt_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- basics


async def test_handshake_and_ready_fields(engine):
    ready = engine.client.ready
    assert ready.vllm_version.startswith("0.32.")
    assert ready.max_model_len == MAX_MODEL_LEN
    assert ready.max_num_seqs == 256
    assert ready.dtype == "bfloat16"
    assert ready.block_size > 0 and ready.num_gpu_blocks > 0
    assert ready.instance_id.startswith("mmserve-builtin-")
    assert engine.client.state is EngineState.READY


async def test_greedy_is_deterministic_and_prompt_dependent(engine, tokenizer):
    p1 = prompt_of(tokenizer, "Tell me about the lighthouse by the harbor.")
    p2 = prompt_of(tokenizer, "What colour is the evening sky over the desert?")
    a, last_a = await run(engine.client, make_request(p1, max_tokens=200))
    b, _ = await run(engine.client, make_request(p1, max_tokens=200))
    c, _ = await run(engine.client, make_request(p2, max_tokens=200))
    assert a == b
    assert a != c
    assert last_a.finish_reason is FinishReason.STOP and last_a.stop_reason is None
    assert a[-1] == EOS and 8 <= len(a) - 1 <= 40
    text = tokenizer.decode(a[:-1])
    assert text and text[0].isupper()
    # Seeded sampling is reproducible; unseeded sampling is not keyed by the prompt alone.
    s1, _ = await run(engine.client, make_request(p1, max_tokens=200, temperature=0.8, seed=7))
    s2, _ = await run(engine.client, make_request(p1, max_tokens=200, temperature=0.8, seed=7))
    s3, _ = await run(engine.client, make_request(p1, max_tokens=200, temperature=0.8, seed=8))
    assert s1 == s2 and s1 != s3


async def test_max_tokens_gives_length(engine, tokenizer):
    tokens, last = await run(engine.client, make_request(prompt_of(tokenizer, "Count to five."), max_tokens=5))
    assert len(tokens) == 5 and EOS not in tokens
    assert last.finish_reason is FinishReason.LENGTH


async def test_max_model_len_gives_length(engine, tokenizer):
    prompt = [100] * (MAX_MODEL_LEN - 6)
    tokens, last = await run(engine.client, make_request(prompt, max_tokens=None, ignore_eos=True))
    assert len(tokens) == 6 and last.finish_reason is FinishReason.LENGTH
    # A prompt that does not fit never reaches the engine: the client's admission guard refuses it
    # (a real vLLM engine dies on such a request).
    from mmserve.engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="maximum context length"):
        await run(engine.client, make_request([100] * MAX_MODEL_LEN, max_tokens=4))


async def test_stop_token_ids(engine, tokenizer):
    prompt = prompt_of(tokenizer, "Name a mountain.")
    full, _ = await run(engine.client, make_request(prompt, max_tokens=200))
    stop_at = next(i for i in range(3, len(full) - 1) if full[i] not in full[:i])
    stop_id = full[stop_at]
    tokens, last = await run(engine.client, make_request(prompt, max_tokens=200, stop_token_ids=[stop_id]))
    assert tokens == full[: stop_at + 1]
    assert last.finish_reason is FinishReason.STOP and last.stop_reason == stop_id


async def test_min_tokens(engine, tokenizer):
    prompt = prompt_of(tokenizer, "Say something short.")
    natural, _ = await run(engine.client, make_request(prompt, max_tokens=500))
    n = len(natural) - 1
    tokens, last = await run(engine.client, make_request(prompt, max_tokens=500, min_tokens=n + 30))
    assert len(tokens) == n + 31 and tokens[-1] == EOS and last.finish_reason is FinishReason.STOP
    assert EOS not in tokens[:-1] and tokens[:n] == natural[:n]
    # Stop token ids are masked until min_tokens is reached.
    stop_id = natural[2]
    tokens, last = await run(
        engine.client, make_request(prompt, max_tokens=500, min_tokens=n + 30, stop_token_ids=[stop_id])
    )
    assert stop_id not in tokens[: n + 30]
    assert last.finish_reason is FinishReason.STOP


async def test_ignore_eos(engine, tokenizer):
    prompt = prompt_of(tokenizer, "Keep talking.")
    tokens, last = await run(engine.client, make_request(prompt, max_tokens=120, ignore_eos=True))
    assert len(tokens) == 120 and EOS not in tokens and last.finish_reason is FinishReason.LENGTH
    # The engine honours ignore_eos even if a front-end left _eos_token_id set.
    req = make_request(prompt, max_tokens=120, ignore_eos=True)
    req.sampling_params._eos_token_id = EOS
    tokens2, last2 = await run(engine.client, req)
    assert tokens2 == tokens and last2.finish_reason is FinishReason.LENGTH


async def test_64_concurrent_requests(engine, tokenizer):
    prompts = [prompt_of(tokenizer, f"Question number {i}: why is the sky blue?") for i in range(64)]
    results = await asyncio.gather(*(run(engine.client, make_request(p, max_tokens=30)) for p in prompts))
    assert all(last.finished for _, last in results)
    solo = await run(engine.client, make_request(prompts[17], max_tokens=30))
    assert results[17][0] == solo[0]
    assert len({tuple(t) for t, _ in results}) > 50
    assert engine.client.scheduler_stats is not None


async def test_abort_mid_stream_leaves_no_work(engine, tokenizer):
    prompt = prompt_of(tokenizer, "A very long story, please.")
    gen = engine.client.generate(make_request(prompt, max_tokens=None, ignore_eos=True))
    seen = 0
    async for batch in gen:
        seen += len(batch)
        if seen >= 3:
            break
    await gen.aclose()
    deadline = time.monotonic() + 2
    while await engine.client.call_utility("has_work", timeout_s=2):
        assert time.monotonic() < deadline, "the aborted request is still running"
        await asyncio.sleep(0.01)


async def test_utility_calls(engine):
    assert await engine.client.call_utility("is_sleeping", timeout_s=2) is False
    assert await engine.client.call_utility("has_work", timeout_s=2) is False
    assert await engine.client.call_utility("get_supported_tasks", timeout_s=2) == ["generate"]
    with pytest.raises(EngineError, match="no_such_method"):
        await engine.client.call_utility("no_such_method", timeout_s=2)


# ----------------------------------------------------------------------------- multimodal


def image_feature(pixels: np.ndarray, grid: tuple[int, int, int], offset: int, length: int, ident: str, *, data=True):
    items = None
    if data:
        items = {
            "pixel_values": FieldElem(WireTensor(pixels), FlatField([[(0, pixels.shape[0], None)]], dim=0)),
            "image_grid_thw": FieldElem(WireTensor(np.array(grid, dtype=np.int64)), BatchedField(keep_on_cpu=True)),
        }
    return MultiModalFeatureSpec(
        data=items, modality="image", identifier=ident,
        mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=ident,
    )


def image_prompt(tokenizer: Tokenizer, n_pad: int) -> tuple[list[int], int]:
    head = prompt_of(tokenizer, "Look at this: ")
    prompt = [*head, VISION_START, *[IMAGE] * n_pad, VISION_END, *prompt_of(tokenizer, " What is it?")]
    return prompt, len(head) + 1


async def test_multimodal_proof_line(engine, tokenizer):
    rng = np.random.default_rng(0)
    t, h, w = 1, 16, 20
    pixels = rng.integers(0, 256, size=(t * h * w, 3 * 2 * 14 * 14), dtype=np.uint8)
    n_pad = t * h * w // 4
    prompt, offset = image_prompt(tokenizer, n_pad)
    feature = image_feature(pixels, (t, h, w), offset, n_pad, "img-proof-1")
    tokens, last = await run(engine.client, make_request(prompt, mm=[feature], max_tokens=500))
    assert last.finish_reason is FinishReason.STOP
    text = tokenizer.decode(tokens[:-1])
    digest = hashlib.sha256(pixels.tobytes()).hexdigest()[:16]
    assert text.splitlines()[0] == f"[image 1: grid 1x16x20, 320 patches uint8, sha256 {digest}]"
    # Sent again by hash only (data None): the engine's item cache answers the same.
    cached = image_feature(pixels, (t, h, w), offset, n_pad, "img-proof-1", data=False)
    tokens2, _ = await run(engine.client, make_request(prompt, mm=[cached], max_tokens=500))
    assert tokens2 == tokens
    # An unknown item sent by hash only: ERROR with the miss reported, to be resent.
    unknown = image_feature(pixels, (t, h, w), offset, n_pad, "img-never-sent", data=False)
    tokens3, last3 = await run(engine.client, make_request(prompt, mm=[unknown], max_tokens=50))
    assert tokens3 == [] and last3.finish_reason is FinishReason.ERROR
    assert last3.mm_cache_miss_hashes == ["img-never-sent"]


async def test_multimodal_two_images_small_inline_tensor(engine, tokenizer):
    # 4 patches * 8 bytes = 32 bytes: travels inline (ext 3), not as an out-of-band frame.
    small = np.arange(32, dtype=np.uint8).reshape(4, 8)
    big = np.full((16, 1176), 7, dtype=np.uint8)
    head = prompt_of(tokenizer, "Compare ")
    prompt = [*head, VISION_START, IMAGE, VISION_END, VISION_START, *[IMAGE] * 4, VISION_END]
    f1 = image_feature(small, (1, 2, 2), len(head) + 1, 1, "img-small")
    f2 = image_feature(big, (1, 4, 4), len(head) + 4, 4, "img-big")
    tokens, last = await run(engine.client, make_request(prompt, mm=[f1, f2], max_tokens=500))
    lines = tokenizer.decode(tokens[:-1]).splitlines()
    assert lines[0] == f"[image 1: grid 1x2x2, 4 patches uint8, sha256 {hashlib.sha256(small.tobytes()).hexdigest()[:16]}]"
    assert lines[1] == f"[image 2: grid 1x4x4, 16 patches uint8, sha256 {hashlib.sha256(big.tobytes()).hexdigest()[:16]}]"


@pytest.mark.parametrize("case", ["out_of_bounds", "wrong_token", "grid_mismatch", "length_mismatch"])
async def test_inconsistent_multimodal_gives_error_and_engine_keeps_serving(engine, tokenizer, case):
    pixels = np.zeros((16, 1176), dtype=np.uint8)
    prompt, offset = image_prompt(tokenizer, 4)
    grid, length = (1, 4, 4), 4
    if case == "out_of_bounds":
        offset = len(prompt) - 2
    elif case == "wrong_token":
        offset -= 1
    elif case == "grid_mismatch":
        grid = (1, 4, 8)
    elif case == "length_mismatch":
        length = 3
    feature = image_feature(pixels, grid, offset, length, f"img-bad-{case}")
    if case == "grid_mismatch":
        # Family-specific consistency: only the engine knows; it answers ERROR and lives on.
        tokens, last = await run(engine.client, make_request(prompt, mm=[feature], max_tokens=20))
        assert tokens == [] and last.finish_reason is FinishReason.ERROR
    else:
        # Placeholder/feature inconsistencies never reach the engine: the client's guard refuses them.
        from mmserve.engine import InvalidRequestError

        with pytest.raises(InvalidRequestError):
            await run(engine.client, make_request(prompt, mm=[feature], max_tokens=20))
    tokens, last = await run(engine.client, make_request(prompt_of(tokenizer, "Still there?"), max_tokens=4))
    assert len(tokens) == 4 and last.finish_reason is FinishReason.LENGTH


# ----------------------------------------------------------------------------- robustness


async def test_garbage_on_input_socket_does_not_kill_it(engine, tokenizer):
    transport = engine.client._transport
    pickle_ext = msgspec.msgpack.encode(["rid-pickle", [1, 2], None, msgspec.msgpack.Ext(1, b"x"), None, 0.0, None, None, None])
    for frames in (
        [b"\x00", b"\xc1\xc1garbage"],  # undecodable ADD
        [b"\x00", msgspec.msgpack.encode({"not": "an array"})],
        [b"\x00", pickle_ext],  # pickle ext types are refused
        [b"\x00", msgspec.msgpack.encode(["rid-bad", "x", None, {}, None, 0.0, None, None, None])],
        [b"\x00", msgspec.msgpack.encode(["rid-oob", [1], [{"data": {"pixel_values": {"data": ["uint8", [9], 5], "field": ["flat", {}]}}, "modality": "image", "identifier": "i", "mm_position": {"offset": 0, "length": 1}}], {}, None, 0.0, None, None, None])],
        [b"\x01", b"\xff\xfe"],  # undecodable ABORT
        [b"\x01", msgspec.msgpack.encode([1, 2, 3])],
        [b"\x03", msgspec.msgpack.encode("not a utility call")],
        [b"\x09", b"unknown type"],
        [b"\x00"],  # no body
        [b"\x02", msgspec.msgpack.encode([1, 0])],  # START_DP_WAVE: ignored
    ):
        await transport.send(frames)
    assert await engine.client.call_utility("is_sleeping", timeout_s=2) is False
    tokens, last = await run(engine.client, make_request(prompt_of(tokenizer, "Alive?"), max_tokens=3))
    assert len(tokens) == 3
    assert engine.proc.poll() is None


async def test_sigterm_aborts_open_requests():
    eng = await Engine(step_ms=20).start()
    try:
        reqs = [make_request([10 + i, 11, 12], max_tokens=None, ignore_eos=True) for i in range(3)]
        finals: dict[str, FinishReason] = {}

        async def consume(req):
            async for batch in eng.client.generate(req):
                if batch[-1].finished:
                    finals[req.request_id] = batch[-1].finish_reason

        tasks = [asyncio.create_task(consume(r)) for r in reqs]
        await asyncio.sleep(0.2)
        eng.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert finals == {r.request_id: FinishReason.ABORT for r in reqs}
        assert await asyncio.to_thread(eng.proc.wait, 10) == 0
    finally:
        await eng.stop()


async def test_sigkill_is_noticed_quickly():
    eng = await Engine(step_ms=20).start()
    try:
        gen = eng.client.generate(make_request([1, 2, 3], max_tokens=None, ignore_eos=True))
        await gen.__anext__()
        eng.proc.kill()
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(2):
                async for _ in gen:
                    pass
        assert time.monotonic() - started < 2
        assert eng.client.state is EngineState.DEAD
    finally:
        await eng.stop()


async def test_fatal_error_sends_engine_core_dead():
    eng = await Engine(command=fatal_engine_command).start()
    try:
        gen = eng.client.generate(make_request([1, 2, 3], max_tokens=None, ignore_eos=True))
        await gen.__anext__()
        with pytest.raises(EngineError):
            await eng.client.call_utility("mmserve_test_fatal", timeout_s=5)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert "ENGINE_CORE_DEAD" in (eng.client.death_reason or "") or "connection lost" in (eng.client.death_reason or "")
        assert await asyncio.to_thread(eng.proc.wait, 10) == 1
    finally:
        await eng.stop()


async def test_the_production_engine_has_no_test_hook():
    eng = await Engine().start()
    try:
        with pytest.raises(EngineError, match="has no attribute 'mmserve_test_fatal'"):
            await eng.client.call_utility("mmserve_test_fatal", timeout_s=5)
        assert eng.client.state is EngineState.READY and eng.proc.poll() is None
    finally:
        await eng.stop()


async def test_fatal_error_frame_on_the_wire():
    transport = EngineTransport(EngineAddresses(ANY_PORT))
    handshake = transport.handshake_address
    proc = subprocess.Popen(builtin_engine_argv(handshake, command=fatal_engine_command))
    try:
        await transport.handshake(60)
        outputs = output_queue(transport)
        await transport.send(RequestEncoder().encode_utility(0, 1, "mmserve_test_fatal", []))
        async with asyncio.timeout(5):
            assert await outputs.get() == [b"ENGINE_CORE_DEAD"]
        assert await asyncio.to_thread(proc.wait, 10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        transport.close()


async def test_cli_rejects_bad_arguments():
    result = subprocess.run(builtin_engine_argv("ipc:///nope"), capture_output=True, text=True)
    assert result.returncode == 2 and "tcp://" in result.stderr
    # The sizes come from the application's config: the command line has no defaults of its own.
    result = subprocess.run([sys.executable, "-m", "mmserve.builtin_engine", "--handshake", "tcp://127.0.0.1:1"], capture_output=True, text=True)
    assert result.returncode == 2 and "--max-model-len, --max-num-seqs, --step-interval-ms" in result.stderr


# ----------------------------------------------------------------------------- vLLM's own codec


@pytest.fixture(scope="module")
def vllm_codec():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.sampling_params import SamplingParams as VSamplingParams
    from vllm.v1.engine import EngineCoreOutputs as VOutputs
    from vllm.v1.engine import EngineCoreReadyResponse, EngineCoreRequest as VRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return {
        "SamplingParams": VSamplingParams, "EngineCoreRequest": VRequest, "EngineCoreOutputs": VOutputs,
        "EngineCoreReadyResponse": EngineCoreReadyResponse, "MsgpackEncoder": MsgpackEncoder,
        "MsgpackDecoder": MsgpackDecoder,
    }


async def test_interop_with_vllm_codec(vllm_codec, tokenizer):
    """vLLM's MsgpackEncoder → built-in engine → vLLM's MsgpackDecoder(EngineCoreOutputs)."""
    v = vllm_codec
    transport = EngineTransport(EngineAddresses(ANY_PORT))
    handshake = transport.handshake_address
    proc = subprocess.Popen(builtin_engine_argv(handshake, max_model_len=MAX_MODEL_LEN, step_interval_ms=1))
    decoder = v["MsgpackDecoder"](v["EngineCoreOutputs"])
    try:
        await transport.handshake(60)
        received = output_queue(transport)
        prompt = prompt_of(tokenizer, "Interoperability check.")

        async def collect(frames, request_id):
            await transport.send(frames)
            tokens, final = [], None
            async with asyncio.timeout(10):
                while final is None:
                    outputs = decoder.decode(await received.get())
                    for out in outputs.outputs:
                        assert out.request_id == request_id
                        tokens += out.new_token_ids
                        if out.finish_reason is not None:
                            final = out
            assert outputs.scheduler_stats is not None  # vLLM's SchedulerStats dataclass
            return tokens, final

        sp = v["SamplingParams"](temperature=0.0, max_tokens=200)
        sp.update_from_generation_config({"eos_token_id": [EOS, EOS2]}, EOS)
        vreq = v["EngineCoreRequest"](
            request_id="vllm-1", prompt_token_ids=prompt, mm_features=None, sampling_params=sp,
            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
            data_parallel_rank=None,
        )
        vtokens, vfinal = await collect([b"\x00", *v["MsgpackEncoder"]().encode(vreq)], "vllm-1")
        assert vfinal.finish_reason.name == "STOP" and vtokens[-1] == EOS
        # The same request through mmserve's encoder gives the same tokens.
        ours = make_request(prompt, max_tokens=200, request_id="ours-1")
        otokens, _ = await collect(RequestEncoder().encode_add(ours), "ours-1")
        assert otokens == vtokens
        # max_tokens from vLLM's SamplingParams is honoured.
        sp2 = v["SamplingParams"](temperature=0.0, max_tokens=3)
        vreq2 = msgspec.structs.replace(vreq, request_id="vllm-2", sampling_params=sp2)
        t2, f2 = await collect([b"\x00", *v["MsgpackEncoder"]().encode(vreq2)], "vllm-2")
        assert len(t2) == 3 and f2.finish_reason.name == "LENGTH"
        # Utility results decode as vLLM's UtilityResult.
        await transport.send(RequestEncoder().encode_utility(0, 41, "get_supported_tasks", []))
        async with asyncio.timeout(5):
            outputs = decoder.decode(await received.get())
        assert outputs.utility_output.call_id == 41 and outputs.utility_output.result.result == ["generate"]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 10)
        transport.close()


async def test_interop_vllm_encoded_multimodal_request(vllm_codec, tokenizer):
    """A multimodal ADD written by vLLM's own MsgpackEncoder (torch tensors, is_embed mask)."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec as VFeature,
        MultiModalFieldConfig,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange as VRange,
    )

    v = vllm_codec
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(64, 1176), dtype=np.uint8)
    prompt, offset = image_prompt(tokenizer, 16)
    # vLLM-style mask: the vision start/end tokens are inside the range but take no embedding.
    offset -= 1
    is_embed = torch.tensor([False] + [True] * 16 + [False])
    item = MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(
            data=torch.from_numpy(pixels), field=MultiModalFieldConfig.flat("", [slice(0, 64)]).field
        ),
        "image_grid_thw": MultiModalFieldElem(
            data=torch.tensor([1, 8, 8], dtype=torch.int64),
            field=MultiModalFieldConfig.batched("", keep_on_cpu=True).field,
        ),
    })
    feature = VFeature(
        data=item, modality="image", identifier="vimg-1",
        mm_position=VRange(offset=offset, length=18, is_embed=is_embed), mm_hash="vimg-1",
    )
    sp = v["SamplingParams"](temperature=0.0, max_tokens=300)
    sp.update_from_generation_config({"eos_token_id": [EOS, EOS2]}, EOS)
    vreq = v["EngineCoreRequest"](
        request_id="vllm-mm", prompt_token_ids=prompt, mm_features=[feature], sampling_params=sp,
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )
    frames = v["MsgpackEncoder"]().encode(vreq)
    assert len(frames) == 2  # pixel_values out of band, the rest inline

    eng = await Engine().start()
    try:
        # Register a stream by hand: the frames come from vLLM's encoder, not EngineClient's.
        stream = RequestStream()
        eng.client._requests["vllm-mm"] = _InFlight(vreq, stream, None)  # never resent: only its sink is used
        await eng.client._transport.send([b"\x00", *frames])
        tokens, final = [], None
        async with asyncio.timeout(10):
            while final is None:
                out = await stream.queue.get()
                tokens += out.new_token_ids
                final = out if out.finished else None
        assert final.finish_reason is FinishReason.STOP
        digest = hashlib.sha256(pixels.tobytes()).hexdigest()[:16]
        assert tokenizer.decode(tokens).splitlines()[0] == f"[image 1: grid 1x8x8, 64 patches uint8, sha256 {digest}]"
    finally:
        await eng.stop()


def test_ready_response_decodes_as_vllm_struct(vllm_codec):
    from mmserve.builtin_engine import BuiltinEngine

    eng = BuiltinEngine(builtin_engine_settings("tcp://127.0.0.1:1"))
    try:
        payload = msgspec.msgpack.encode(eng._ready_response())
        ready = msgspec.msgpack.decode(payload, type=vllm_codec["EngineCoreReadyResponse"])
        assert ready.vllm_version.startswith("0.32.") and ready.max_model_len == 4096
    finally:
        eng._close()


def test_runtime_modules_do_not_import_vllm_torch_transformers():
    code = (
        "import sys, mmserve.builtin_engine, mmserve.builtin_engine.__main__, mmserve.builtin_engine.wire_engine_side;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('vllm','torch','transformers')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
