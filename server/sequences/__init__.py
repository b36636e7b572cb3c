"""Sequences: attention over a growing sequence, one step at a time, with its projected keys and values kept here.

A request joins a sequence with Triton's sequence parameters (``sequence_id``, a uint64 or a string;
``sequence_start``; ``sequence_end``), as tritonclient's ``infer(..., sequence_id=, sequence_start=,
sequence_end=)`` sends them. A step carries only its new rows (``query``; self-attention: they are the new keys and
values too); the server runs the model folder's step graph (export/step.py) over the sequence's cache and answers
the new rows' output and their attention weights over every key so far, ``[B, h, new, past + new]``. A sequence
whose first step carries ``key`` (and ``value``) is a cross-attention one: its queries step over the keys and values
it was given (more may come with later steps), on the folder's cross-attention step graph.

- ``sequence_start`` begins a sequence (an id in use is restarted, as in Triton); a step without it must name a
  live sequence; ``sequence_end`` answers the step, then drops the sequence and returns its memory.
- A sequence belongs to the caller that started it (security.Callers: a named token, a client certificate): its
  id names it for that caller alone, so another caller naming the same id meets no sequence, as if it did not
  exist, and cannot read or change it; each such caller holds at most ``--max-sequences-per-client`` sequences and
  ``--max-sequence-bytes-per-client`` of caches. Where callers are not told apart (no auth, one shared token),
  ids are global, as in Triton.
- A refused step changes no sequence: a start becomes live (and restarts the id's old sequence) only once its
  step is answered, and a step that is refused leaves its sequence's cache as it was.
- Steps of one sequence run in their order: a second step while one runs waits for it.
- The cache counts in the memory budget from the step that grows it; ``--max-sequences`` live at once,
  ``--max-sequence-length`` rows each, and a sequence idle for ``--sequence-idle-timeout-s`` is dropped.
- A sequence keeps the version it started on until it ends or times out, through unloads and swaps.
"""

from .graph import Step, StepCache, StepGraph, StepRun
from .runs import StepRuns
from .runtime import SequenceRuntime
from .state import Sequence, SequenceHomes, Sequences

__all__ = [
    "Sequence",
    "SequenceHomes",
    "SequenceRuntime",
    "Sequences",
    "Step",
    "StepCache",
    "StepGraph",
    "StepRun",
    "StepRuns",
]
