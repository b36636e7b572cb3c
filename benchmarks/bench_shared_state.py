"""The alternative to forwarding a step to the worker that holds its sequence: the sequence's keys and values in
shared memory, stepped by whichever worker the step reached. What that costs over a step made on private memory,
side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_shared_state.py [--rounds 3] [--steps 400]

The embedded default model's step graph (512/8), one-row steps over a sequence of ``--past`` rows: one process steps
a sequence whose cache is its own (private memory), another process steps a sequence whose cache lies in shared
memory under a lock across processes, its length in shared memory too, each step's new key and value rows written
in place as the server writes them. The two processes step in turn, one step each, so that both see the same
machine. Printed per round: each one's median step and the difference. Not a test: BENCHMARKS.md records the
figures. Only the cache and its length are shared here; a server would share each sequence's bookkeeping too.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import onnxruntime as ort

from mhaserve.contract.model_dir import STEP_FILE
from mhaserve.export.default_model import ensure_default_model

D, HEADS, CAPACITY = 512, 8, 4096
SHAPE = (1, HEADS, CAPACITY, D // HEADS)


def _session(model_dir) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # two processes on the machine's cores, as two workers would be
    return ort.InferenceSession(str(model_dir / STEP_FILE), options, providers=["CPUExecutionProvider"])


def _step(session, key, value, length: int, rng) -> None:
    query = rng.standard_normal((1, 1, D), dtype=np.float32)
    feed = {"query": query, "past_key": key, "past_value": value, "past_lengths": np.array([length], np.int64)}
    _, _, new_key, new_value = session.run(None, feed)
    key[:, :, length : length + 1] = new_key  # in place, as the server's cache takes a step's rows
    value[:, :, length : length + 1] = new_value


def _stepper(model_dir, shared: bool, names, lock, length, turn, whose_turn, me: int, steps: int, out) -> None:
    session, rng = _session(model_dir), np.random.default_rng(me)
    if shared:
        blocks = [shared_memory.SharedMemory(name) for name in names]
        key, value = (np.ndarray(SHAPE, np.float32, buffer=block.buf) for block in blocks)
    else:  # its own pages, written as the shared ones were
        key, value = (rng.random(SHAPE, dtype=np.float32) for _ in range(2))
        own = length.value
    times = []
    for _ in range(steps):
        with turn:
            turn.wait_for(lambda: whose_turn.value == me)
        started = time.perf_counter()
        if shared:
            with lock:  # what a worker stepping another's sequence would hold: the sequence's state
                _step(session, key, value, length.value, rng)
                length.value += 1
        else:
            _step(session, key, value, own, rng)
            own += 1
        times.append(time.perf_counter() - started)
        with turn:
            whose_turn.value = 1 - me
            turn.notify_all()
    out.put((shared, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--past", type=int, default=256, help="rows the sequences hold before the steps timed")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    context = multiprocessing.get_context("fork")
    for number in range(1, args.rounds + 1):
        blocks = [shared_memory.SharedMemory(create=True, size=int(np.prod(SHAPE)) * 4) for _ in range(2)]
        for block in blocks:
            np.ndarray(SHAPE, np.float32, buffer=block.buf)[:] = np.random.default_rng(number).random(SHAPE)
        lock, length, out = context.Lock(), context.Value("q", args.past), context.Queue()
        turn, whose_turn = context.Condition(), context.Value("i", 0)
        names = [block.name for block in blocks]
        first_shared = number % 2 == 0  # which of the two steps first, in turn from round to round
        workers = [context.Process(target=_stepper, args=(model_dir, shared, names, lock, length, turn, whose_turn,
                                                          me, args.steps, out))  # fmt: skip
                   for me, shared in ((0, first_shared), (1, not first_shared))]  # fmt: skip
        for worker in workers:
            worker.start()
        results = dict(out.get() for _ in workers)
        for worker in workers:
            worker.join()
        for block in blocks:
            block.close()
            block.unlink()
        skip = args.steps // 10
        private, shared = (statistics.median(results[kind][skip:]) * 1000 for kind in (False, True))
        print(f"round {number}: a step on private memory {private:.3f} ms, on shared memory under a lock "
              f"{shared:.3f} ms: {shared - private:+.3f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
