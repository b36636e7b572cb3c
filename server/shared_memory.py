"""Triton's system shared-memory extension: regions a client on the same host registers, so that a request's
tensors are read from, and its outputs written into, memory both processes see, and only the request's
header crosses the socket.

A region is a POSIX shared-memory object (a file in /dev/shm, never a path elsewhere), opened once at
registration with the server's own permissions and read and written with ``pread``/``pwrite``, not mapped: a
client may shrink (truncate) its object at any time, and a mapped page past the new end raises SIGBUS in
whatever thread touches it, which kills the process. ``pread`` past the end returns short instead, which is
refused as a truncated region. Inputs are therefore copied once into the server's own arrays, as they would
be out of a mapping (the batcher copies them into its padded run anyway).

Plain Python: the transports parse the protocol's messages and parameters, this module holds the regions.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass

import numpy as np

from .errors import ErrorKind, RequestError, invalid
from .tensors import array_from_bytes, byte_count, wire_bytes

SHM_DIR = "/dev/shm"
# POSIX shm_open names: one optional leading slash, then a file name in SHM_DIR (no further slash).
_KEY = re.compile(r"/?([A-Za-z0-9_.\-]{1,255})")
_NAME = re.compile(r"[A-Za-z0-9_.\-:]{1,128}")
PARAMETERS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
LARGEST = 2**63 - 1
READ_STEP = 1 << 30  # pread/pwrite move at most ~2 GiB a call on Linux


@dataclass(frozen=True)
class Placement:
    """Where a tensor lies: ``byte_size`` bytes at ``offset`` in the registered region ``region``."""

    region: str
    offset: int
    byte_size: int


def placement_of(parameters, where: str) -> Placement | None:
    """The tensor's shared-memory placement from its parameters, or None if it names no region (a region
    without a byte size, or a byte size without a region, is refused as Triton refuses it)."""
    region = parameters.get("shared_memory_region")
    size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if region is None and size is None:
        if "shared_memory_offset" in parameters:
            raise invalid(f"{where}: 'shared_memory_offset' without 'shared_memory_region' and its byte size")
        return None
    if region is None or size is None:
        given, missing = ("shared_memory_region", "shared_memory_byte_size")[:: 1 if size is None else -1]
        raise invalid(f"{where}: '{given}' without '{missing}'; shared memory needs both")
    if not isinstance(region, str) or not region:
        raise invalid(f"{where}: 'shared_memory_region' must be a region's name, got {region!r}")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or not 0 <= value <= LARGEST:
            raise invalid(f"{where}: '{key}' must be an integer from 0 to 2^63-1, got {value!r}")
    return Placement(region, offset, size)


def is_local_peer(peer: str) -> bool:
    """Whether a caller's address is this host's loopback or a Unix-domain socket. ``peer`` as gRPC gives it
    (``ipv4:127.0.0.1:5000``, ``ipv6:%5B::1%5D:5000``, ``unix:/path``) or as aiohttp does (``127.0.0.1``)."""
    peer = urllib.parse.unquote(peer)
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host.split("%")[0])  # an IPv6 zone ("%eth0") is no part of the address
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


class Region:
    """One registered region: an open descriptor on its object, and the window (offset, byte_size) in it the
    client registered. It stays open while requests use it, even once unregistered."""

    def __init__(self, name: str, key: str, fd: int, offset: int, byte_size: int):
        self.name, self.key, self.fd, self.offset, self.byte_size = name, key, fd, offset, byte_size
        self.users = 0
        self.unregistered = False

    @property
    def status(self) -> RegionStatus:
        return RegionStatus(self.name, self.key, self.offset, self.byte_size)

    def check(self, placement: Placement, where: str) -> None:
        """The tensor's window lies inside the registered one (no read or write past it, whatever the sum)."""
        end = placement.offset + placement.byte_size  # Python integers: no overflow
        if end > self.byte_size:
            raise invalid(
                f"{where}: shared memory offset {placement.offset} + byte size {placement.byte_size} = {end} runs past "
                f"the end of region '{self.name}' ({self.byte_size} bytes registered)"
            )

    def read(self, placement: Placement, where: str) -> np.ndarray:
        """The window's bytes, copied into a new array; refused if the object was truncated under it."""
        self.check(placement, where)
        out = np.empty(placement.byte_size, dtype=np.uint8)
        view, at = memoryview(out), self.offset + placement.offset
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done : done + READ_STEP]], at + done)
            if got == 0:
                raise self._truncated(where, at + placement.byte_size)
            done += got
        return out

    def write(self, placement: Placement, data: memoryview, where: str) -> None:
        """``data`` into the window (which must hold it); refused if the object was truncated under it."""
        self.check(placement, where)
        if len(data) > placement.byte_size:
            raise invalid(
                f"{where}: {len(data)} bytes to write, but its shared memory byte size is {placement.byte_size}"
            )
        at = self.offset + placement.offset
        # Checked first, since pwrite past the end would grow the object back instead of failing; a client
        # truncating between the check and the write gets its object regrown by at most this window.
        if os.fstat(self.fd).st_size < at + len(data):
            raise self._truncated(where, at + len(data))
        done = 0
        while done < len(data):
            done += os.pwritev(self.fd, [data[done : done + READ_STEP]], at + done)

    def _truncated(self, where: str, needed: int) -> RequestError:
        size = os.fstat(self.fd).st_size
        return invalid(
            f"{where}: shared memory region '{self.name}' (key '{self.key}') now holds {size} bytes, fewer than "
            f"the {needed} this tensor needs: the object was truncated after it was registered"
        )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HeldRegions:
    """The regions one request's tensors lie in, held open (even if unregistered meanwhile) until ``release``:
    its inputs are read from them and its outputs written into them."""

    def __init__(self, registry: SharedMemoryRegistry | None = None, regions: dict[str, Region] | None = None):
        self._registry, self._regions = registry, regions or {}

    def read_inputs(self, shared_inputs: dict, inputs: dict[str, np.ndarray]) -> None:
        """The inputs a request left in shared memory (name -> its SharedInput), read from their windows into
        ``inputs``."""
        for name, shared in shared_inputs.items():
            region = self._regions[shared.placement.region]
            raw = region.read(shared.placement, f"input '{name}'")
            where = f"shared memory region '{region.name}'"
            inputs[name] = array_from_bytes(name, shared.datatype, shared.shape, raw, where)

    def write(self, outputs: dict[str, np.ndarray], placed: dict[str, Placement]) -> None:
        """Each output in ``placed`` into its window."""
        for name, placement in placed.items():
            data = wire_bytes(np.ascontiguousarray(outputs[name]))
            self._regions[placement.region].write(placement, data, f"output '{name}'")

    def release(self) -> None:
        if self._registry is not None:
            self._registry.done(self._regions)
        self._registry, self._regions = None, {}


NOTHING_HELD = HeldRegions()


class SharedMemoryRegistry:
    """The registered regions of one server: register, status, unregister, and the regions a request uses
    (``use``/``done``), within ``max_regions`` regions and ``max_bytes`` registered bytes. ``allowed`` False:
    every call is refused, saying how to turn it on. Event loop only (reads and writes may run elsewhere: a
    region in use is never closed).

    A region belongs to the caller that registered it (``owner``: security.Callers' name for it): another caller
    neither lists it, nor uses it, nor unregisters it, and may register a region of the same name, its own. Where
    the server does not tell callers apart (no auth, one shared token) every caller is the same owner, "", as in
    Triton."""

    def __init__(self, allowed: bool, max_regions: int, max_bytes: int, shm_dir: str = SHM_DIR):
        self.allowed = allowed
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.shm_dir = shm_dir
        self._regions: dict[tuple[str, str], Region] = {}  # (owner, name) -> region

    def check_allowed(self, peer: str) -> None:
        """Refuse unless shared memory is on and ``peer`` (the caller's address, as is_local_peer reads it) is
        this host: a region is opened with the server's permissions, and only a caller here shares its memory."""
        if not self.allowed:
            raise RequestError(
                ErrorKind.FAILED_PRECONDITION,
                "client shared memory is off on this server; start it with --allow-client-shm true to register and "
                "use system shared-memory regions",
            )
        if not is_local_peer(peer):
            raise RequestError(
                ErrorKind.PERMISSION_DENIED,
                f"shared memory is only for clients on the server's own host, over loopback (127.0.0.1 or ::1); "
                f"this call came from {peer or 'an unknown address'}: send the tensors in the request instead",
            )

    def register(self, peer: str, owner: str, name: str, key: str, offset, byte_size) -> None:
        self.check_allowed(peer)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"shared memory region name {name!r}: expected 1 to 128 letters, digits or any of '_.-:'")
        if (owner, name) in self._regions:
            raise RequestError(
                ErrorKind.ALREADY_EXISTS,
                f"shared memory region '{name}' is already registered; unregister it first, or pick another name",
            )
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or not 0 <= value <= LARGEST:
                raise invalid(f"shared memory region '{name}': {what} {value!r}, expected an integer from 0 to 2^63-1")
        if byte_size == 0:
            raise invalid(f"shared memory region '{name}': byte_size 0, expected at least 1")
        if len(self._regions) >= self.max_regions:
            raise RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"shared memory region '{name}': {len(self._regions)} regions are registered, the limit "
                f"--client-shm-max-regions={self.max_regions}; unregister one first",
            )
        registered = sum(region.byte_size for region in self._regions.values())
        if registered + byte_size > self.max_bytes:
            raise RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"shared memory region '{name}': {byte_size} bytes more than the {registered} registered would pass "
                f"the limit --client-shm-max-bytes={self.max_bytes}",
            )
        fd = self._open(name, key)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(f"shared memory region '{name}': key '{key}' is not a shared-memory object")
            if offset + byte_size > info.st_size:
                raise invalid(
                    f"shared memory region '{name}': offset {offset} + byte_size {byte_size} = {offset + byte_size} "
                    f"runs past the end of key '{key}' ({info.st_size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        self._regions[owner, name] = Region(name, key, fd, offset, byte_size)

    def _open(self, name: str, key) -> int:
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None or match.group(1) in (".", ".."):
            raise invalid(
                f"shared memory region '{name}': key {key!r} is not a POSIX shared-memory name (one leading '/' at "
                "most, then letters, digits or '_.-'); regions are objects in /dev/shm, never other files"
            )
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            return os.open(os.path.join(self.shm_dir, match.group(1)), flags)
        except FileNotFoundError:
            raise invalid(f"shared memory region '{name}': no shared-memory object with key '{key}'") from None
        except OSError as error:  # EACCES, ELOOP (a link), ...
            raise invalid(
                f"shared memory region '{name}': cannot open key '{key}' for reading and writing with the server's "
                f"permissions: {error.strerror}"
            ) from None

    def registrations(self) -> list[tuple[str, str, str, int, int]]:
        """Every region registered: (owner, name, key, offset, byte_size), as ``register`` takes them."""
        return [(owner, r.name, r.key, r.offset, r.byte_size) for (owner, _), r in self._regions.items()]

    def status(self, peer: str, owner: str, name: str = "") -> list[RegionStatus]:
        """``owner``'s region ``name`` (NOT_FOUND if it has none so named), or every region of its if empty."""
        self.check_allowed(peer)
        if not name:
            return [region.status for (holder, _), region in self._regions.items() if holder == owner]
        if (owner, name) not in self._regions:
            raise RequestError(ErrorKind.NOT_FOUND, f"no shared memory region '{name}' is registered")
        return [self._regions[owner, name].status]

    def unregister(self, peer: str, owner: str, name: str = "") -> None:
        """Forget ``owner``'s region ``name`` (each of its regions if empty; a name not registered: nothing to do,
        as in Triton). One in use stays open until its requests are done."""
        self.check_allowed(peer)
        for each in [(owner, name)] if name else [key for key in self._regions if key[0] == owner]:
            region = self._regions.pop(each, None)
            if region is not None:
                region.unregistered = True
                if region.users == 0:
                    region.close()

    def use(self, peer: str, owner: str, placements: dict[str, Placement]) -> HeldRegions:
        """``owner``'s regions that ``placements`` (tensor description -> placement) name, each window checked,
        held open until released even if unregistered meanwhile; the whole set or nothing."""
        self.check_allowed(peer)
        regions = {}
        for where, placement in placements.items():
            region = self._regions.get((owner, placement.region))
            if region is None:
                raise invalid(f"{where}: unknown shared memory region '{placement.region}'; register it first")
            region.check(placement, where)
            regions[region.name] = region
        for region in regions.values():
            region.users += 1
        return HeldRegions(self, regions)

    def held_for(self, peer: str, owner: str, inputs: dict, outputs: dict[str, Placement]) -> HeldRegions:
        """The regions a request's tensors lie in (``inputs``: name -> its SharedInput; ``outputs``: name ->
        placement), held as ``use`` holds them, each input's window checked against its datatype and shape."""
        windows = {f"input '{name}'": shared.placement for name, shared in inputs.items()}
        windows.update({f"output '{name}'": placement for name, placement in outputs.items()})
        held = self.use(peer, owner, windows)
        for name, shared in inputs.items():
            expected = byte_count(name, shared.datatype, shared.shape)
            if shared.placement.byte_size != expected:
                held.release()
                raise invalid(
                    f"input '{name}': shared_memory_byte_size {shared.placement.byte_size}, expected {expected} "
                    f"({shared.datatype} {list(shared.shape)})"
                )
        return held

    def done(self, regions: dict[str, Region]) -> None:
        for region in regions.values():
            region.users -= 1
            if region.users == 0 and region.unregistered:
                region.close()

    def cuda_status(self, peer: str, name: str = "") -> list:
        """CUDA regions: none is ever registered (``cuda_refused``)."""
        self.check_allowed(peer)
        if name:
            raise RequestError(ErrorKind.NOT_FOUND, f"no CUDA shared memory region '{name}' is registered")
        return []

    def cuda_refused(self) -> RequestError:
        """What a CUDA shared-memory registration is answered."""
        return RequestError(
            ErrorKind.UNIMPLEMENTED,
            "CUDA shared memory is not offered by this server: opening another process's cudaIpc handle and binding "
            "it to ONNX Runtime is not built (it needs a GPU to be built and tested on); use system shared memory "
            "(--allow-client-shm true)",
        )

    def close(self) -> None:
        """The server stops: every region is closed (requests are over by then)."""
        for region in self._regions.values():
            region.close()
        self._regions.clear()
