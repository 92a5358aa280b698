"""The pixel store of the preprocessing link: Ray's object store.

A preprocessor replica writes a request's large arrays there once (`put`: one `ray.put`, which makes
the replica the object's owner) and keeps the reference until the engine client has mapped them
(`mmserve/transit/preprocessing_server.py`); the engine client maps them where they lie (`get`: a
read-only view of the store's shared memory on one node, Ray's object transfer from another) and hands
that memory to the engine's socket.

The reference travels over the link, not inside a Ray call, so Ray cannot count the engine client as a
borrower: the object's life is the preprocessor's hold, ended explicitly. What is sent is what Ray
itself serializes for a reference (its id, its owner's address, the object's status), and it is read
back as Ray registers a reference it deserializes. Pickling the `ObjectRef` instead would pin the object
for the preprocessor's life (Ray's rule for references serialized out of band); the replicas run with
`RAY_allow_out_of_band_object_ref_serialization=0` (`OBJECT_REF_ENV`), so that any such pickling raises
instead of leaking.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from mmserve.transit.refusals import LinkLost

from .ray_errors import describe

# Environment of the replicas that hold pixel references: a reference pickled out of band raises.
OBJECT_REF_ENV = {"RAY_allow_out_of_band_object_ref_serialization": "0"}


class _Name(msgspec.Struct, frozen=True, array_like=True):
    """An object's name as Ray serializes a reference (`CoreWorker.serialize_object_ref`)."""

    object_id: bytes
    owner_address: bytes
    object_status: bytes


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Name).decode


class RayPixelStore:
    """`mmserve.transit.preprocessing_link.PixelStore` over Ray's object store (in a Ray worker)."""

    def put(self, arrays: list[np.ndarray]) -> tuple[bytes, Any]:
        import ray

        ref = ray.put(arrays)
        _, owner_address, object_status = ray._private.worker.global_worker.core_worker.serialize_object_ref(ref)
        return _encode(_Name(ref.binary(), owner_address, object_status)), ref

    async def get(self, name: bytes) -> list[np.ndarray]:
        import ray

        parts = _decode(name)
        # As Ray deserializes a reference: the reference first (a local count above 0), then its
        # owner registered, which tells the core worker where to ask for the object.
        ref = ray.ObjectRef(parts.object_id, parts.owner_address, "")
        ray._private.worker.global_worker.core_worker.deserialize_and_register_object_ref(
            ref.binary(), ray.ObjectRef.nil(), parts.owner_address, parts.object_status
        )
        try:
            return await ref
        except ray.exceptions.RayError as exc:  # freed (released, or held too long), or its owner died
            raise LinkLost(describe(exc)) from None
