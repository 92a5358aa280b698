"""Tests of the test tooling itself: the built-in model dir, the tiny weights, the offline vLLM
reference, and a headless vLLM engine driven by a minimal hand-written ZMQ front-end.

The last test doubles as executable documentation of the EngineCore protocol the gateway speaks:
handshake (HELLO -> init map -> ready response on the input socket -> READY), an ADD request, a
UTILITY call, and the outputs on the PULL socket.
"""

from __future__ import annotations

import base64
import filecmp
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

# `tests.support` is imported as a package from the repository root; plain `pytest` does not put the
# root on sys.path by itself (no `pythonpath` setting in pyproject.toml yet), so make sure it is.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.support.tiny_models import BUILTIN_MODEL_DIR, REPO, build_tiny_qwen2_vl
from tests.support.vllm_reference import run_offline_reference

MAKE_SCRIPT = REPO / "scripts" / "make_builtin_model.py"

# Fixed ids of the built-in tokenizer (scripts/make_builtin_model.py).
ENDOFTEXT, IM_START, IM_END = 1986, 1987, 1988
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 1995, 1996, 1998, 1999

GREEDY = {"temperature": 0.0, "max_tokens": 16}
TOKEN_PROMPTS = [
    [IM_START, 82, 88, 434, 68, 76, 198],
    [5, 6, 7, 8, 9, 10],
    [300, 301, 302],
    [1500, 20, 900, 13, 42, 42, 42, 7],
]


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), seed=0)


def _png_data_uri(w: int = 84, h: int = 56, seed: int = 0) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------------------------
# (a) model directory
# ---------------------------------------------------------------------------------------------
def test_builtin_model_dir_is_deterministic_and_committed_copy_current(tmp_path):
    for name in ("a", "b"):
        subprocess.run([sys.executable, str(MAKE_SCRIPT), str(tmp_path / name)], check=True)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", files, shallow=False)
    assert not mismatch and not errors
    # The committed copy must be what the script writes today.
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", BUILTIN_MODEL_DIR, files, shallow=False)
    assert not mismatch and not errors, f"re-run scripts/make_builtin_model.py: {mismatch} {errors}"
    assert sum((tmp_path / "a" / f).stat().st_size for f in files) < 1_000_000


def test_builtin_model_loads_in_transformers():
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    assert len(tok) == 2000
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END
    assert tok.pad_token_id == ENDOFTEXT
    for t, i in {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
                 "<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD, "<|im_start|>": IM_START}.items():
        assert tok.convert_tokens_to_ids(t) == i

    # The gateway tokenizes with the `tokenizers` library directly: it must agree with transformers
    # (whose Qwen2Tokenizer re-imposes its own normalizer/pre-tokenizer on tokenizer.json).
    raw = Tokenizer.from_file(str(BUILTIN_MODEL_DIR / "tokenizer.json"))
    for s in ["Hello world! What is in this image?", "你好，世界 😀 café naïve",
              "<|im_start|>user\nhi<|im_end|>\n", "  many   spaces\n\n\ttabs", "x² ≤ ∞ — “ok”"]:
        assert tok.encode(s, add_special_tokens=False) == raw.encode(s, add_special_tokens=False).ids
        assert raw.decode(raw.encode(s).ids, skip_special_tokens=False) == s

    proc = AutoProcessor.from_pretrained(BUILTIN_MODEL_DIR)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n"
    )
    # String content, system message present: no default system prompt.
    text2 = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=False, tokenize=False,
    )
    assert text2 == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"

    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.zeros((56, 84, 3), dtype=np.uint8))
    out = proc(text=[text], images=[img], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]  # 56x84 -> 4x6 patches of 14
    assert ids.count(IMAGE_PAD) == 1 * 4 * 6 // 4  # merge 2x2
    assert ids[ids.index(IMAGE_PAD) - 1] == VISION_START
    assert out["pixel_values"].shape == (24, 3 * 2 * 14 * 14)

    cfg = AutoConfig.from_pretrained(BUILTIN_MODEL_DIR)
    assert cfg.image_token_id == IMAGE_PAD and cfg.video_token_id == VIDEO_PAD
    assert cfg.vision_start_token_id == VISION_START
    assert cfg.text_config.vocab_size == 2000


def test_tiny_weights_deterministic(tmp_path, tiny_qwen2_vl):
    again = build_tiny_qwen2_vl(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_qwen2_vl / "model.safetensors").read_bytes()
    other = build_tiny_qwen2_vl(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_qwen2_vl / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# (b) offline reference
# ---------------------------------------------------------------------------------------------
REFERENCE_CASES = (
    [{"prompt_token_ids": p, "sampling": GREEDY} for p in TOKEN_PROMPTS]
    + [{"prompt_token_ids": TOKEN_PROMPTS[0], "sampling": GREEDY}]  # a repeat: must be identical
    + [
        {"messages": [{"role": "user", "content": "Hello there, how are you?"}], "sampling": GREEDY},
        {
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _png_data_uri()}},
                {"type": "text", "text": "Describe."},
            ]}],
            "sampling": GREEDY,
        },
    ]
)


@pytest.fixture(scope="session")
def reference(tiny_qwen2_vl):
    return run_offline_reference(tiny_qwen2_vl, REFERENCE_CASES)


@pytest.mark.real_engine
def test_offline_reference_greedy_deterministic_and_varied(reference):
    outs = [r.outputs[0] for r in reference]
    assert all(len(r.outputs) == 1 for r in reference)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
    assert reference[0].prompt_token_ids == TOKEN_PROMPTS[0]
    # Determinism: the repeated case (and the cache) give identical tokens and text.
    assert outs[len(TOKEN_PROMPTS)].token_ids == outs[0].token_ids
    assert outs[len(TOKEN_PROMPTS)].text == outs[0].text
    # Not degenerate: different prompts -> different continuations; not one repeated token.
    seqs = {tuple(o.token_ids) for o in outs}
    assert len(seqs) == len(outs) - 1
    for o in outs:
        assert len(set(o.token_ids)) > 3, o.token_ids
    # Chat: template rendered; the image expanded to grid 1x4x6 / 4 = 6 pads after <|vision_start|>.
    chat_text, chat_img = reference[-2], reference[-1]
    assert chat_text.prompt_token_ids[0] == IM_START and chat_text.prompt_token_ids[-1] == 198
    ids = chat_img.prompt_token_ids
    assert ids.count(IMAGE_PAD) == 6 and ids[ids.index(IMAGE_PAD) - 1] == VISION_START
    assert ids[ids.index(IMAGE_PAD) + 6] == VISION_END
    # The image changes the answer (the vision tower is not ignored).
    assert outs[-1].token_ids != outs[-2].token_ids


# ---------------------------------------------------------------------------------------------
# (c) headless engine + minimal ZMQ front-end
# ---------------------------------------------------------------------------------------------
class MiniFrontend:
    """The smallest front-end a headless EngineCore accepts (what the gateway must do)."""

    def __init__(self):
        import zmq

        from tests.support.vllm_engines import free_tcp_port

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.handshake_port = free_tcp_port()
        # 1. The handshake socket: a ROUTER the engine's DEALER connects to.
        self.handshake = self.ctx.socket(zmq.ROUTER)
        self.handshake.bind(f"tcp://127.0.0.1:{self.handshake_port}")
        # Request socket: ROUTER (the engine's input DEALER connects); output socket: PULL (the
        # engine's PUSH connects). Both bound by us, addresses handed over in the init message.
        self.input = self.ctx.socket(zmq.ROUTER)
        in_port = self.input.bind_to_random_port("tcp://127.0.0.1")
        self.output = self.ctx.socket(zmq.PULL)
        out_port = self.output.bind_to_random_port("tcp://127.0.0.1")
        self.input_address = f"tcp://127.0.0.1:{in_port}"
        self.output_address = f"tcp://127.0.0.1:{out_port}"
        self.engine_identity: bytes | None = None
        self.ready_response: dict | None = None

    def _recv(self, sock, timeout_s: float, what: str, engine):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(1000):
                return sock.recv_multipart()
            if engine is not None and not engine.is_alive():
                raise AssertionError(f"engine died waiting for {what}:\n{engine.log_tail()}")
        raise AssertionError(f"timeout waiting for {what}:\n{engine.log_tail() if engine else ''}")

    def handshake_with(self, engine, timeout_s: float = 300.0) -> dict:
        import msgspec

        # 2. HELLO from the engine: [identity, msgpack map].
        ident, body = self._recv(self.handshake, timeout_s, "HELLO", engine)
        hello = msgspec.msgpack.decode(body)
        assert hello == {"status": "HELLO", "local": False, "headless": True}, hello
        assert ident == (0).to_bytes(2, "little")  # DP rank 0, 2 bytes little-endian
        init = {
            "addresses": {
                "inputs": [self.input_address],
                "outputs": [self.output_address],
                "coordinator_input": None,
                "coordinator_output": None,
                "frontend_stats_publish_address": None,
            },
            "parallel_config": {},
        }
        self.handshake.send_multipart([ident, msgspec.msgpack.encode(init)])
        # 3. The engine loads the model, connects its input DEALER and sends the ready response
        #    first: that is what teaches our ROUTER the engine's routing identity.
        ident2, payload = self._recv(self.input, timeout_s, "ready response", engine)
        assert ident2 == ident
        self.engine_identity = ident2
        self.ready_response = msgspec.msgpack.decode(payload)
        # 4. READY on the handshake socket.
        ident3, body = self._recv(self.handshake, 60, "READY", engine)
        ready = msgspec.msgpack.decode(body)
        assert ident3 == ident and ready["status"] == "READY", ready
        return self.ready_response

    def send(self, type_byte: bytes, frames: list) -> None:
        self.input.send_multipart([self.engine_identity, type_byte, *frames], copy=False)

    def close(self):
        for s in (self.handshake, self.input, self.output):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def headless(tiny_qwen2_vl, tmp_path_factory):
    from tests.support.vllm_engines import HeadlessVllmEngine

    fe = MiniFrontend()
    eng = HeadlessVllmEngine(
        tiny_qwen2_vl, fe.handshake_port, log_path=tmp_path_factory.mktemp("logs") / "headless.log"
    )
    t0 = time.monotonic()
    eng.start()
    try:
        fe.handshake_with(eng)
        fe.ready_seconds = time.monotonic() - t0
        yield fe, eng
    finally:
        eng.stop()
        fe.close()


def _collect(fe, eng, request_ids: set[str], timeout_s: float = 120.0) -> dict[str, dict]:
    """Read EngineCoreOutputs until every request finished; accumulate tokens per request."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    decoder = MsgpackDecoder(EngineCoreOutputs)
    got = {rid: {"token_ids": [], "finish_reason": None, "stop_reason": None} for rid in request_ids}
    pending = set(request_ids)
    while pending:
        frames = fe._recv(fe.output, timeout_s, f"outputs of {pending}", eng)
        assert frames[0] != b"ENGINE_CORE_DEAD", eng.log_tail()
        outs = decoder.decode(frames)
        for o in outs.outputs:
            g = got[o.request_id]
            g["token_ids"] += list(o.new_token_ids)
            if o.finish_reason is not None:
                g["finish_reason"] = str(o.finish_reason)
                g["stop_reason"] = o.stop_reason
                pending.discard(o.request_id)
    return got


def _sampling_params(**kw):
    """SamplingParams as vLLM's own front-end completes them before they reach the engine."""
    from vllm import SamplingParams

    sp = SamplingParams(**kw)
    # The engine itself never reads generation_config.json or the tokenizer. The front-end sets:
    #   _eos_token_id         <- tokenizer eos (<|im_end|>): check_stop() ends on it (stop_reason None)
    #   stop_token_ids        += generation_config eos ids other than that (<|endoftext|>)
    #   _all_stop_token_ids   = all of them (used to mask stops while min_tokens is not reached)
    # This is SamplingParams.update_from_generation_config, called by vLLM's InputProcessor.
    sp.update_from_generation_config({"eos_token_id": [IM_END, ENDOFTEXT]}, IM_END)
    return sp


@pytest.mark.real_engine
def test_headless_engine_handshake_and_greedy_matches_reference(headless, reference):
    import msgspec
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackEncoder

    fe, eng = headless
    rr = fe.ready_response
    assert rr["max_model_len"] == 1024 and rr["dtype"] == "bfloat16", rr
    assert rr["num_gpu_blocks"] > 0 and rr["block_size"] > 0 and rr["vllm_version"], rr

    encoder = MsgpackEncoder()
    expected = {f"req-{i}": reference[i].outputs[0] for i in range(len(TOKEN_PROMPTS))}
    for i, prompt in enumerate(TOKEN_PROMPTS):
        req = EngineCoreRequest(
            request_id=f"req-{i}",
            prompt_token_ids=list(prompt),
            mm_features=None,
            sampling_params=_sampling_params(**GREEDY),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        # [identity, ADD (0x00), msgpack body, *out-of-band frames]
        fe.send(b"\x00", encoder.encode(req))
    got = _collect(fe, eng, set(expected))
    for rid, ref in expected.items():
        assert got[rid]["token_ids"] == ref.token_ids, (rid, got[rid], ref)
        assert got[rid]["finish_reason"] == "length" and got[rid]["stop_reason"] is None

    # A stop token id: the engine stops *after* emitting it (it is in token_ids) with
    # stop_reason = that id; greedy, so the prefix is the reference's.
    ref0 = reference[0].outputs[0].token_ids
    stop_tok = ref0[5]
    cut = ref0.index(stop_tok) + 1
    req = EngineCoreRequest("req-stop", list(TOKEN_PROMPTS[0]), None,
                            _sampling_params(**GREEDY, stop_token_ids=[stop_tok]), None,
                            time.time(), None, None, None)
    fe.send(b"\x00", encoder.encode(req))
    got = _collect(fe, eng, {"req-stop"})["req-stop"]
    assert got == {"token_ids": ref0[:cut], "finish_reason": "stop", "stop_reason": stop_tok}

    # UTILITY: [client_index, call_id, method, args] -> EngineCoreOutputs.utility_output.
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    # Stats-only EngineCoreOutputs (outputs=[], scheduler_stats set) keep arriving after requests
    # finish (vllm serve runs with log_stats on), so skip messages until the utility answer.
    fe.send(b"\x03", [msgspec.msgpack.encode([0, 7, "is_sleeping", []])])
    decoder = MsgpackDecoder(EngineCoreOutputs)
    deadline = time.monotonic() + 30
    while True:
        outs = decoder.decode(fe._recv(fe.output, 30, "utility output", eng))
        if outs.utility_output is not None or time.monotonic() > deadline:
            break
        assert not outs.outputs, outs
    assert outs.utility_output is not None and outs.utility_output.call_id == 7
    assert outs.utility_output.failure_message is None
    assert outs.utility_output.result is not None  # UtilityResult wrapping False
    print(f"headless READY after {fe.ready_seconds:.1f}s; ready response: {rr}")


# ---------------------------------------------------------------------------------------------
# Tiny LLaVA-1.5
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> Path:
    from tests.support.tiny_models import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"), seed=0)


def test_tiny_llava_builds_deterministically_and_loads(tmp_path, tiny_llava):
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers import AutoProcessor, AutoTokenizer

    from tests.support.tiny_models import LLAVA_IMAGE_TOKEN_ID, build_tiny_llava

    again = build_tiny_llava(tmp_path / "again", seed=0)
    for f in sorted(p.name for p in tiny_llava.iterdir()):
        assert (again / f).read_bytes() == (tiny_llava / f).read_bytes(), f

    tok = AutoTokenizer.from_pretrained(tiny_llava)
    raw = Tokenizer.from_file(str(tiny_llava / "tokenizer.json"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 1501)
    for s in ["Hello world!", "USER: <image>\nWhat is this? ASSISTANT:", "你好 😀 café", "  two  spaces"]:
        assert tok.encode(s) == raw.encode(s).ids  # both add <s>
        if "<image>" not in s:
            assert raw.decode(raw.encode(s).ids) == s
    # Llama-2 style: the Prepend("▁") normalizer runs on each segment between added tokens, so text
    # right after <image> gets a "▁" (a space) that decoding without special tokens shows.
    assert raw.decode(raw.encode("USER: <image>\nHi").ids) == "USER:  \nHi"

    proc = AutoProcessor.from_pretrained(tiny_llava)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "USER: <image>\nWhat is this? ASSISTANT:"
    out = proc(text=[text], images=[Image.fromarray(np.zeros((400, 500, 3), np.uint8))], return_tensors="np")
    ids = out["input_ids"][0].tolist()
    assert ids[0] == 1  # the HF processor adds <s>; vLLM's chat path does not (see below)
    assert ids.count(LLAVA_IMAGE_TOKEN_ID) == 576 and out["pixel_values"].shape == (1, 3, 336, 336)


@pytest.mark.real_engine
def test_tiny_llava_offline_reference(tiny_llava):
    from tests.support.tiny_models import LLAVA_IMAGE_TOKEN_ID

    def chat(uri):
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is this?"}]}],
            "sampling": GREEDY}

    cases = [
        {"prompt_token_ids": [1, 652, 811, 730, 708], "sampling": GREEDY},
        {"prompt_token_ids": [1, 300, 301, 302], "sampling": GREEDY},
        chat(_png_data_uri(336, 336, seed=0)),
        chat(_png_data_uri(336, 336, seed=1)),
    ]
    res = run_offline_reference(tiny_llava, cases)
    outs = [r.outputs[0].token_ids for r in res]
    assert len({tuple(o) for o in outs}) == len(outs)
    assert all(len(set(o)) > 3 for o in outs)
    ids = res[2].prompt_token_ids
    assert ids.count(LLAVA_IMAGE_TOKEN_ID) == 576
    assert ids[0] != 1  # vLLM's chat path: rendered template tokenized without <s>
