"""What this machine's CPU offers that int8 depends on, read from its flags (Linux's /proc/cpuinfo).

ONNX Runtime multiplies uint8 inputs by int8 weights with 8-bit dot-product instructions where the CPU has them
(AVX-512 VNNI, AVX-VNNI or AMX on x86, the dot-product extension on Arm). An x86 CPU without them gets AVX2's
``vpmaddubsw``, which sums pairs of products in 16 bits and saturates with full 8-bit weights: measured on such a
CPU, an output was 0.3 of its magnitude off (BENCHMARKS.md, "Precision"). So int8 is refused there, not
served wrong. Arm without the dot-product extension widens before it adds: only slower.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def first_processor(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str] | None:
    """The fields the kernel gives for the first processor (the others of a machine are of its kind), or None where
    they cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags, or None where they cannot be read (not Linux)."""
    fields = first_processor(cpuinfo)
    return None if fields is None else _flags(fields)


def _flags(fields: dict[str, str]) -> set[str]:
    return set(fields.get("flags", fields.get("Features", "")).split())  # x86, Arm


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name as the kernel reports it (x86's "model name"), else the machine's architecture."""
    fields = first_processor(cpuinfo) or {}
    names = [fields[name] for name in ("model name", "Model name", "cpu model") if fields.get(name)]
    return names[0] if names else platform.machine() or "unknown"


@dataclass(frozen=True)
class Int8Support:
    usable: bool  # False: int8 products would saturate here
    message: str | None  # why not, or a warning; None: nothing to say


def int8_support(cpuinfo: str | Path = "/proc/cpuinfo") -> Int8Support:
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return Int8Support(True, "int8: cannot read this CPU's flags to check for 8-bit dot-product instructions")
    if not flags.isdisjoint(INT8_DOT_PRODUCT_FLAGS):
        return Int8Support(True, None)
    if "avx2" in flags or "sse2" in flags:  # x86
        return Int8Support(
            False,
            "int8: this x86 CPU has no 8-bit dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX), where ONNX "
            "Runtime's int8 products saturate; serve a float32 export here",
        )
    return Int8Support(True, "int8: this CPU has no 8-bit dot-product instructions; int8 may be slower than float32")


def cpu_signature(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, str]:
    """What names this machine's kind of CPU, for figures measured on it: the first processor's vendor, family,
    model, stepping and model name, and its flags (under a hypervisor the model name alone may be as vague as
    "AMD EPYC" for CPUs years apart); the architecture alone where /proc/cpuinfo cannot be read."""
    fields = first_processor(cpuinfo)
    if fields is None:
        return {"machine": platform.machine()}
    named = ("vendor_id", "cpu family", "model", "stepping", "model name", "CPU implementer", "CPU part")
    signature = {"machine": platform.machine()} | {name: fields[name] for name in named if name in fields}
    return signature | {"flags": " ".join(sorted(_flags(fields)))}
