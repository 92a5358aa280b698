"""Diagnostics for operators (`trace_wire_frames`): where each zero-copy frame sent to the engine lived.

A trace shows that a frame is the memory the pixels arrived in, not a copy of it: the object-store
memory the preprocessor wrote, read from /proc/self/maps (Linux); `tests/e2e/test_zero_copy.py`
checks it.
"""

from __future__ import annotations

import numpy as np
import msgspec
import zmq


class FrameTrace(msgspec.Struct, frozen=True):
    array_address: int
    frame_address: int
    nbytes: int
    array_writeable: bool
    # The mapping holding the frame's memory, e.g. "/dev/shm/plasmaXXXX (deleted)" for Ray's
    # object store, "[heap]" or "" for anonymous memory.
    mapping: str
    mapping_offset: int

    @classmethod
    def of(cls, array: np.ndarray, frame: zmq.Frame) -> "FrameTrace":
        frame_address = np.frombuffer(frame.buffer, dtype=np.uint8).__array_interface__["data"][0]
        mapping, offset = locate(frame_address)
        return cls(
            array_address=array.__array_interface__["data"][0],
            frame_address=frame_address,
            nbytes=array.nbytes,
            array_writeable=bool(array.flags.writeable),
            mapping=mapping,
            mapping_offset=offset,
        )


def locate(address: int) -> tuple[str, int]:
    """(mapping path, offset of `address` within the mapped file) of this process."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= address < high:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return path, int(fields[2], 16) + (address - low)
    except OSError:
        pass
    return "", 0
