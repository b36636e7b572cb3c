"""A served version's sequence steps, run on its step graph: steps of different sequences that gather while a
run is in progress go together in the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from .graph import StepCache, StepGraph


class StepRuns:
    """One served version's sequence steps, on its step graph: the steps of different sequences that gathered while
    a call was in progress go together in the next one (as dynamic batching does for stateless requests at no queue
    delay), if they carry the same number of new rows, up to ``max_rows`` batch rows; the session runs them as one
    padded batch where that pays, else one after another in that call (StepGraph.run_steps). Event loop
    only."""

    def __init__(self, graph: StepGraph, executor, max_rows: int, on_runs: Callable[[int], None] = lambda runs: None):
        self._graph, self._executor, self._max_rows, self._on_runs = graph, executor, max_rows, on_runs
        self._waiting: list[tuple[np.ndarray, StepCache, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None

    async def run(self, query: np.ndarray, cache: StepCache) -> tuple[np.ndarray, np.ndarray, StepCache]:
        """The step's output, attention weights and grown cache."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append((query, cache, answer))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run_waiting())
        return await answer

    def _next_group(self) -> list[tuple[np.ndarray, StepCache, asyncio.Future]]:
        """The first waiting step, and those that may share its call."""
        first = self._waiting[0]
        group, rows, new_rows = [first], first[0].shape[0], first[0].shape[1]
        if not self._graph.batches_steps:
            return group
        for waiting in self._waiting[1:]:
            query = waiting[0]
            if query.shape[1] == new_rows and rows + query.shape[0] <= self._max_rows:
                group.append(waiting)
                rows += query.shape[0]
        return group

    async def _run_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                group = self._next_group()
                taken = {id(waiting) for waiting in group}
                self._waiting = [waiting for waiting in self._waiting if id(waiting) not in taken]
                steps = [(query, cache) for query, cache, _ in group]
                try:
                    answers, runs = await loop.run_in_executor(self._executor, self._graph.run_steps, steps)
                except Exception as error:  # each step of the run gets its error
                    for *_, answer in group:
                        if not answer.done():
                            answer.set_exception(error)
                    continue
                self._on_runs(runs)
                for (*_, answer), result in zip(group, answers, strict=True):
                    if not answer.done():  # a step whose caller gave up: its sequence is not grown
                        answer.set_result(result)
        finally:
            self._runner = None
