"""The summaries graph in process against the graphs beside it: side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_summaries_graph.py [--model-dir DIR] [--runs 150]

Runs, at [1, L, d_model] (L 512 by default), each of a model folder's graphs in turn in one process, the runs
interleaved: the output-only graph, the full graph (every weight), the folder's summaries graph as it was exported,
and the working tree's summaries graph of the folder's full graph (export/summaries.py), where it differs from the
exported one: so a folder exported by an earlier revision shows that revision's summaries beside today's. The
graphs take turns at going first (a graph run right after a given other one reads up to 0.35 ms slower). Two
intra-op threads, spinning off (a session's threads spinning after its run would take the cores from the next
one's). Prints the median of each and its ratio to the output-only graph, then what ONNX Runtime's profile of the
working tree's summaries graph says each of its summary nodes takes (median of 30 runs). Not a test: BENCHMARKS.md
records the figures with this command.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from mhaserve.export.default_model import ensure_default_model
from mhaserve.export.summaries import summaries_graph


def session(model: onnx.ModelProto | Path, profile_prefix: str = "") -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None, help="an exported model folder (the default model)")
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    folder = args.model_dir or ensure_default_model()
    full = onnx.load(folder / "model.onnx")
    today = summaries_graph(full)
    graphs = {
        "output-only graph": session(folder / "model_output_only.onnx"),
        "full graph": session(folder / "model.onnx"),
        "summaries graph as exported": session(folder / "model_summaries.onnx"),
    }
    if today.SerializeToString() != onnx.load(folder / "model_summaries.onnx").SerializeToString():
        graphs["summaries graph of the working tree"] = session(today)
    d_model = full.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    rows = np.random.default_rng(0).standard_normal((1, args.length, d_model)).astype(np.float32)
    feed = {"query": rows, "key": rows, "value": rows, "mask": np.ones((1, 1, 1, args.length), bool)}
    times: dict[str, list[float]] = {name: [] for name in graphs}
    names = list(graphs)
    for run in range(args.runs + 5):
        for name in names[run % len(names) :] + names[: run % len(names)]:  # each first in turn: no order's bias
            started = time.perf_counter()
            graphs[name].run(None, feed)
            if run >= 5:  # the first runs warm up
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["output-only graph"])
    print(f"[1,{args.length},{d_model}] in process, median of {args.runs} interleaved runs ({folder}):")
    for name, values in times.items():
        print(f"{name:>36}: {statistics.median(values) * 1e3:7.2f} ms  {statistics.median(values) / base:.3f}x")
    print("the working tree's summary nodes in ONNX Runtime's profile (median of 30 runs):")
    for node, took_ms in summary_nodes(today, feed).items():
        print(f"{node:>36}: {took_ms:7.3f} ms")


def summary_nodes(graph: onnx.ModelProto, feed: dict) -> dict[str, float]:
    """Each summary node's median kernel time in ms over 30 profiled runs, the costliest first."""
    with tempfile.TemporaryDirectory() as folder:
        profiled = session(graph, f"{folder}/profile")
        for _ in range(35):
            profiled.run(None, feed)
        events = json.loads(Path(profiled.end_profiling()).read_text())
    took = collections.defaultdict(list)
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.startswith("summaries.") and name.endswith("_kernel_time"):
            took[f"{event['args']['op_name']} {name.removesuffix('_kernel_time')}"].append(event["dur"] / 1000)
    medians = {node: statistics.median(values[5:]) for node, values in took.items()}
    return dict(sorted(medians.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    main()
