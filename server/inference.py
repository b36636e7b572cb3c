"""An inference request as every transport hands it to the data plane, and the answer it gets back.

A transport decodes its wire format into an ``InferenceRequest`` (the tensors by name, the outputs asked for
with their options, the request's parameters) and encodes an ``InferenceResponse`` into its own. Everything
in between (which version, whether to refuse, how to run) is the data plane's: ``DataPlane.inference``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from mhaserve.contract.signature import ModelSignature

from .parameters import SequenceParameters, sequence_parameters
from .shared_memory import Placement, placement_of
from .tensors import Limits, RunInputs, checked_inputs

NO_PARAMETERS: Mapping[str, object] = MappingProxyType({})

# Requests whose decoding would hold the event loop for milliseconds are decoded and checked on the decode
# thread (DataPlane.off_loop), whichever transport brings them: values converted one by one (typed protobuf
# contents, JSON data) past a small size, and even raw bytes past a megabyte, which are
# checked in whole-array passes (a BOOL mask's bytes, finiteness).
OFF_LOOP_BYTES = 1 << 20
ONE_BY_ONE_ON_LOOP_BYTES = 64 << 10


def decodes_slowly(size: int, one_by_one: int = 0) -> bool:
    """Whether a request of ``size`` bytes, ``one_by_one`` of them values converted one by one, is decoded
    off the event loop."""
    return size > OFF_LOOP_BYTES or one_by_one > ONE_BY_ONE_ON_LOOP_BYTES


@dataclass(frozen=True)
class RequestedOutput:
    """An output a request names, with its options (the protocol's per-output ``parameters``)."""

    name: str
    parameters: Mapping[str, object] = field(default_factory=lambda: NO_PARAMETERS)


@dataclass(frozen=True)
class SharedInput:
    """An input the request left in a shared-memory region: its header, and where its bytes lie."""

    datatype: str
    shape: tuple[int, ...]
    placement: Placement


@dataclass
class InferenceRequest:
    """A request as decoded off the wire, before it is checked against the model it names."""

    model: str
    version: str
    id: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: tuple[RequestedOutput, ...] = ()  # none named: the model's default outputs
    # the request's own options (the protocol's request ``parameters``)
    parameters: Mapping[str, object] = field(default_factory=lambda: NO_PARAMETERS)
    shared_inputs: dict[str, SharedInput] = field(default_factory=dict)  # read from shared memory by the data plane

    @functools.cached_property
    def sequence_step(self) -> SequenceParameters | None:
        """Its place in a sequence (parameters.sequence_parameters: RequestError if malformed), read once: the data
        plane routes by it and run_inputs_of checks it."""
        return sequence_parameters(self.parameters)

    def output(self, name: str) -> RequestedOutput:
        """The output ``name`` as the request asked for it (no options if it named none)."""
        return next((o for o in self.outputs if o.name == name), RequestedOutput(name))

    def output_placements(self) -> dict[str, Placement]:
        """The outputs to write into shared memory, by name, and where."""
        placements = {}
        for output in self.outputs:
            placement = placement_of(output.parameters, f"output '{output.name}'")
            if placement is not None:
                placements[output.name] = placement
        return placements


@dataclass
class InferenceResponse:
    """The answer: the outputs in the order to return them, and the request they answer."""

    model: ModelSignature
    request: InferenceRequest
    outputs: dict[str, np.ndarray]
    # outputs already written into shared memory: described in the answer, their bytes not sent
    placed: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        return self.request.id


def run_inputs_of(request: InferenceRequest, model: ModelSignature, limits: Limits) -> RunInputs:
    """``request``'s inputs checked against the model and the limits: arrays ready for the graph (RequestError
    otherwise). What it asks of the weights is read by the runtime that takes it, which knows over how many keys."""
    return checked_inputs(request.inputs, tuple(o.name for o in request.outputs), model, limits)
