"""The int8 warning reads the CPU's flags: 8-bit dot-product instructions or not."""

from __future__ import annotations

import pytest

from mhaserve.contract.cpu import int8_warning


def test_int8_warns_on_a_cpu_without_dot_product_instructions(tmp_path):
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert "no 8-bit dot-product instructions (VNNI)" in int8_warning(avx2)


@pytest.mark.parametrize(
    "cpuinfo",
    ["flags\t\t: fpu avx2 avx512f avx512_vnni\n", "flags\t\t: avx2 avx_vnni\n", "Features\t: fp asimd asimddp\n"],
    ids=["avx512-vnni", "avx-vnni", "arm-dotprod"],
)
def test_int8_is_quiet_where_the_cpu_has_them(tmp_path, cpuinfo):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert int8_warning(path) is None


def test_int8_says_when_it_cannot_tell(tmp_path):
    assert "cannot read this CPU's flags" in int8_warning(tmp_path / "absent")
