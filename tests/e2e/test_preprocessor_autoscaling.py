"""Under a burst of image requests the preprocessing tier scales out and back in on its own,
while the ingress and the engine clients keep their replica counts."""

from __future__ import annotations

import base64
import io
import itertools
import threading
import time

import numpy as np
import pytest
from PIL import Image

from tests.conftest import deploy_app

pytestmark = pytest.mark.serve


def _distinct_jpeg_uri(base: np.ndarray, serial: int) -> str:
    """A JPEG of `base` with `serial` written into its corner: every request's images are new to the
    engine client, which would otherwise recall repeated ones without asking the preprocessor
    (`RecentImages`), and the burst would end after its first round."""
    pixels = base.copy()
    pixels[:8, :8, :] = np.frombuffer(serial.to_bytes(3, "little"), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _replicas(app_name: str) -> dict[str, int]:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    status = serve.status().applications[app_name]
    return {
        name: sum(count for state, count in d.replica_states.items() if state == ReplicaState.RUNNING)
        for name, d in status.deployments.items()
    }


def test_preprocessor_scales_out_and_back_alone(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, "autoscale", {
        "preprocessor": {"num_cpus": 0.1, "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1,
                         "upscale_delay_s": 1, "downscale_delay_s": 4, "look_back_period_s": 2, "max_ongoing_requests": 2},
    })
    try:
        assert _replicas("autoscale") == {"Ingress": 1, "EngineClient0": 1, "Preprocessor": 1}
        base = np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
        serials = itertools.count()
        stop = threading.Event()
        errors: list[BaseException] = []

        def client_loop() -> None:
            client = app.openai(timeout=120)
            while not stop.is_set():
                try:
                    client.chat.completions.create(
                        model="mmserve-builtin", max_tokens=2,
                        messages=[{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": _distinct_jpeg_uri(base, next(serials))}}
                            for _ in range(3)]}],
                    )
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        peak: dict[str, int] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            counts = _replicas("autoscale")
            for name, count in counts.items():
                peak[name] = max(peak.get(name, 0), count)
            if peak.get("Preprocessor", 0) >= 2:
                break
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:3]
        assert peak["Preprocessor"] >= 2, f"preprocessor never scaled out: {peak}"
        assert peak["Ingress"] == 1 and peak["EngineClient0"] == 1

        deadline = time.monotonic() + 90
        while _replicas("autoscale")["Preprocessor"] > 1:
            assert time.monotonic() < deadline, "preprocessor did not scale back in after the burst"
            time.sleep(1)
        assert _replicas("autoscale") == {"Ingress": 1, "EngineClient0": 1, "Preprocessor": 1}
    finally:
        serve.delete("autoscale", _blocking=True)
