"""Pixels go from the preprocessor to the engine's socket with one write and no copy.

The preprocessor's return value is written once into Ray's object store. The engine client
must hand ZMQ that very memory (a read-only mapping of the object store's shared-memory
file), and the ingress, which passes the preprocessing response along unawaited, must never
map the object store at all.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.support.page_tables import resident_file_pages, resident_pages
from mmserve.multimodal import load_image_family
from serve_app.config import BUILTIN_MODEL_DIR
from tests.conftest import deploy_app

pytestmark = pytest.mark.serve


def _png_uri(width: int, height: int) -> str:
    """A gradient: a few kB as PNG, so the preprocessing request travels inline in its Ray call
    and the ingress writes nothing to the object store (its own writes there, freed and reused
    for the pixels, would look like the ingress touching them)."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    assert len(buf.getvalue()) < 50_000
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_engine_client_sends_object_store_memory_and_ingress_never_maps_it(serve_instance):
    from ray import serve

    app = deploy_app(serve_instance, "zerocopy", {"trace_wire_frames": 16})
    try:
        family = load_image_family(BUILTIN_MODEL_DIR)
        width, height = 640, 480
        rows = family.num_tokens(width, height) * 4  # merge 2x2: four patches per token
        ingress = serve.get_deployment_handle("Ingress", app_name="zerocopy")
        ingress_pid = ingress.pid.remote().result(timeout_s=30)
        # Pages of the store the ingress process touched before (a reused worker, other requests).
        touched_before = resident_file_pages(ingress_pid, "/dev/shm/plasma")
        resp = app.openai().chat.completions.create(
            model="mmserve-builtin",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_uri(width, height)}}]}],
            max_tokens=8,
        )
        assert resp.choices[0].message.content

        engine_client = app.engine_handle()
        traces = engine_client.frame_traces.remote().result(timeout_s=30)
        pixel_frames = [t for t in traces if t.nbytes == rows * 1176]
        assert pixel_frames, traces
        trace = pixel_frames[-1]
        # ZMQ's frame is the array itself, not a copy of it ...
        assert trace.frame_address == trace.array_address
        # ... and the array is the object store's read-only shared memory, as written by the preprocessor.
        assert "/dev/shm/plasma" in trace.mapping, trace
        assert not trace.array_writeable

        # The engine client did read those pages (ZMQ sent them) ...
        engine_pid = engine_client.pid.remote().result(timeout_s=30)
        assert resident_pages(engine_pid, "/dev/shm/plasma", trace.mapping_offset, trace.nbytes)
        # ... while the ingress, which handed the preprocessing response on, never touched a
        # single page of them (Ray maps the store file in every worker; pages never faulted in
        # are absent from the ingress's page tables).
        assert resident_pages(ingress_pid, "/dev/shm/plasma", trace.mapping_offset, trace.nbytes, touched_before) in (None, 0)
    finally:
        serve.delete("zerocopy", _blocking=True)
