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
    with second.running(), second.running():  # two runs at once (--inference-workers 2)
        assert not first.others_quiet() and second.others_quiet()  # its own runs do not count
        with second.running():
            pass
        assert not first.others_quiet(), "one of its runs is still going"
    assert not first.others_quiet(), "its last run has just ended"
    time.sleep(QUIET_S * 1.5)
    assert first.others_quiet()


def test_every_other_worker_counts():
    first, second, third = boards(workers=3)
    with third.running():
        assert not first.others_quiet() and not second.others_quiet() and third.others_quiet()


def test_a_worker_started_again_after_dying_in_a_run_is_not_busy():
    board = WorkerBoard.create(2)
    first, dying = WorkerBoard(board, 0), WorkerBoard(board, 1)
    dying.running().__enter__()  # and never ends
    assert not first.others_quiet()
    WorkerBoard(board, 1)  # its replacement, not yet running anything
    assert first.others_quiet()


def test_a_lone_run_on_the_event_loop_of_a_worker_is_marked_on_its_board(small_model_dir):
    """One of --workers runs a lone small request on its event loop as a server of one process does: marked on the
    board while it runs, so that another worker's run meanwhile does not take every core's threads."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server.batcher import Batcher
    from mhaserve.server.graphs import AttentionGraphs
    from tests.support import SMALL_D_MODEL, rand
    from tests.support.requests import as_attention_request

    this, other = boards()
    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    seen_by_the_other = []

    def run_model(*args):
        seen_by_the_other.append(other.others_quiet())
        return session.run(*args)

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(
                run_model, executor, workers=1, max_batch_size=4, max_queue_size=8,
                runs_here=lambda rows, q_len, kv_len: True, board=this,
            )  # fmt: skip
            query = rand(1, 5, SMALL_D_MODEL, seed=0)
            answer = await batcher.submit(as_attention_request(query, None, None, None, False))
            return answer, batcher._idle_workers == batcher.workers

    answer, no_worker_used = asyncio.run(scenario())
    assert answer.outputs["output"].shape == (1, 5, SMALL_D_MODEL) and no_worker_used
    assert seen_by_the_other == [False], "the other worker saw this one quiet during its run"
    time.sleep(QUIET_S * 1.5)
    assert other.others_quiet(), "the run's end was not marked"
