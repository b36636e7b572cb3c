"""What this machine's CPU offers that int8 speed depends on, read from its flags (Linux's /proc/cpuinfo).

ONNX Runtime multiplies int8 matrices with 8-bit dot-product instructions where the CPU has them (AVX-512 VNNI,
AVX-VNNI or AMX on x86, the dot-product extension on Arm). Without them it sums pairs of 8-bit products in 16 bits
(x86 AVX2), which saturates with full 8-bit weights and may be no faster than float32 (BENCHMARKS.md, "int8").
"""

from __future__ import annotations

from pathlib import Path

INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags, or None where they cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return flags


def int8_warning(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """A one-line warning where this CPU lacks 8-bit dot-product instructions (or they cannot be read), else None."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return "int8: cannot read this CPU's flags to check for 8-bit dot-product instructions (VNNI)"
    if flags.isdisjoint(INT8_DOT_PRODUCT_FLAGS):
        return (
            "int8: this CPU has no 8-bit dot-product instructions (VNNI); int8 products may be slower than float32 "
            "here, and int8 weights saturate"
        )
    return None
