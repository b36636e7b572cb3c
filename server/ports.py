"""The ports a server will listen on, checked before anything slow (a first run's export, a model's load): a busy
one is said in one line, naming the address, what holds it where this machine tells (Linux's /proc), and the flag
that picks another."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from .config import ServerSettings


def planned_ports(settings: ServerSettings) -> list[tuple[str, str, int]]:
    """(flag, host, port) of each fixed port the settings ask for (0: any free port, -1: off)."""
    ports = [("--port", settings.host, settings.port), ("--http-port", settings.host, settings.http_port)]
    ports.append(("--metrics-port", settings.metrics_host, settings.metrics_port))
    return [(flag, host, port) for flag, host, port in ports if port > 0]


def address_problem(settings: ServerSettings) -> str | None:
    """One line for a --host or --metrics-host that no socket here can listen on: a name that does not resolve, or
    an address of another machine (the bind's failure would otherwise read as a busy port); None where both can."""
    hosts = [("--host", settings.host)] + [("--metrics-host", settings.metrics_host)] * (settings.metrics_port >= 0)
    for flag, host in hosts:
        try:
            found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as error:
            return f"{flag} {host}: no such address ({error.strerror})"
        # gRPC listens where it can ("localhost": ::1 or not); another machine's address, or a family this one lacks
        if all(_bind_error(*info) in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) for info in found):
            return f"{flag} {host}: not an address of this machine (0.0.0.0 listens on all of them)"
    return None


def _bind_error(family, kind, proto, _, address) -> int | None:
    """Why a socket here cannot be bound at ``address`` (an errno), as a server binds it; None where it can."""
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no clash
            probe.bind(address)
    except OSError as error:
        return error.errno
    return None


def busy_port_message(settings: ServerSettings) -> str | None:
    """One line naming every planned port that cannot be bound (all at once, not one per attempt), or None where
    all can."""
    if settings.reuse_port:  # asked to share the port with other mhaserve processes
        return None
    busy = [(flag, host, port) for flag, host, port in planned_ports(settings) if not _can_bind(host, port)]
    return bind_failure(*busy) if busy else None


def host_port(host: str, port: int) -> str:
    """ "host:port" as gRPC parses an address and as a user pastes it: an IPv6 literal in brackets ([::]:8001)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_failure(*busy: tuple[str, str, int]) -> str:
    """One line for the busy ports, each (flag, host, port): the addresses, what holds them, the flags."""
    held = [f" (held by {holder})" if (holder := _holder(port)) else "" for _, _, port in busy]
    flags = " and ".join(flag for flag, _, _ in busy)
    if len(busy) == 1:
        (_, host, port), (by,) = busy[0], held
        return f"{host_port(host, port)} is already in use{by}; stop that, or pick another port with {flags}"
    said = ", ".join(host_port(host, port) + by for (_, host, port), by in zip(busy, held, strict=True))
    return f"{said} are already in use; stop those, or pick other ports with {flags}"


def _can_bind(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return True  # an address that does not resolve is the bind's to report
    return _bind_error(*infos[0]) != errno.EADDRINUSE


def _holder(port: int) -> str | None:
    """The process listening on ``port``, as "name (pid N)", where /proc says; None elsewhere."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    return f"{name} (pid {pid})"
        except OSError:  # gone, or not ours to read
            continue
    return None
