"""Live parity when its check process has exited: started again at the next check, but once every so often at
most, so that a process that cannot start (or dies at every check) costs the server a start now and then, its checks
meanwhile dropped and counted."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np

from mhaserve.server import parity
from mhaserve.server.metrics import ModelMetrics
from mhaserve.server.parameters import NO_SHAPING
from mhaserve.server.parity import LiveParity, ParityUnavailable


class ExitedChecker:
    """A check process that exited and cannot start again (its served file is gone)."""

    exit_code = 1

    def __init__(self):
        self.starts = 0

    def restart(self) -> None:
        self.starts += 1
        raise ParityUnavailable("model.onnx is gone")

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


def test_a_check_process_that_cannot_start_again_is_tried_once_every_so_often(monkeypatch, caplog):
    monkeypatch.setattr(parity, "RESTART_EVERY_S", 0.5)
    checker, figures = ExitedChecker(), ModelMetrics(None, "mha", "1")
    checks = LiveParity(checker, share=1.0, figures=figures, label="model 'mha' version 1")
    with caplog.at_level(logging.WARNING, "mhaserve.server"):
        offered(checks, 20)
        assert checker.starts == 1 and checks.summary()["dropped"] == 20
        time.sleep(0.6)
        offered(checks, 20)
    assert checker.starts == 2 and checks.summary()["dropped"] == 40 and checks.summary()["checked"] == 0
    paused = [record.getMessage() for record in caplog.records if "live parity paused" in record.getMessage()]
    assert paused == ["model 'mha' version 1: live parity paused, its checks dropped: model.onnx is gone; tried again "
                      "in 0.5 s"] * 2  # fmt: skip
    checks.close()
