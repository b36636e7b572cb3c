"""A server's CPU as the load tests and benchmarks count it: its own, and its child processes' (worker processes,
live parity's check process, which a thread of the server's starts), those that ended included."""

from __future__ import annotations

import os
import subprocess
import sys

from mhaserve.loadtest.checked_load import process_cpu_seconds


def spin(seconds: float) -> str:
    """A child's code: spend ``seconds`` of CPU, and say so."""
    return f"import sys, time\nwhile time.process_time() < {seconds}: pass\nprint('spun', flush=True)\n"


SERVER = f"""
import subprocess, sys, threading
def start_from_a_thread():
    global alive
    alive = subprocess.Popen([sys.executable, "-c", {spin(0.3) + "sys.stdin.read()"!r}], stdout=subprocess.PIPE)
thread = threading.Thread(target=start_from_a_thread)
thread.start(); thread.join()
subprocess.run([sys.executable, "-c", {spin(0.4)!r}], check=True, capture_output=True)  # ended, reaped
alive.stdout.readline()
print("ready", flush=True)
sys.stdin.read()  # until the test closes it: then the child started from a thread, which shares it, ends too
"""


def test_a_process_cpu_counts_the_child_a_thread_started_and_the_child_that_ended():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n"
        # 0.4 s ended and 0.3 s alive, less what /proc's whole clock ticks leave out (up to a tick of user and one
        # of system time per process): without either child it would be 0.4 s and the parent's few hundredths
        ticks = 6 / os.sysconf("SC_CLK_TCK")
        assert process_cpu_seconds(server.pid) >= 0.7 - ticks
    finally:
        server.stdin.close()
        server.wait(10)
