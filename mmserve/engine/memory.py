"""Where a buffer lives: proof that a frame sent to the engine is the object-store memory
the preprocessor wrote (zero copy), read from /proc/self/maps (Linux)."""

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


def process_maps_mention(pid: int, needle: str) -> bool:
    """Whether process `pid` maps any file whose path contains `needle`."""
    with open(f"/proc/{pid}/maps") as maps:
        return any(needle in line for line in maps)


def resident_pages(pid: int, path_part: str, file_offset: int, nbytes: int) -> int | None:
    """How many pages lying wholly inside [file_offset, file_offset + nbytes) of the mapped file
    whose path contains `path_part` process `pid` has touched (present in its page tables).

    Partial pages at either end are skipped: they may hold a neighbouring object's bytes.
    None when the process does not map the file at all. Needs /proc/PID/pagemap (root).
    """
    page = 4096
    first_page, last_page = -(-file_offset // page), (file_offset + nbytes) // page - 1
    present = 0
    mapped = False
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or path_part not in fields[5]:
                continue
            mapped = True
            low, high = (int(x, 16) for x in fields[0].split("-"))
            map_offset = int(fields[2], 16)
            for file_page in range(first_page, last_page + 1):
                address = low + file_page * page - map_offset
                if not low <= address < high:
                    continue
                pagemap.seek(address // page * 8)
                entry = int.from_bytes(pagemap.read(8), "little")
                present += bool(entry >> 63 & 1)
    return present if mapped else None
