"""ONNX Runtime's CUDA provider against eager PyTorch on the same GPU, in process, with each point's byte bound.

    PYTHONPATH=/tmp/mhaserve-gpu/site python3 benchmarks/gpu/bench_cuda.py [--repeats 50] [--out results.json]

Per shape ([1,16,512], [1,128,512], [8,512,512] at 512/8, [32,128,768] at 768/12, [1,2048,4096] at
4096/32): one module with seeded weights, exported with mhaserve's exporter (validated) into a temporary
folder, and run host to host, as a server runs it (inputs from host memory, answers back in it):
- ort: the server's own AttentionGraphs (its provider check included), fetching the output alone, or
  the output and the attention weights (on CUDA its inputs bound on the device, the one query array copied
  up once for query, key and value);
- run: the same graph by ``session.run``, which copies each input up on its own (three copies of the query);
- eager: the design documents' module on the same device, same weights, output copied back (and the
  weights, when asked for);
- sdpa: the same projections around ``F.scaled_dot_product_attention``, which never forms the weights
  (no-weights row only).
``--precisions fp32,fp16`` (the default) measures each shape twice: the float32 export against the float32
module, and the float16 export (``mhaserve export --precision fp16``: FP32 in and out, weights in FP16)
against the module in float16 (``.half()``, inputs cast on the device, the output cast back to float32).
Each time is the median of ``--repeats`` calls after warm-up; the device is synchronised before the
clock stops. The bound of a point is the larger of two figures. One is the bytes that must cross between
host and device (query up; output, and the weights tensor B*h*Lq*Lk*4 bytes, 2 in float16, when asked, down) over the
copy bandwidth measured here into pageable memory, where ONNX Runtime copies. The other is the weights
tensor written once and read once in device memory, over the device's measured copy bandwidth.
``--served SECONDS`` also serves each export (``mhaserve serve --device DEVICE``) and measures it with
``mhaserve bench``'s load generator for that many seconds per point: concurrency 1 (p50 against the
in-process time) and each of ``--concurrency`` (16: requests/s), with and without the weights; with ``--workers
1,4`` by one server process and by four worker processes (``mhaserve serve --workers``; check.sh: 1, 2, 4 and 8).
``--profile`` also prints where ONNX Runtime's time goes in each shape's output-only run (its profiler's node
times, summed by operator and provider).
``--steps`` also measures sequence steps (the step graph, d 512/8 and 4096/32): a one-row step at positions 16, 512
and 2048 with the cache where the server keeps it (``StepGraph.run_step``: on the device, I/O binding)
against the same step with the cache sent from host memory each time (the step graph's plain run), and against
resending the whole prefix as one causal request (output only).
``--device cpu`` runs the same on the CPU, where there are no copies: a dry run on a machine without a GPU.
Not a test: it prints numbers, and BENCHMARKS.md records them with the GPU, driver and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F

from mhaserve.contract.signature import PRECISIONS
from mhaserve.export.writer import export_model_dir
from mhaserve.loadtest.loadgen import LoadGenerator, Workload, default_processes
from mhaserve.loadtest.loadgen import Point as LoadPoint
from mhaserve.model.weights import seeded_module
from mhaserve.server.graphs import AttentionGraphs
from mhaserve.server.process import ServerProcess
from mhaserve.server.sequences import Step, StepCache
from mhaserve.server.sequences.runtime import open_step_graphs
from mhaserve.server.tensors import weights_dtype

# (batch, length, d_model, heads)
SHAPES = [(1, 16, 512, 8), (1, 128, 512, 8), (8, 512, 512, 8), (32, 128, 768, 12), (1, 2048, 4096, 32)]
F32 = 4


@dataclass
class Point:
    shape: str
    precision: str
    weights: bool
    ort_ms: float
    plain_ms: float  # the same graph by session.run, each input copied up on its own (the server before binding)
    eager_ms: float
    sdpa_ms: float | None
    bound_ms: float
    max_abs_diff: float  # ONNX Runtime's output against eager in the same precision, same inputs


def median_ms(call, repeats: int, sync, warmup: int = 3) -> float:
    """The median of ``repeats`` timed calls in ms, after ``warmup`` untimed ones; ``sync`` waits for the device."""
    for _ in range(warmup):
        call()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def bandwidths(device: str) -> tuple[float, float]:
    """(device copy, device to pageable host copy) in bytes/s; (inf, inf) on the CPU, where nothing moves."""
    if device != "cuda":
        return float("inf"), float("inf")
    size = 1 << 30
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    on_device = median_ms(lambda: target.copy_(source), 10, torch.cuda.synchronize) / 1e3
    host = torch.empty(size, dtype=torch.uint8)  # pageable, as the arrays ONNX Runtime returns
    to_host = median_ms(lambda: host.copy_(source), 5, torch.cuda.synchronize) / 1e3
    return 2 * size / on_device, size / to_host  # a device copy reads and writes every byte


def sdpa_call(module, query: torch.Tensor) -> torch.Tensor:
    """The module's projections around F.scaled_dot_product_attention: no weights are formed."""
    batch, length, d_model = query.shape
    heads, d_k = module.num_heads, module.d_k

    def split(x):
        return x.view(batch, length, heads, d_k).transpose(1, 2)

    q, k, v = split(module.W_q(query)), split(module.W_k(query)), split(module.W_v(query))
    attended = F.scaled_dot_product_attention(q, k, v)
    return module.W_o(attended.transpose(1, 2).reshape(batch, length, d_model))


def measure_shape(batch, length, d_model, heads, precision, device, repeats, bandwidth, folder: Path) -> list[Point]:
    module = seeded_module(d_model, heads).eval()
    manifest = export_model_dir(module, folder, precision=precision, report=lambda line: None)
    if not manifest.get("valid"):
        raise SystemExit(f"the export of {d_model}/{heads} failed validation: see {folder}")
    session = AttentionGraphs.open(folder, device)
    if device == "cuda" and session.provider != "CUDAExecutionProvider":
        raise SystemExit(f"the session runs on {session.provider}, not CUDA")
    torch_device = torch.device(device)
    module = module.to(torch_device, torch.float16 if precision == "fp16" else torch.float32)
    dtype = next(module.parameters()).dtype
    rng = np.random.default_rng(0)
    query = rng.standard_normal((batch, length, d_model), dtype=np.float32)
    mask = np.ones((1, 1, 1, length), bool)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    device_bw, host_bw = bandwidth
    weights_bytes = batch * heads * length * length * weights_dtype(precision).itemsize
    io_bytes = 2 * batch * length * d_model * F32  # query up, output down
    shape = f"[{batch},{length},{d_model}/{heads}]"
    points = []
    for with_weights in (False, True):
        outputs = ("output", "attn_weights") if with_weights else ("output",)

        def ort_call(outputs=outputs):
            return session.run(outputs, query, query, query, mask)

        graph = session.graph_for(outputs, length)

        def plain_call(outputs=outputs, graph=graph):
            return graph.run(list(outputs), {"query": query, "key": query, "value": query, "mask": mask})

        @torch.inference_mode()
        def eager_call(with_weights=with_weights):
            x = torch.from_numpy(query).to(torch_device).to(dtype)
            output, weights = module(x)
            output = output.float()  # the served signature's FP32 output
            return (output.cpu(), weights.cpu()) if with_weights else (output.cpu(),)

        @torch.inference_mode()
        def sdpa():
            return sdpa_call(module, torch.from_numpy(query).to(torch_device).to(dtype)).float().cpu()

        got, want = ort_call(), eager_call()
        np.testing.assert_array_equal(got[0], plain_call()[0])
        crossing = io_bytes + (weights_bytes if with_weights else 0)
        bound_s = max(crossing / host_bw, 2 * weights_bytes / device_bw)
        points.append(
            Point(
                shape,
                precision,
                with_weights,
                median_ms(ort_call, repeats, sync),
                median_ms(plain_call, repeats, sync),
                median_ms(eager_call, repeats, sync),
                None if with_weights else median_ms(sdpa, repeats, sync),
                bound_s * 1e3,
                float(np.abs(got[0] - want[0].numpy()).max()),
            )
        )
        print(format_point(points[-1]), flush=True)
    return points


def measure_served(
    batch, length, d_model, heads, precision, device, seconds, folder: Path, points: list[Point], workers=(1,),
    concurrency=(16,),
):  # fmt: skip
    """The export served, concurrency 1 and each of ``concurrency``, with and without the weights, by each count
    of ``workers`` (``mhaserve serve --workers N``); one printed line per point."""
    limits = ("--max-batch-size", str(batch), "--max-q-len", str(length), "--max-kv-len", str(length))
    # Room for 16 answers of the largest shape ([1,2048,4096/32] with weights: 512 MiB each in float32).
    budget = ("--max-inflight-bytes", str(64 << 30), "--warmup-runs", "1")
    for count in workers:
        with ServerProcess(folder, "--device", device, *limits, *budget, "--workers", str(count)) as server:
            if device == "cuda" and "provider=CUDAExecutionProvider" not in "".join(server.lines):
                raise SystemExit(f"the server does not run on CUDA: {server.lines[-1]}")
            with LoadGenerator(server.url, default_processes()) as generator:
                for with_weights in (False, True):
                    in_process = next(p for p in points if p.weights == with_weights).ort_ms
                    # Few distinct requests: at [1,2048,4096] each query is 32 MiB in every client process.
                    workload = Workload(d_model, batch, length, length, attn_weights=with_weights, distinct_requests=4)
                    one = generator.measure(workload, LoadPoint("closed", 1, seconds, 1.0))
                    # a connection per caller: workers are reached by connections, not calls
                    loaded = [
                        generator.measure(replace(workload, connections=c), LoadPoint("closed", c, seconds, 1.0))
                        for c in concurrency
                    ]
                    errors = sum(sum(r.errors.values()) for r in (one, *loaded))
                    print(
                        f"{points[0].shape:>20} {precision:>9} {'yes' if with_weights else 'no':>7} "
                        f"| workers {count:>2} | served c1 p50 {one.latency_ms['p50']:8.3f} ms "
                        f"({one.latency_ms['p50'] / in_process:5.2f} x in process) | "
                        + " | ".join(
                            f"c{c} {r.throughput:8.1f} req/s p99 {r.latency_ms['p99']:8.2f} ms"
                            for c, r in zip(concurrency, loaded, strict=True)
                        )
                        + (f" | {errors} errors" if errors else ""),
                        flush=True,
                    )


STEP_MODELS = [(512, 8), (4096, 32)]
STEP_POSITIONS = [16, 512, 2048]


def measure_steps(d_model, heads, device, repeats, folder: Path) -> list[dict]:
    """A one-row step at each position: cache kept on the device, cache sent from the host, prefix resent."""
    module = seeded_module(d_model, heads).eval()
    manifest = export_model_dir(module, folder, report=lambda line: None)
    if not manifest.get("valid"):
        raise SystemExit(f"the export of {d_model}/{heads} failed validation: see {folder}")
    session = AttentionGraphs.open(folder, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for position in STEP_POSITIONS:
        kept, sent, resent = step_times(session, position, repeats, sync)
        rows.append({"model": f"{d_model}/{heads}", "position": position, "kept_ms": kept, "sent_ms": sent,
                     "prefix_ms": resent})  # fmt: skip
        print(
            f"{d_model:>6}/{heads:<3} {position:>8} | {kept:9.3f} {sent:9.3f} {resent:10.3f} | {sent / kept:11.2f} "
            f"{kept / resent:13.3f}",
            flush=True,
        )
    return rows


def step_times(session: AttentionGraphs, position: int, repeats: int, sync) -> tuple[float, float, float]:
    steps = open_step_graphs(session)[0]
    d_model, heads = session.info.d_model, session.info.num_heads
    rng = np.random.default_rng(position)
    row = rng.standard_normal((1, 1, d_model), dtype=np.float32)
    past_key, past_value = (rng.standard_normal((1, heads, position, d_model // heads), dtype=np.float32) for _ in "kv")
    if session.provider == "CUDAExecutionProvider":  # the server keeps it in the GPU's memory
        on_device = (ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for a in (past_key, past_value))
        cache = StepCache.of(*on_device, position)
    else:  # buffers with room, as a sequence's are between regrowths: the step writes its row in place
        room = [np.zeros((1, heads, position + 64, d_model // heads), np.float32) for _ in range(2)]
        for buffer, past in zip(room, (past_key, past_value), strict=True):
            buffer[:, :, :position] = past
        cache = StepCache.of(*room, position)
    prefix = rng.standard_normal((1, position + 1, d_model), dtype=np.float32)
    causal = np.tril(np.ones((1, 1, position + 1, position + 1), bool))
    kept = median_ms(lambda: steps.run_step(Step(row, cache)), repeats, sync)
    feed = {"query": row, "past_key": past_key, "past_value": past_value, "past_lengths": np.full(1, position)}
    sent = median_ms(lambda: steps._session.run(None, feed), repeats, sync)
    resent = median_ms(lambda: session.run(("output",), prefix, prefix, prefix, causal), repeats, sync)
    return kept, sent, resent


def profile_output_only(batch, length, d_model, folder: Path, device: str, runs: int = 20) -> None:
    """ONNX Runtime's profiler over ``runs`` output-only runs of the folder's output-only graph: node time by
    operator and provider, largest first."""
    from mhaserve.contract.model_dir import output_only_file, read_manifest

    path = output_only_file(folder, read_manifest(folder))
    if path is None:  # a float16 export has none: its runs are the full graph's
        print(f"  profile [{batch},{length},{d_model}]: this export has no output-only graph")
        return
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / "profile")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers)
    query = np.random.default_rng(0).standard_normal((batch, length, d_model), dtype=np.float32)
    feed = {"query": query, "key": query, "value": query, "mask": np.ones((1, 1, 1, length), bool)}
    for _ in range(runs):
        session.run(["output"], feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    totals: dict[tuple[str, str], float] = {}
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            args = event.get("args", {})
            key = (args.get("op_name", "?"), args.get("provider", "?"))
            totals[key] = totals.get(key, 0.0) + event["dur"] / 1e3 / runs
    runs_ms = [e["dur"] / 1e3 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    largest = sorted(totals.items(), key=lambda t: -t[1])[:8]
    nodes = ", ".join(f"{op} on {where.replace('ExecutionProvider', '')} {ms:.3f} ms" for (op, where), ms in largest)
    median = statistics.median(runs_ms)
    print(f"  profile [{batch},{length},{d_model}] output only: model_run median {median:.3f} ms; per run: {nodes}")


def format_point(p: Point) -> str:
    sdpa = f"{p.sdpa_ms:8.3f}" if p.sdpa_ms is not None else f"{'':>8}"
    bound = f"{p.bound_ms:8.3f}" if p.bound_ms else f"{'-':>8}"
    return (
        f"{p.shape:>20} {p.precision:>9} {'yes' if p.weights else 'no':>7} | {p.ort_ms:8.3f} {p.plain_ms:8.3f} "
        f"{p.eager_ms:8.3f} {sdpa} | {p.eager_ms / p.ort_ms:11.2f} {p.plain_ms / p.ort_ms:11.2f} | {bound} | "
        f"{p.max_abs_diff:9.2e}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N shapes")
    parser.add_argument("--only", help="only these shapes, by index from 0, comma-separated (instead of --shapes)")
    parser.add_argument("--concurrency", default="16", help="with --served: these concurrencies besides 1")
    parser.add_argument("--profile", action="store_true", help="also profile each shape's output-only run")
    parser.add_argument("--precisions", default="fp32,fp16", help="exports to measure, comma-separated")
    parser.add_argument("--served", type=float, default=0, metavar="SECONDS",
                        help="also serve each export, SECONDS per point (default: in process only)")  # fmt: skip
    parser.add_argument("--steps", action="store_true", help="also measure sequence steps (cache kept or sent)")
    parser.add_argument("--workers", default="1", help="with --served: serve with each of these --workers counts")
    parser.add_argument("--out", type=Path, help="also write the points as JSON")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    if not set(precisions) <= set(PRECISIONS):
        parser.error(f"--precisions: each of {', '.join(PRECISIONS)}, got {args.precisions}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: torch sees no GPU here; --device cpu is the dry run", file=sys.stderr)
        return 2
    bandwidth = bandwidths(args.device)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"{gpu}; torch {torch.__version__}; onnxruntime {ort.__version__}; python {platform.python_version()}")
    print(f"device copy {bandwidth[0] / 1e9:.0f} GB/s, device to host {bandwidth[1] / 1e9:.1f} GB/s\n")
    print(f"{'shape':>20} {'precision':>9} {'weights':>7} | {'ort ms':>8} {'run ms':>8} {'eager ms':>8} "
          f"{'sdpa ms':>8} | eager / ort   run / ort | {'bound ms':>8} | max |diff|")  # fmt: skip
    points = []
    with tempfile.TemporaryDirectory() as scratch:
        indices = [int(i) for i in args.only.split(",")] if args.only else range(min(args.shapes, len(SHAPES)))
        for index in indices:
            batch, length, d_model, heads = SHAPES[index]
            for precision in precisions:
                folder = Path(scratch) / f"m{index}-{precision}"
                shape = (batch, length, d_model, heads, precision)
                measured = measure_shape(*shape, args.device, args.repeats, bandwidth, folder)
                if args.profile:
                    profile_output_only(batch, length, d_model, folder, args.device)
                if args.served:
                    workers = tuple(int(n) for n in args.workers.split(","))
                    concurrency = tuple(int(n) for n in args.concurrency.split(","))
                    measure_served(*shape, args.device, args.served, folder, measured, workers, concurrency)
                points += measured
        steps = []
        if args.steps:
            print(f"\n{'model':>10} {'position':>8} | {'kept ms':>9} {'sent ms':>9} {'prefix ms':>10} | "
                  f"sent / kept {'kept / prefix':>12}")  # fmt: skip
            for d_model, heads in STEP_MODELS:
                steps += measure_steps(d_model, heads, args.device, args.repeats, Path(scratch) / f"step{d_model}")
    if args.out:
        args.out.write_text(json.dumps({"points": [asdict(p) for p in points], "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
