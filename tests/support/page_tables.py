"""Page-table reading for the zero-copy test: which pages of a mapped file another process touched."""

from __future__ import annotations


PAGE = 4096


def resident_pages(pid: int, path_part: str, file_offset: int, nbytes: int, ignore: frozenset[int] = frozenset()) -> int | None:
    """How many pages lying wholly inside [file_offset, file_offset + nbytes) of the mapped file
    whose path contains `path_part` process `pid` has touched (present in its page tables),
    not counting the file pages in `ignore` (e.g. ones it had touched before, see `resident_file_pages`).

    Partial pages at either end are skipped: they may hold a neighbouring object's bytes.
    None when the process does not map the file at all. Needs /proc/PID/pagemap (root).
    """
    page = PAGE
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
                present += bool(entry >> 63 & 1) and file_page not in ignore
    return present if mapped else None


def resident_file_pages(pid: int, path_part: str) -> frozenset[int]:
    """Every page (as a page index into the file) of the mapped file whose path contains
    `path_part` that process `pid` has touched so far."""
    pages: set[int] = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or path_part not in fields[5]:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            map_offset = int(fields[2], 16)
            pagemap.seek(low // PAGE * 8)
            entries = pagemap.read((high - low) // PAGE * 8)
            for i in range(0, len(entries), 8):
                if entries[i + 7] & 0x80:  # bit 63: present
                    pages.add((map_offset // PAGE) + i // 8)
    return frozenset(pages)
