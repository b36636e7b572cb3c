"""System shared memory for a client on the server's host (Triton's shared-memory extension): the inputs are
written into one POSIX shared-memory object, the server writes the outputs into another, and only the request's
header crosses the socket. The server must run with ``--allow-client-shm true``.

    with Client(url) as client, client.shared_memory() as regions:
        result = client.infer(query, shared_memory=regions)

The objects are created on first use, grown (and registered again) when a request needs more, and unregistered
and removed by ``close``. One ``SharedMemoryRegions`` serves one request at a time.
"""

from __future__ import annotations

import itertools
import os
from multiprocessing import shared_memory

import numpy as np

from mhaserve.contract.datatypes import DATATYPES
from mhaserve.contract.signature import ATTN_TOP_K_INDICES, OUTPUT, SUMMARY_OUTPUT_NAMES

_COUNTER = itertools.count()


def output_bytes_at_most(name: str, batch: int, q_len: int, kv_len: int, d_model: int, num_heads: int) -> int:
    """The most bytes output ``name`` can take for this request, whatever the weights' shaping asks."""
    if name == OUTPUT:
        return 4 * batch * q_len * d_model
    if name in SUMMARY_OUTPUT_NAMES:  # one value per head and query row, the key's position an int64
        return 8 * batch * num_heads * q_len
    per_value = 8 if name == ATTN_TOP_K_INDICES else 4
    return per_value * batch * num_heads * q_len * kv_len


class SharedMemoryRegions:
    """Two shared-memory objects registered with the server, ``<name>-in`` and ``<name>-out``. ``register`` and
    ``unregister`` are the client's calls: (region name, key, byte size) and (region name)."""

    def __init__(self, register, unregister, name: str | None = None):
        self._register, self._unregister = register, unregister
        self.name = name or f"mhaserve-{os.getpid()}-{next(_COUNTER)}"
        self._objects: dict[str, shared_memory.SharedMemory] = {}
        self.windows: dict[str, tuple[int, int]] = {}  # the last request's output windows, by output

    def region(self, which: str, size: int) -> str:
        """The region ``which`` ("in" or "out"), holding at least ``size`` bytes (made, or grown, if needed)."""
        region = f"{self.name}-{which}"
        current = self._objects.get(which)
        if current is not None and current.size >= size:
            return region
        if current is not None:
            self._unregister(region)
            self._remove(which)
        size = max(size, 2 * current.size if current is not None else 0, 4096)
        key = f"{region}-{os.urandom(4).hex()}"
        # Python's resource tracker removes it if this process ends without close.
        self._objects[which] = made = shared_memory.SharedMemory(key, create=True, size=size)
        try:
            self._register(region, "/" + key, made.size)
        except BaseException:  # refused (a server without --allow-client-shm): the object is not left behind
            self._remove(which)
            raise
        return region

    def write_inputs(self, inputs: list[tuple[str, np.ndarray]]) -> tuple[str, list[tuple[str, np.ndarray, int]]]:
        """The inputs copied into the input region: its name, and each input with its offset."""
        region = self.region("in", sum(array.nbytes for _, array in inputs))
        buffer, placed, offset = self._objects["in"].buf, [], 0
        for name, array in inputs:
            buffer[offset : offset + array.nbytes] = memoryview(np.ascontiguousarray(array)).cast("B")
            placed.append((name, array, offset))
            offset += array.nbytes
        return region, placed

    def output_windows(self, sizes: dict[str, int]) -> tuple[str, dict[str, tuple[int, int]]]:
        """The output region's name, and a window (offset, byte size) in it for each output."""
        region = self.region("out", sum(sizes.values()))
        self.windows, offset = {}, 0
        for name, size in sizes.items():
            self.windows[name] = (offset, size)
            offset += size
        return region, self.windows

    def place_request(self, inputs, output_names, num_heads: int):
        """The inputs written into the input region and a window for each output: (input region, [(name, array,
        offset)], output region, {output: (offset, size)})."""
        batch, q_len, d_model = inputs[0][1].shape
        kv_len = dict(inputs).get("key", inputs[0][1]).shape[1]
        in_region, placed = self.write_inputs(inputs)
        sizes = {n: output_bytes_at_most(n, batch, q_len, kv_len, d_model, num_heads) for n in output_names}
        out_region, windows = self.output_windows(sizes)
        return in_region, placed, out_region, windows

    def read_outputs(self, described) -> dict[str, np.ndarray]:
        """The outputs the server wrote, from (name, datatype, shape) as its answer described them."""
        return {name: self.read_output(datatype, shape, self.windows[name][0]) for name, datatype, shape in described}

    def read_output(self, datatype: str, shape, offset: int) -> np.ndarray:
        """An output the server wrote, copied out of the region (the next request overwrites it)."""
        dtype = DATATYPES[datatype]
        count = int(np.prod(shape))
        return np.frombuffer(self._objects["out"].buf, dtype, count, offset).reshape(shape).copy()

    def _remove(self, which: str) -> None:
        made = self._objects.pop(which)
        made.close()
        try:
            made.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Every region unregistered and removed; the first unregistration that failed is raised after all are
        removed."""
        failed = None
        for which in list(self._objects):
            try:
                self._unregister(f"{self.name}-{which}")
            except Exception as error:
                failed = failed or error
            finally:
                self._remove(which)
        if failed is not None:
            raise failed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
