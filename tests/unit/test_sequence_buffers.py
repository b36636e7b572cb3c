"""A sequence's key and value buffers (contract/steps.py): each step's rows written in place after the rows held,
a full buffer replaced by one an eighth larger; from MAPPED_FROM_BYTES pages of their own, so that the room past a
sequence's rows takes no memory until written there and a buffer let go leaves the process at once (the server's
heap keeps what it frees)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import gc
import math
import mmap

import numpy as np

from mhaserve.contract.steps import GROWTH, MAPPED_FROM_BYTES, MIN_ROOM, with_rows, zeroed

HEADS, D_K = 8, 64


def rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, HEADS, count, D_K), dtype=np.float32)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def residency(address: int, nbytes: int) -> bytes | None:
    """mincore of the pages from ``address``: a byte a page, its lowest bit set where the page is in memory; None
    where they are not mapped in this process (mincore fails with ENOMEM)."""
    pages = (ctypes.c_ubyte * -(-nbytes // mmap.PAGESIZE))()
    if _LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), pages) == 0:
        return bytes(pages)
    if ctypes.get_errno() != errno.ENOMEM:
        raise OSError(ctypes.get_errno(), "mincore")
    return None


def resident_mib(buffer: np.ndarray) -> float:
    """How much of a mapped buffer's own pages is in memory: this buffer's, whatever else the process allocates
    meanwhile."""
    pages = residency(buffer.__array_interface__["data"][0], buffer.nbytes)
    return sum(page & 1 for page in pages) * mmap.PAGESIZE / 2**20


def test_steps_are_written_in_place_and_a_full_buffer_grows_by_an_eighth():
    empty = np.zeros((1, HEADS, 0, D_K), np.float32)
    first = rows(3, seed=1)
    buffer = with_rows(empty, 0, first, own_rows=True)
    assert buffer is first  # a small first step's rows are its buffer, uncopied
    grown = with_rows(buffer, 3, rows(2, seed=2))
    assert grown.shape[2] == MIN_ROOM and np.array_equal(grown[:, :, :3], first)
    assert with_rows(grown, 5, rows(1, seed=3)) is grown  # room left: written in place
    full = with_rows(grown, 6, rows(MIN_ROOM - 6, seed=4))
    assert full is grown and with_rows(full, MIN_ROOM, rows(1)).shape[2] == math.ceil((MIN_ROOM + 1) * GROWTH)


def test_a_large_first_step_is_copied_into_pages_with_room():
    large = rows(MAPPED_FROM_BYTES // (HEADS * D_K * 4) + 1, seed=5)
    buffer = with_rows(np.zeros((1, HEADS, 0, D_K), np.float32), 0, large, own_rows=True)
    assert buffer is not large and buffer.shape[2] == math.ceil(large.shape[2] * GROWTH)
    assert np.array_equal(buffer[:, :, : large.shape[2]], large) and not buffer[:, :, large.shape[2] :].any()


def test_mapped_buffers_take_memory_only_where_written_and_give_it_back_when_let_go():
    buffers = [zeroed((1, HEADS, 2048, D_K), np.float32) for _ in range(16)]  # 4 MiB each
    assert sum(map(resident_mib, buffers)) == 0, "room nothing was written to took memory"
    for written in buffers:
        written[:, :, :1024] = 1.0  # half of every head's rows
    del written
    assert sum(map(resident_mib, buffers)) == 32  # 16 buffers x 8 heads x 1,024 rows x 64 x 4 bytes
    addresses = [buffer.__array_interface__["data"][0] for buffer in buffers]
    buffers.clear()
    gc.collect()
    assert all(residency(address, mmap.PAGESIZE) is None for address in addresses), (
        "buffers let go were kept by the process"
    )


def mapping_flags(address: int) -> set[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise LookupError(f"no mapping holds {address:#x}")


def test_mapped_buffers_ask_for_base_pages_so_that_huge_pages_by_default_take_no_room_either():
    buffer = zeroed((1, HEADS, 2048, D_K), np.float32)
    assert "nh" in mapping_flags(buffer.__array_interface__["data"][0])  # MADV_NOHUGEPAGE
