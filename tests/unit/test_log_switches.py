"""Which log lines the server writes: --log-level as Triton's switches, each severity by its own."""

from __future__ import annotations

import logging

import pytest

from mhaserve.server.errors import RequestError
from mhaserve.server.logs import LogSwitches, _Switched


@pytest.mark.parametrize(
    "level, info, warning, verbose",
    [("DEBUG", True, True, 1), ("info", True, True, 0), ("WARNING", False, True, 0), ("ERROR", False, False, 0)],
)
def test_the_log_level_flag_is_read_as_the_severities_it_lets_through(level, info, warning, verbose):
    switches = LogSwitches.from_flags(level, "text", False)
    assert (switches.log_info, switches.log_warning, switches.log_error) == (info, warning, True)
    assert switches.log_verbose_level == verbose


def test_each_severity_is_switched_by_itself_and_the_access_log_by_its_own_switch():
    switched = _Switched()
    switched.switches = LogSwitches(log_info=False, log_warning=True, log_error=False, log_verbose_level=2)

    def written(level: int, logger: str = "mhaserve.server") -> bool:
        return switched.filter(logging.LogRecord(logger, level, __file__, 1, "line", None, None))

    assert [written(level) for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)] == [
        True, False, True, False
    ]  # fmt: skip
    assert written(logging.INFO, "mhaserve.access")  # INFO off leaves the access log to its own switch


@pytest.mark.parametrize("level", [-1, 1 << 32, 1.0, True, "1"])
def test_a_verbose_level_is_a_uint32_as_tritons_log_settings_carry_it(level):
    with pytest.raises(RequestError, match=r"'log_verbose_level' must be an integer from 0 to 2\*\*32 - 1"):
        LogSwitches().updated({"log_verbose_level": level})
    assert LogSwitches().updated({"log_verbose_level": (1 << 32) - 1}).log_verbose_level == (1 << 32) - 1
