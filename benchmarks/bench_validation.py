"""An export's validation as it was (each graph's cases apart, ONNX Runtime's threads spinning between runs)
against as it is (the graphs that answer the same requests validated in one pass, threads idle between runs).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_validation.py [--sizes 512/8,768/12] [--rounds 3]

For each size, the seeded module's graphs are built once (the full graph, the output-only graph and the step
graphs); then, in alternating rounds, every validation an export runs on them (the matrix, the input scales,
the step graphs'), the same seed both ways, timed whole. The results of the two ways are checked equal.
Not a test: it prints numbers for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import onnxruntime as ort

import mhaserve.export.step as step
import mhaserve.export.validate as validate
from mhaserve.export.onnx_export import export_onnx
from mhaserve.export.output_only import output_only_graph
from mhaserve.export.step import STEP_VALIDATIONS, step_graphs
from mhaserve.model import seeded_module


def quiet(line: str) -> None:
    pass


def spinning_session(graph):
    """ONNX Runtime's default session, as validation used."""
    return ort.InferenceSession(graph, providers=["CPUExecutionProvider"])


def as_it_was(module, full, only, steps, seed):
    with (
        mock.patch.object(validate, "validation_session", spinning_session),
        mock.patch.object(step, "validation_session", spinning_session),
    ):
        checked = []
        for graph in (full, only):
            checked.append(validate.validate(module, graph, seed=seed, report=quiet))
            checked.append(validate.validate_scales(module, graph, seed=seed, report=quiet))
        checked += [STEP_VALIDATIONS[kind](module, graph, seed, quiet) for kind, graph in steps.items()]
    return checked


def as_it_is(module, full, only, steps, seed):
    graphs = [(full, quiet), (only, quiet)]
    cases = validate.validate_graphs(module, graphs, seed=seed)
    scales = validate.validate_scales_graphs(module, graphs, seed=seed)
    checked = [cases[0], scales[0], cases[1], scales[1]]
    return checked + [STEP_VALIDATIONS[kind](module, graph, seed, quiet) for kind, graph in steps.items()]


def comparable(checked):
    return [[r if isinstance(r, dict) else r.as_dict() for r in results] for results in checked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512/8,768/12", help="d_model/heads, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for size in args.sizes.split(","):
        d, h = (int(part) for part in size.split("/"))
        module = seeded_module(d, h, 0).eval()
        full, only = export_onnx(module).SerializeToString(), output_only_graph(module).SerializeToString()
        steps = {kind: graph.SerializeToString() for kind, graph in step_graphs(module).items()}
        times = {"was": [], "is": []}
        answers = {}
        for round_ in range(args.rounds):
            ways = (("was", as_it_was), ("is", as_it_is))
            for name, way in ways if round_ % 2 == 0 else reversed(ways):
                started = time.perf_counter()
                answers[name] = comparable(way(module, full, only, steps, seed=7))
                times[name].append(time.perf_counter() - started)
        was, now = statistics.median(times["was"]), statistics.median(times["is"])
        print(
            f"{d}/{h}: as it was {was:7.2f} s {[round(t, 2) for t in times['was']]}, as it is {now:7.2f} s "
            f"{[round(t, 2) for t in times['is']]}: {was / now:.2f}x; results equal: {answers['was'] == answers['is']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
