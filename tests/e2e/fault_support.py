"""Helpers shared by the fault tests: long streams that record how and when they ended."""

from __future__ import annotations

import threading
import time

import httpx
import openai

# Real vLLM engines for fault tests get a long context so a stream cannot finish on its own
# before the fault is injected (the tiny CPU model generates ~1000 tokens/s).
FAULT_ENGINE_MAX_MODEL_LEN = 4096
VLLM_LONG_STREAM_TOKENS = 4000


def open_streams(
    app, model: str, count: int, max_tokens: int = 900, leave: threading.Event | None = None
) -> tuple[list[threading.Thread], list[dict]]:
    """Start `count` streams; return once each has its first token. Each records how it ended; each
    leaves (closes its connection) at its next chunk once `leave` is set."""
    results = [dict() for _ in range(count)]
    started = threading.Barrier(count + 1)

    def run(result: dict) -> None:
        got_first = False
        try:
            stream = app.openai(timeout=120).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Tell me a long story."}], stream=True,
                max_tokens=max_tokens, extra_body={"ignore_eos": True},
            )
            for _ in stream:
                if not got_first:
                    got_first = True
                    started.wait(timeout=120)
                if leave is not None and leave.is_set():
                    stream.close()
                    result["outcome"] = "left"
                    break
            else:
                result["outcome"] = "completed"
        except openai.APIError as exc:
            result["outcome"] = "error"
            result["message"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion message
            result["outcome"] = f"exception {type(exc).__name__}: {exc}"
        result["ended_at"] = time.monotonic()
        if not got_first:
            started.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=180)
    except threading.BrokenBarrierError:
        for t in threads:
            t.join(timeout=30)
        raise AssertionError(f"not every stream got its first token: {results}") from None
    return threads, results


def assert_all_failed_fast(threads, results, fault_at: float, limit_s: float = 2.0) -> None:
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a stream hung after its engine failed"
    for r in results:
        assert r["outcome"] == "error", r
        assert r["ended_at"] - fault_at <= limit_s, f"stream ended {r['ended_at'] - fault_at:.2f} s after the fault: {r}"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll `predicate` until it returns something truthy; replicas come and go meanwhile."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - recorded for the failure message
            last = exc
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def write_big_jpegs(root, count: int = 4, side: int = 6000) -> None:
    """Large, distinct JPEGs (different bytes, different hashes) that take a while to preprocess."""
    import numpy as np
    from PIL import Image

    x = np.linspace(0, 255, side, dtype=np.float32)
    image = Image.fromarray(np.stack([np.add.outer(x, x) / 2, np.add.outer(x, -x) % 256, np.outer(x, x) % 256], -1).astype(np.uint8))
    for i in range(count):
        image.save(root / f"big{i}.jpg", format="JPEG", quality=80 + i)


# The tiny CPU model makes ≈1 000 tokens a second per stream: an engine asked for
# VLLM_LONG_STREAM_TOKENS tokens less than this long ago is still far from its last one.
ENGINE_SURELY_BUSY_S = 2.0


def open_streams_running_in_engine(app, model: str, count: int, max_tokens: int, attempts: int = 8):
    """Like `open_streams`, but returns only while the engine itself is surely still generating them.

    The gateway may lag behind a fast engine (on 2 cores it delivers fewer tokens per second
    than a tiny CPU model makes), so "every stream has its first token" does not mean the
    engine is still working on them: a fault injected after the engine finished would only
    interrupt a backlog. Nor does "the engine has work" when the streams have been running for
    seconds: it may finish them between that answer and the fault (seen once: both streams
    completed 36 ms after the kill). So the streams must also be young; streams that are not are
    left at once (the engine aborts them) and new ones opened.
    """
    for _ in range(attempts):
        sent_at = time.monotonic()
        leave = threading.Event()
        threads, results = open_streams(app, model, count, max_tokens=max_tokens, leave=leave)
        busy = app.engine_utility("has_work") and not any(results)
        if busy and time.monotonic() - sent_at < ENGINE_SURELY_BUSY_S:
            return threads, results
        leave.set()
        for t in threads:
            t.join(timeout=120)
        wait_for(lambda: app.engine_utility("has_work") is False, 30, "the engine let the streams go")
    raise AssertionError(f"the engine finished {count} streams of {max_tokens} tokens before a fault could be injected")


def short_chat(app, model: str, content: str = "still there?", max_tokens: int = 4):
    return app.openai(timeout=60).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens)


def wait_recovered(app, model: str, timeout_s: float) -> float:
    start = time.monotonic()

    def ok() -> bool:
        try:
            return short_chat(app, model).choices[0].finish_reason in ("stop", "length")
        except openai.APIError:
            return False

    wait_for(ok, timeout_s, "service recovered", interval_s=0.5)
    return time.monotonic() - start


def assert_nothing_in_flight(app, index: int = 0, within_s: float = 1.0) -> None:
    """Engine-side running requests back to 0 and the engine client's in-flight map empty."""
    wait_for(lambda: app.engine_utility("has_work", index=index) is False, within_s, "engine idle")
    info = app.engine_info(index)
    assert info.state == "ready", info
    assert info.num_in_flight == 0, info


def get_health(app) -> httpx.Response:
    return httpx.get(app.base_url + "/health", timeout=10)
