"""Live parity when its check process stops: started again at the next check, but once every so often at most, so
that a process that dies at every check costs the server a start now and then, its checks meanwhile dropped and
counted; and turned off where the served file's weights cannot be read, or where its process never gets as far as
reading them."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from mhaserve.server import parity
from mhaserve.server.metrics import ModelMetrics
from mhaserve.server.parameters import NO_SHAPING
from mhaserve.server.parity import LiveParity, ParityUnavailable

LABEL = "model 'mha' version 1"


class DyingChecker:
    """A check process that has read the weights and dies at every check (or, with ``refusal``, says it cannot read
    the weights)."""

    ready = True

    def __init__(self, refusal: str | None = None):
        self.starts, self.refusal = 0, refusal
        self.trouble = None if refusal else "exit code -9"

    def restart(self) -> None:
        self.starts += 1

    def judge(self, check) -> dict:
        if self.refusal:
            raise ParityUnavailable(self.refusal)
        raise EOFError

    def close(self) -> None:
        pass


def offered(checks: LiveParity, count: int) -> None:
    rows = np.zeros((1, 2, 8), np.float32)
    inputs = SimpleNamespace(query=rows, key=rows, value=rows, mask=None, shaping=NO_SHAPING)
    for number in range(count):
        checks.offer(str(number), inputs, {"output": rows})
    deadline = time.monotonic() + 10
    while checks.summary()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)


def warnings_of(caplog, words: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if words in record.getMessage()]


def test_a_check_process_that_dies_at_every_check_is_started_again_once_every_so_often(monkeypatch, caplog):
    monkeypatch.setattr(parity, "RESTART_EVERY_S", 0.5)
    checker = DyingChecker()
    checks = LiveParity(checker, share=1.0, figures=ModelMetrics(None, "mha", "1"), label=LABEL)
    with caplog.at_level(logging.WARNING, "mhaserve.server"):
        offered(checks, 20)
        assert checker.starts == 1 and checks.summary()["dropped"] == 20
        time.sleep(0.6)
        offered(checks, 20)
    assert checker.starts == 2 and checks.summary()["dropped"] == 40 and checks.summary()["checked"] == 0
    stopped = f"{LABEL}: the parity check process stopped (exit code -9); starting another"
    assert warnings_of(caplog, "stopped") == [stopped] * 2
    checks.close()


def test_live_parity_turns_off_where_the_served_weights_cannot_be_read(caplog):
    checker = DyingChecker(refusal="model.onnx has no W_q projection this check can read")
    checks = LiveParity(checker, share=1.0, figures=ModelMetrics(None, "mha", "1"), label=LABEL)
    with caplog.at_level(logging.WARNING, "mhaserve.server"):
        offered(checks, 5)
        offered(checks, 5)  # offered after it turned off: not even queued
    assert checks.share == 0.0 and checks.summary()["dropped"] <= 5
    assert warnings_of(caplog, "live parity off") == [
        f"{LABEL}: live parity off: model.onnx has no W_q projection this check can read"
    ]
    checks.close()


def test_a_check_process_that_cannot_read_the_served_file_says_why_at_the_first_check(tmp_path):
    checker = parity.CheckProcess(tmp_path / "model.onnx", 8, {})  # the file gone since the load
    rows = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ParityUnavailable, match=r"model.onnx could not be read: FileNotFoundError"):
        checker.judge(parity.Check("request 'a'", "attention", (rows, rows, rows, None), {"output": rows}))
    checker.close()
    assert checker.trouble == "exit code 0"


def test_a_check_process_that_exits_before_reading_the_weights_three_times_turns_live_parity_off(
    monkeypatch, caplog, tmp_path
):
    monkeypatch.setattr(parity, "RESTART_EVERY_S", 0.05)
    monkeypatch.setattr(parity, "CHECK_PROCESS", "raise SystemExit(3)  # as an import failing would, fd {fd}")
    checks = LiveParity(parity.CheckProcess(tmp_path / "model.onnx", 8, {}), share=1.0,
                        figures=ModelMetrics(None, "mha", "1"), label=LABEL)  # fmt: skip
    with caplog.at_level(logging.WARNING, "mhaserve.server"):
        deadline = time.monotonic() + 20
        while checks.share and time.monotonic() < deadline:
            offered(checks, 1)
            time.sleep(0.02)
        offered(checks, 5)  # offered after it turned off: not even queued
    assert checks.share == 0.0 and checks.summary()["checked"] == 0
    assert len(warnings_of(caplog, "stopped")) == parity.STARTS_UNREADY - 1  # the first, then two started again
    (off,) = warnings_of(caplog, "live parity off")
    assert off.startswith(f"{LABEL}: live parity off: its check process exited before it had read the weights, 3 ")
    checks.close()
