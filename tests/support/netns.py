"""Another host, made for a test: a network namespace joined to this one by a veth pair, so that a client run
in it reaches the server from an address that is not loopback (as a caller on another machine would)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class OtherHost:
    namespace: str
    server_address: str  # this side of the veth pair: where the other host reaches the server
    address: str  # the other host's own address

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *command], capture_output=True, text=True, timeout=timeout
        )


def why_no_namespace() -> str | None:
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2) here"
    return None


@contextlib.contextmanager
def other_host() -> Iterator[OtherHost]:
    """The namespace and its veth pair (10.231.<n>.1 here, .2 there), removed on leaving; RuntimeError saying
    why where they cannot be made (a container without the capability, say)."""
    suffix = os.getpid() % 250
    namespace, here, there = f"mhaserve-test-{os.getpid()}", f"mhs{os.getpid()}a"[:15], f"mhs{os.getpid()}b"[:15]
    server_address, address = f"10.231.{suffix}.1", f"10.231.{suffix}.2"
    steps = [
        ["ip", "netns", "add", namespace],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", namespace],
        ["ip", "addr", "add", f"{server_address}/24", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "netns", "exec", namespace, "ip", "addr", "add", f"{address}/24", "dev", there],
        ["ip", "netns", "exec", namespace, "ip", "link", "set", there, "up"],
        ["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")
        yield OtherHost(namespace, server_address, address)
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
