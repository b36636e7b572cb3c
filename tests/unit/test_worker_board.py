"""The workers' board (server/threads.py): each worker marks its own slot while it runs models, and a worker's run
takes every core's threads only while the others have run nothing for a while."""

from __future__ import annotations

import time

from mhaserve.server.threads import QUIET_S, WorkerBoard


def boards(workers: int = 2) -> list[WorkerBoard]:
    board = WorkerBoard.create(workers)
    return [WorkerBoard(board, index) for index in range(workers)]


def test_a_worker_is_alone_until_another_runs_and_for_a_while_after_its_last_run_ends():
    first, second = boards()
    assert first.others_quiet() and second.others_quiet()  # a new board: nobody has run
    second.run_started()
    second.run_started()  # two runs at once (--inference-workers 2)
    assert not first.others_quiet() and second.others_quiet()  # its own runs do not count
    second.run_ended()
    assert not first.others_quiet(), "one of its runs is still going"
    second.run_ended()
    assert not first.others_quiet(), "its last run has just ended"
    time.sleep(QUIET_S * 1.5)
    assert first.others_quiet()


def test_every_other_worker_counts():
    first, second, third = boards(workers=3)
    third.run_started()
    assert not first.others_quiet() and not second.others_quiet() and third.others_quiet()


def test_a_worker_started_again_after_dying_in_a_run_is_not_busy():
    board = WorkerBoard.create(2)
    first, dying = WorkerBoard(board, 0), WorkerBoard(board, 1)
    dying.run_started()  # and never ends
    assert not first.others_quiet()
    WorkerBoard(board, 1)  # its replacement, not yet running anything
    assert first.others_quiet()
