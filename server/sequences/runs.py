"""A served version's sequence steps, run on its step graph: steps of different sequences that gather while a
run is in progress go together in the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from .graph import Step, StepCache, StepGraph, StepRun

# What a step's caller makes of its output and weights, on the inference thread as its call ends
Answering = Callable[[np.ndarray, np.ndarray], Any]


def _as_ran(output: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return output, weights


class StepRuns:
    """One served version's sequence steps of one kind, on its step graph: the steps of different sequences that
    gathered while a call was in progress go together in the next one (as dynamic batching does for stateless
    requests at no queue delay), if they carry the same number of new rows (and new keys), up to ``max_rows``
    batch rows; the session runs them as one batch where that pays, else one after another in that call
    (StepGraph.run_steps). Event loop only."""

    def __init__(
        self, graph: StepGraph, executor, max_rows: int, on_runs: Callable[[list[StepRun]], None] = lambda runs: None
    ):
        self.graph = graph
        self._executor, self._max_rows, self._on_runs = executor, max_rows, on_runs
        self._waiting: list[tuple[Step, Answering, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None

    async def run(self, step: Step, answering: Answering = _as_ran) -> tuple[Any, StepCache | None]:
        """``answering(output, weights)`` of the step's run (by default the two as they are), made on the inference
        thread as its call ends (the event loop bounds steps a second), and its grown cache (None where its new rows
        overflowed)."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append((step, answering, answer))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run_waiting())
        return await answer

    def _run_and_answer(self, steps: list[Step], answerings: list[Answering]) -> tuple[list, list[StepRun]]:
        """On the inference thread: the steps' call, then each one's answer."""
        ran, runs = self.graph.run_steps(steps)
        answered = [(answering(output, weights), cache) for (output, weights, cache), answering in
                    zip(ran, answerings, strict=True)]  # fmt: skip
        return answered, runs

    def _next_group(self) -> list[tuple[Step, Answering, asyncio.Future]]:
        """The first waiting step, and those that may share its call."""
        first = self._waiting[0][0]
        group, rows, shape = [self._waiting[0]], first.query.shape[0], (first.query.shape[1], first.new_keys)
        if not self.graph.batches_steps:
            return group
        for waiting in self._waiting[1:]:
            step = waiting[0]
            if (step.query.shape[1], step.new_keys) == shape and rows + step.query.shape[0] <= self._max_rows:
                group.append(waiting)
                rows += step.query.shape[0]
        return group

    async def _run_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                group = self._next_group()
                taken = {id(waiting) for waiting in group}
                self._waiting = [waiting for waiting in self._waiting if id(waiting) not in taken]
                steps, answerings = [step for step, _, _ in group], [answering for _, answering, _ in group]
                try:
                    answers, runs = await loop.run_in_executor(self._executor, self._run_and_answer, steps, answerings)
                except Exception as error:  # each step of the run gets its error
                    for _, _, answer in group:
                        if not answer.done():
                            answer.set_exception(error)
                    continue
                self._on_runs(runs)
                for (_, _, answer), result in zip(group, answers, strict=True):
                    if not answer.done():  # a step whose caller gave up: its sequence is not grown
                        answer.set_result(result)
        finally:
            self._runner = None
