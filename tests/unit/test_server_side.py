"""A load test's point reads the server's statistics when every client process has started its measured window
and again when every one has ended it, whatever order the processes' marks come in."""

from __future__ import annotations

import queue

from mhaserve.loadtest.server_side import WindowReads


def counters(requests: int, server_ns: int, runs: int, rows: int) -> dict:
    """The statistics extension's fields, as the server's statistics answer them."""
    success = {"count": str(requests), "ns": str(server_ns)}
    return {"inference_stats": {"success": success}, "execution_count": runs, "inference_count": rows}


def test_a_client_that_ends_its_window_before_another_starts_keeps_the_server_side():
    # On a loaded machine the second client process started after the first had measured its whole window.
    marks = queue.Queue()
    for edge in ("start", "end", "start", "end"):
        marks.put(edge)
    reads = iter([counters(10, 10_000_000, 5, 10), counters(14, 18_000_000, 7, 14)])
    window = WindowReads(lambda: next(reads), marks, clients=2, longest_s=0.1)
    side = window.result(client_mean_ms=3.0)
    assert side is not None, "the late client's end was lost: no second read"
    assert side["requests"] == 4 and side["server_ms"] == 2.0 and side["rows_per_run"] == 2.0
    assert side["transport_and_client_ms"] == 1.0


def test_a_point_whose_clients_never_say_when_their_window_ends_has_no_server_side():
    marks = queue.Queue()
    marks.put("start")
    window = WindowReads(lambda: counters(0, 0, 0, 0), marks, clients=1, longest_s=-59.9)  # waits 0.1 s
    assert window.result(client_mean_ms=3.0) is None


def test_a_read_that_fails_once_is_tried_again_and_the_clients_are_released_after_the_first_read():
    import threading

    marks = queue.Queue()
    for edge in ("start", "end"):
        marks.put(edge)
    answers = iter([ConnectionError("reset"), counters(10, 10_000_000, 5, 10), counters(12, 16_000_000, 6, 12)])

    def read() -> dict:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    before_read = threading.Event()
    window = WindowReads(read, marks, clients=1, longest_s=0.1, before_read=before_read)
    side = window.result(client_mean_ms=None)
    assert before_read.is_set() and side is not None and side["requests"] == 2 and window.unread is None
