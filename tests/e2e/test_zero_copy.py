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


def _noise_png_uri(side: int) -> str:
    """Random pixels: a PNG about as large as its pixels (3 * side**2 bytes), base64 a third more."""
    pixels = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _objects_created() -> int:
    """Objects ever created in this node's object store (the raylet's own counter)."""
    import ray
    from ray._private.internal_api import node_stats

    [node] = [n for n in ray.nodes() if n["Alive"]]
    stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False).store_stats
    return stats.cumulative_created_objects


@pytest.mark.parametrize("side", [220, 330])  # data URIs of about 195 and 440 KB: two and five pieces
def test_a_data_uri_over_rays_inline_limit_goes_to_the_preprocessor_inside_the_call(zerocopy_app, side):
    """Ray puts a call argument over 100 KiB into the object store first (a put, a pin, a fetch, a
    free: ≈0.7 ms of the raylet's CPU per image request); the ingress's preprocessing handle cuts
    data URIs into pieces that go inside the call instead (deployments/inline_args.py). Each call's
    only object is then its pixels, which the preprocessor returns through the store, and they are
    the pixels of the whole image. (Called here as the ingress calls it: through the suite's Python
    proxy, a request's HTTP body would be one more object.)"""
    from ray import serve

    from deployments.preprocessor_calls import HandlePreprocessing
    from mmserve.multimodal import ImageBatchRequest, ProcessedImages
    from mmserve.multimodal.types import PixelMode

    handle = serve.get_deployment_handle("Preprocessor", app_name="zerocopy")
    preprocessing = HandlePreprocessing(handle)
    calls = 4
    for i in range(calls):
        uri = _noise_png_uri(side + i)  # distinct: not the preprocessor's cache, pixels made every time
        assert 150_000 < len(uri) < 1_000_000
        request = ImageBatchRequest(urls=[uri], pixel_mode=PixelMode.HOST_NORMALIZE, engine_dtype="bfloat16")
        # The counter is the node's: other applications of the suite's shared Ray instance may add an
        # object of their own meanwhile, so a call gets three tries to show its count alone. Sent whole,
        # every try shows two (the URI and the pixels).
        created = []
        for _ in range(3):
            objects_before = _objects_created()
            cut = preprocessing.process(request).result(timeout_s=60)
            created.append(_objects_created() - objects_before)
            if created[-1] == 1:  # the pixels
                break
        assert created[-1] == 1, created
        assert isinstance(cut, ProcessedImages), cut
        whole = handle.process.remote(request).result(timeout_s=60)  # the URI as one argument
        assert [image.mm_hash for image in cut.images] == [image.mm_hash for image in whole.images]
        assert all(np.array_equal(a.array, b.array) for a, b in zip(cut.images[0].fields, whole.images[0].fields))
