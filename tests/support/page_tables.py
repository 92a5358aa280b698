"""Page-table reading for the zero-copy test: which pages of a mapped file another process touched."""

from __future__ import annotations


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
