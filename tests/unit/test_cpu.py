"""int8 reads the CPU's flags: 8-bit dot-product instructions, or products that saturate (x86) or are slow (Arm)."""

from __future__ import annotations

import pytest

from mhaserve.contract.cpu import int8_support


def test_int8_is_refused_on_an_x86_cpu_without_dot_product_instructions(tmp_path):
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2\n")
    support = int8_support(avx2)
    assert not support.usable and "saturate" in support.message


@pytest.mark.parametrize(
    "cpuinfo",
    ["flags\t\t: sse2 avx2 avx512f avx512_vnni\n", "flags\t\t: sse2 avx2 avx_vnni\n", "Features\t: fp asimd asimddp\n"],
    ids=["avx512-vnni", "avx-vnni", "arm-dotprod"],
)
def test_int8_is_quiet_where_the_cpu_has_them(tmp_path, cpuinfo):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert int8_support(path).usable and int8_support(path).message is None


def test_int8_warns_on_arm_without_them_and_where_it_cannot_tell(tmp_path):
    arm = tmp_path / "arm"
    arm.write_text("Features\t: fp asimd\n")
    assert int8_support(arm).usable and "slower" in int8_support(arm).message
    unknown = int8_support(tmp_path / "absent")
    assert unknown.usable and "cannot read this CPU's flags" in unknown.message


def test_the_cpu_model_is_read_for_the_suites_header(tmp_path):
    from mhaserve.contract.cpu import cpu_model

    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: avx2\n")
    assert cpu_model(path) == "AMD EPYC 7B13"
    assert cpu_model(tmp_path / "absent")  # the architecture where there is no cpuinfo


def test_the_cpu_signature_names_the_kind_of_cpu_from_its_first_processor(tmp_path):
    import platform

    from mhaserve.contract.cpu import cpu_signature

    path = tmp_path / "cpuinfo"
    first = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    path.write_text(f"{first}flags\t\t: sse2 avx2 avx512_vnni\n\nprocessor\t: 1\nmodel\t\t: 1\nflags\t\t: sse2\n")
    assert cpu_signature(path) == {
        "machine": platform.machine(), "vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17",
        "model name": "AMD EPYC", "flags": "avx2 avx512_vnni sse2",
    }  # fmt: skip
    assert cpu_signature(tmp_path / "absent") == {"machine": platform.machine()}
