"""torch.export-based export against the TorchScript export it replaced: export time, and the graphs' run
time side by side in one process.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_exporters.py [--baseline-commit 0b3e5e0] [--threads 2]

The baseline is the project's own code at ``--baseline-commit`` (the last commit on the TorchScript
exporter), unpacked with ``git archive`` into a temporary package tree and run in a child process that
imports it ahead of the installed one: it exports the same seeded modules and times itself. Then both
graphs run on ONNX Runtime's CPU provider in this process, in alternating rounds so both see the same
machine noise, without a mask and with a key-padding mask. Not a test: it prints numbers; BENCHMARKS.md
records them with this command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from bench_export import time_calls
from bench_server import ort_session

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(512, 8), (768, 12)]
# (B, L, d): the usual served shapes, and one at d=768.
SHAPES = [(1, 16, 512), (1, 128, 512), (8, 128, 512), (1, 128, 768)]

# Run in the child: export each size twice (the first pays torch's one-time set-up), print JSON.
EXPORT_SCRIPT = """
import json, sys, time
from pathlib import Path
import mhaserve.export.onnx_export
from mhaserve.export.onnx_export import export_onnx, save_onnx
from mhaserve.model import seeded_module
out, timings = Path(sys.argv[1]), {"exporter": mhaserve.export.onnx_export.__file__}
for d, h in json.loads(sys.argv[2]):
    module = seeded_module(d, h, 0)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        model = export_onnx(module)
        seconds.append(time.perf_counter() - started)
    save_onnx(model, out / f"d{d}.onnx")
    timings[d] = {"seconds": seconds, "nodes": len(model.graph.node)}
print(json.dumps(timings))
"""


def baseline_tree(commit: str, into: Path) -> Path:
    """The project at ``commit`` laid out as the installed package (mhaserve/{model,export,server,protos})."""
    repo = into / "repo"
    repo.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive, check=True)
    package = into / "src" / "mhaserve"
    package.parent.mkdir()
    (repo / "mhaserve").rename(package)
    for part in ("model", "export", "server", "protos"):
        (repo / part).rename(package / part)
    return package.parent


def export_with(pythonpath: str | None, out: Path) -> dict:
    """Export times by the code on ``pythonpath`` (None: the installed project), run in a child process."""
    env = None if pythonpath is None else {"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", EXPORT_SCRIPT, str(out), json.dumps(SIZES)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=out,  # not the checkout: `python -c` puts the working folder, and its mhaserve/, first on sys.path
    )
    timings = json.loads(done.stdout.strip().splitlines()[-1])
    exporter = timings.pop("exporter")
    assert pythonpath is None or exporter.startswith(pythonpath), f"the baseline ran {exporter}"
    return {int(d): t for d, t in timings.items()}


def compare(sessions, shape, masked, reps, rounds=10):
    b, seq_len, d = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, seq_len, d), dtype=np.float32)
    mask = np.ones((1, 1, 1, seq_len), dtype=bool)
    if masked:  # key padding: each item keeps a different number of keys
        mask = (np.arange(seq_len)[None, :] < rng.integers(1, seq_len + 1, size=(b, 1)))[:, None, None, :]
    feeds = {"query": x, "key": x, "value": x, "mask": mask}
    answers = [session.run(None, feeds) for session in sessions]
    assert all(np.array_equal(a, b) for a, b in zip(answers[0], answers[1], strict=True)), "graphs disagree"
    calls = [lambda s=session: s.run(None, feeds) for session in sessions]
    times = [[] for _ in calls]
    for call in calls:
        time_calls(call, 10)
    for _ in range(rounds):
        for call, spent in zip(calls, times, strict=True):
            spent += time_calls(call, max(1, reps // rounds))
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-commit", default="0b3e5e0", help="last commit on the TorchScript exporter")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "old").mkdir()
        (tmp / "new").mkdir()
        old = export_with(str(baseline_tree(args.baseline_commit, tmp)), tmp / "old")
        new = export_with(None, tmp / "new")
        print("export seconds (first in a process, then again):")
        print(f"{'d/h':>7} | {'TorchScript':>17} {'nodes':>5} | {'torch.export':>17} {'nodes':>5}  (Constants count)")
        for d, h in SIZES:
            o, n = old[d], new[d]
            print(
                f"{d:>4}/{h:<2} | {o['seconds'][0]:7.2f} {o['seconds'][1]:7.2f} s {o['nodes']:>5} | "
                f"{n['seconds'][0]:7.2f} {n['seconds'][1]:7.2f} s {n['nodes']:>5}"
            )
        for d, _ in SIZES:
            graphs = [onnx.load(tmp / which / f"d{d}.onnx").graph for which in ("old", "new")]
            ops = [sorted(n.op_type for n in graph.node if n.op_type != "Constant") for graph in graphs]
            same = "the same" if ops[0] == ops[1] else "DIFFERENT"
            print(f"d={d}: the graphs' operators, Constants aside (ONNX Runtime folds them), are {same}")
        print(f"\nORT run time, median ms, {args.threads} threads, alternating rounds (answers checked equal):")
        print(f"{'shape':>14} {'mask':>11} | {'TorchScript':>11} {'torch.export':>12} | {'new/old':>7}")
        for shape in SHAPES:
            d = shape[2]
            sessions = [ort_session(tmp / which / f"d{d}.onnx", args.threads) for which in ("old", "new")]
            for masked in (False, True):
                old_s, new_s = compare(sessions, shape, masked, args.reps if shape[0] == 1 else args.reps // 4)
                label = "[" + ",".join(map(str, shape)) + "]"
                print(
                    f"{label:>14} {'key padding' if masked else 'none':>11} | {old_s * 1e3:11.3f} "
                    f"{new_s * 1e3:12.3f} | {new_s / old_s:7.3f}"
                )


if __name__ == "__main__":
    main()
