"""What the whole test session shares and takes long to make, made in a background thread as soon as
collection knows that a selected test needs it.

Started right after collection, the work below runs on one core while the first tests run on the
other, and is done, or nearly, when a test asks for it (tests/conftest.py orders the modules for
that), in this order:

- the tests' vLLM zygote (tests/support/vllm_zygote.py), which imports vLLM once (≈ 10 s) and forks
  every vLLM process of the session after it (≈ 4 s each to a healthy `vllm serve`);
- the tiny Qwen2-VL model (random weights, seed 0), alone: the shared processes need it;
- ``vllm serve`` on it (``reference_server``): vLLM's own server, whose answers mmserve must equal;
- ``vllm serve --headless`` on it (``app_engine``), which the session app ``vllm_app`` connects to.
  A headless engine waits at most 5 minutes for its front-end's handshake (vLLM's
  ``HANDSHAKE_TIMEOUT_MINS``, counted from its HELLO, seconds after its start); one started more than
  ``FRESH_ENGINE_S`` before the app deploys is replaced by a new one on the same port;
- the other tiny models the selected tests use (``tiny_models.TINY_MODELS``), in one process;
- the offline references the test modules declare in ``OFFLINE_REFERENCES`` (``OfflineReference``),
  one after another, each in a process of its own (``vllm_reference.run_offline_reference``).

``tests/conftest.py`` starts it (``pytest_collection_finish``), hands it out through fixtures and
stops the processes at the end of the session (``pytest_sessionfinish``), used or not.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vllm_engines import HeadlessVllmEngine, VllmApiServer, free_tcp_port
from .vllm_reference import ReferenceResult, run_offline_reference
from .vllm_zygote import shared_zygote

TINY_MODEL_NAME = "tiny-qwen2-vl"
MAX_MODEL_LEN = 1024
# Tool calls read by vLLM's Hermes parser (the tiny Qwen2-VL's template writes Hermes-style tools): the
# reference server's flags, and the session app's `tool_call_parser` / `enable_auto_tool_choice`.
TOOL_CALL_PARSER = "hermes"
REFERENCE_SERVER_TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", TOOL_CALL_PARSER)

# An engine this young still has more than a minute of its 5 to wait for the app's handshake.
FRESH_ENGINE_S = 200.0


@dataclass(eq=False)
class OfflineReference:
    """vLLM's offline answers a test module will ask for: ``run_offline_reference(<model dir>, cases,
    **options)`` on the tiny model named ``model`` (``tiny_models.TINY_MODELS``)."""

    model: str
    cases: list[dict]
    options: dict[str, Any] = field(default_factory=dict)


class SessionVllm:
    """Makes what is wanted in a background thread; every accessor waits for what it returns."""

    def __init__(self, root: Path, *, models: list[str], reference_server: bool, app_engine: bool,
                 offline_references: list[OfflineReference] = ()):
        self._root = root
        self._references: dict[int, tuple[OfflineReference, Future]] = {id(r): (r, Future()) for r in offline_references}
        needed = {TINY_MODEL_NAME} if reference_server or app_engine else set()
        models = sorted(set(models) | needed | {r.model for r in offline_references})
        self._models: dict[str, Future[Path]] = {name: Future() for name in models}
        self._foreseen = list(models)  # model_dir() builds any other itself
        self._server: VllmApiServer | None = None
        self._engine: HeadlessVllmEngine | None = None
        self._engine_started_at = 0.0
        self._lock = threading.Lock()
        self._stopped = False
        self._processes_started = threading.Event()
        self._thread = threading.Thread(
            target=self._start, args=(reference_server, app_engine), name="session-vllm", daemon=True
        )
        self._thread.start()

    def _start(self, reference_server: bool, app_engine: bool) -> None:
        if reference_server or app_engine or self._references:
            shared_zygote()  # its imports beside the first model's build
        first = [TINY_MODEL_NAME] if TINY_MODEL_NAME in self._foreseen else []
        later = [name for name in self._foreseen if name not in first]
        try:
            if self._build(first):
                with self._lock:
                    if not self._stopped and reference_server:
                        self._server = self._new_server(self._models[TINY_MODEL_NAME].result())
                    if not self._stopped and app_engine:
                        self._engine = self._new_engine(self._models[TINY_MODEL_NAME].result(), free_tcp_port())
        finally:
            self._processes_started.set()
        self._build(later)
        for reference, future in self._references.values():
            if self._stopped:
                future.cancel()
                continue
            try:
                future.set_result(self._compute(reference))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                future.set_exception(exc)

    def _compute(self, reference: OfflineReference) -> list[ReferenceResult]:
        return run_offline_reference(self._models[reference.model].result(), reference.cases, **reference.options)

    def _build(self, names: list[str]) -> bool:
        from .tiny_models import build_tiny_models

        if not names:
            return True
        try:
            built = build_tiny_models(self._root, names, seed=0)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for these models
            for name in names:
                self._models[name].set_exception(exc)
            return False
        for name in names:
            self._models[name].set_result(built[name])
        return True

    def _new_server(self, model_dir: Path) -> VllmApiServer:
        return VllmApiServer(
            model_dir, served_model_name=TINY_MODEL_NAME, max_model_len=MAX_MODEL_LEN,
            extra_args=REFERENCE_SERVER_TOOL_FLAGS, log_path=self._root / "reference_server.log",
        ).start()  # fmt: skip

    def _new_engine(self, model_dir: Path, port: int) -> HeadlessVllmEngine:
        self._engine_started_at = time.monotonic()
        return HeadlessVllmEngine(
            model_dir, port, max_model_len=MAX_MODEL_LEN, log_path=self._root / f"app_engine_{port}.log"
        ).start()

    def model_dir(self, name: str = TINY_MODEL_NAME) -> Path:
        with self._lock:
            future = self._models.get(name)
            unforeseen = future is None
            if unforeseen:
                future = self._models[name] = Future()
        if unforeseen:  # not foreseen at collection: built now, in the caller's thread
            self._build([name])
        return future.result(timeout=900)

    def offline_reference(self, reference: OfflineReference) -> list[ReferenceResult]:
        """Its answers: computed in the background if foreseen at collection, else now."""
        if id(reference) in self._references:
            return self._references[id(reference)][1].result(timeout=1800)
        self.model_dir(reference.model)
        return self._compute(reference)

    def reference_server(self) -> VllmApiServer:
        """`vllm serve` on the tiny Qwen2-VL, healthy."""
        model_dir = self.model_dir()
        self._processes_started.wait()
        with self._lock:
            if self._server is None:  # not foreseen at collection
                self._server = self._new_server(model_dir)
            server = self._server
        return server.wait_healthy(timeout=600)

    def app_engine(self) -> HeadlessVllmEngine:
        """The headless engine for the session app, surely still waiting for its handshake. Call it
        once, just before the app deploys."""
        model_dir = self.model_dir()
        self._processes_started.wait()
        with self._lock:
            if self._engine is None:
                self._engine = self._new_engine(model_dir, free_tcp_port())
            elif time.monotonic() - self._engine_started_at > FRESH_ENGINE_S or not self._engine.is_alive():
                # Started too long ago to be sure of its handshake: replace it.
                self._engine.stop()
                self._engine = self._new_engine(model_dir, self._engine.port)
            return self._engine

    def wait_started(self) -> None:
        """Until the models are built, the offline references computed and the shared processes booted
        (the app engine boots as far as its handshake only; the rest follows the app's)."""
        self._thread.join()
        if self._server is not None:
            self._server.wait_healthy(timeout=600)

    def stop(self) -> None:
        """Stop the processes and remove the models and logs."""
        with self._lock:
            self._stopped = True
            for process in (self._server, self._engine):
                if process is not None:
                    process.stop()
        shutil.rmtree(self._root, ignore_errors=True)
