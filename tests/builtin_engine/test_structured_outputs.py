"""The built-in engine's structured outputs: for every kind of constraint the gateway sends (vLLM's
`StructuredOutputsParams`), its answer stays within it and ends, for many prompts; without one,
nothing changes."""

from __future__ import annotations

import json
import re

import pytest

from mmserve.builtin_engine.fake_model import ModelInfo, new_generation
from mmserve.builtin_engine.scheduler import Scheduler
from mmserve.builtin_engine.settings import DEFAULT_MODEL_DIR, BuiltinEngineSettings
from mmserve.builtin_engine.wire_engine_side import ReceivedRequest, ReceivedSampling

MODEL = ModelInfo.load(DEFAULT_MODEL_DIR)
SETTINGS = BuiltinEngineSettings(handshake_address="tcp://127.0.0.1:1", max_model_len=4096, max_num_seqs=8, step_interval_ms=1.0,
                                  step_us_per_sequence=0.0, step_us_per_prefill_token=0.0)
EOS = MODEL.encode("<|im_end|>")[0]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "mood": {"enum": ["calm", "curious"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "mood"]}


def _answer(structured: dict | None, prompt: str, max_tokens: int = 400, ignore_eos: bool = False) -> tuple[str, str]:
    sampling = ReceivedSampling(temperature=0.0, max_tokens=max_tokens, eos_token_id=EOS, all_stop_token_ids={EOS},
                                ignore_eos=ignore_eos, structured_outputs=structured)
    scheduler = Scheduler(max_num_seqs=8, max_model_len=4096, kv_capacity_tokens=10**6)
    scheduler.add(new_generation(MODEL, SETTINGS, ReceivedRequest("r", MODEL.encode(prompt), [], sampling, 0.0), []))
    tokens, finish = [], None
    while finish is None:
        [output] = scheduler.finish_step(scheduler.begin_step()).by_client[0]
        tokens += output.new_token_ids
        finish = output.finish_reason
    if finish.name == "STOP":
        tokens = tokens[:-1]  # (the end of text)
    return MODEL.tokenizer.decode(tokens, skip_special_tokens=False), finish.name


def _person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) <= {"name", "age", "mood", "tags"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and value["mood"] in ("calm", "curious")
            and all(isinstance(t, str) for t in value.get("tags", [])))


CASES = [
    ("json schema", {"json": json.dumps(PERSON)}, _person),
    ("json schema, no whitespace", {"json": PERSON, "disable_any_whitespace": True}, lambda t: _person(t) and ", " not in t),
    ("json object", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ("regex", {"regex": r"[a-z]{3,8}@[a-z]+\.(com|org)"}, lambda t: re.fullmatch(r"[a-z]{3,8}@[a-z]+\.(com|org)", t)),
    ("regex of digits", {"regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ("choice, as the gateway sends it", {"grammar": 'root ::= "yes" | "no" | "a \\"quoted\\" one"'}, lambda t: t in ("yes", "no", 'a "quoted" one')),
    ("EBNF grammar", {"grammar": 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z]+'},
     lambda t: re.fullmatch(r"(hello|hi) [a-z]+", t)),
    ("Lark grammar", {"grammar": 'start: "count: " NUMBER ("," NUMBER)*\nNUMBER: /[0-9]+/'},
     lambda t: re.fullmatch(r"count: [0-9]+(,[0-9]+)*", t)),
]


@pytest.mark.parametrize(("name", "structured", "valid"), CASES, ids=[c[0] for c in CASES])
def test_every_answer_follows_its_constraint_and_ends(name, structured, valid):
    for prompt in ("Tell me about rivers.", "What is in the picture?", "A name, please", "x" * 50):
        text, finish = _answer(structured, prompt)
        assert finish == "STOP", (prompt, text)
        assert valid(text), (prompt, text)


def test_an_answer_cut_by_max_tokens_is_a_prefix_of_a_valid_one_and_ignore_eos_is_harmless():
    text, finish = _answer({"json": json.dumps(PERSON)}, "Tell me about rivers.", max_tokens=3)
    assert finish == "LENGTH" and text.startswith("{")
    text, finish = _answer({"regex": "[0-9]{3}"}, "Digits?", max_tokens=12, ignore_eos=True)
    assert finish == "LENGTH" and text.startswith(text[:3]) and text[:3].isdigit()


def test_without_a_constraint_the_answer_is_the_engines_usual_one():
    assert _answer(None, "Tell me about rivers.") == _answer(None, "Tell me about rivers.")
    text, _ = _answer(None, "Tell me about rivers.")
    assert not text.startswith("{")
