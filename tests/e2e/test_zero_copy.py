"""Pixels go from the preprocessor to the engine's socket with no copy but the object store's write.

Whichever way a request is sent, the engine client hands the engine's socket the very memory the
preprocessor wrote into Ray's object store: a read-only mapping of the store's shared-memory file at
the object's pages, which the preprocessor's process wrote and the ingress never touched.
"""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
from PIL import Image

from tests.support.page_tables import resident_file_pages, resident_pages
from mmserve.multimodal import load_image_family
from serve_app.config import BUILTIN_MODEL_DIR
from tests.conftest import deploy_app

pytestmark = pytest.mark.serve


def _png_uri(width: int, height: int) -> str:
    """A gradient: a few kB as PNG, so the request's own bytes never pass through the object store
    (the ingress's writes there, freed and reused for the pixels, would look like it touching them)."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    assert len(buf.getvalue()) < 50_000
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def zerocopy_app(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, "zerocopy", {"trace_wire_frames": 16})
    yield app
    serve.delete("zerocopy", _blocking=True)


@pytest.mark.parametrize("n", [1, 2], ids=["one-choice", "two-choices"])
def test_engine_client_sends_the_pages_the_preprocessor_wrote_and_ingress_never_maps_them(zerocopy_app, n):
    from ray import serve

    app = zerocopy_app
    app.openai().chat.completions.create(  # the ingress's link to the engine client is open
        model="mmserve-builtin", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
    )
    family = load_image_family(BUILTIN_MODEL_DIR)
    width, height = 640 + n, 480
    pids = {name: serve.get_deployment_handle(name, app_name="zerocopy").pid.remote().result(timeout_s=30)
            for name in ("Ingress", "Preprocessor")}
    # Pages of the store the ingress process touched before (a reused worker, other requests).
    touched_before = resident_file_pages(pids["Ingress"], "/dev/shm/plasma")
    resp = app.openai().chat.completions.create(
        model="mmserve-builtin",
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_uri(width, height)}}]}],
        max_tokens=8, n=n,
    )
    assert resp.choices[0].message.content
    rows = family.num_tokens(width, height) * 4

    engine_client = app.engine_handle()
    traces = engine_client.frame_traces.remote().result(timeout_s=30)
    pixel_frames = [t for t in traces if t.nbytes == rows * 1176]  # merge 2x2: four patches per token
    assert pixel_frames, traces
    trace = pixel_frames[-1]
    # ZMQ's frame is the array itself, not a copy of it, and the array is the object store's
    # read-only shared memory ...
    assert trace.frame_address == trace.array_address
    assert not trace.array_writeable
    assert "/dev/shm/plasma" in trace.mapping, trace
    # ... at the pages the preprocessor's process wrote ...
    assert resident_pages(pids["Preprocessor"], "/dev/shm/plasma", trace.mapping_offset, trace.nbytes)
    # ... which the engine client read (ZMQ sent them) ...
    engine_pid = engine_client.pid.remote().result(timeout_s=30)
    assert resident_pages(engine_pid, "/dev/shm/plasma", trace.mapping_offset, trace.nbytes)
    # ... while the ingress never touched a single page of them (Ray maps the store file in every
    # worker; pages never faulted in are absent from the ingress's page tables).
    assert resident_pages(pids["Ingress"], "/dev/shm/plasma", trace.mapping_offset, trace.nbytes, touched_before) in (None, 0)
