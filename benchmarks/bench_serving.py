"""Serving benchmark, one run: eager PyTorch, in-process ORT, mhaserve with batching off and on, and
the peers (PyTriton and MLServer from ../shared/peers), all driven by the same client.

    ../shared/peers/setup_peers.sh    # once, with PEERS_DIR=/tmp/peers/.peers
    .venv/bin/python benchmarks/bench_serving.py --peers-dir /tmp/peers/.peers --out bench-results

Shapes [1,16,512] and [1,128,512] with attention weights, concurrency 1, 4, 16; then a mixed-length
run (16..128) at concurrency 16 with `mhaserve bench` (plots in --out). `--int8` adds mhaserve serving an int8
export of the same module (`mhaserve export --precision int8`), and its ratios to the best peer. `--floor` adds the
least a Python gRPC server on the same ONNX Runtime session can do (bench_server.py's bare server: parse, run inline
on its event loop, answer; no checks, batching or statistics), driven by the same client: where a goal lies below
it, no Python server reaches the goal on this machine. Every timed step holds
/tmp/bench.lock; the peers' start script takes the lock itself, so this script never holds it
across one. The peers serve a single-input (self-attention) export of the *same* module and
weights, since they take one input; mhaserve serves its own export.

The common client is the peers' loadgen.py (tritonclient.grpc threads over client processes), so
every server pays the same client cost. Every server is started first and stays up; then, for ``--rounds``
rounds, each point is measured on every server in turn, the order rotating from round to round, so that an
hour's changes on a shared machine fall on all of them alike. Each row is the median of its rounds, and each
ratio to the best peer the median of the ratios within a round. Prints markdown tables and the targets as ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mhaserve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PEERS_SCRIPTS = (ROOT / ".." / "shared" / "peers").resolve()
LOCK = os.environ.get("BENCH_LOCK", "/tmp/bench.lock")
SHAPES = ("1,16,512", "1,128,512")
CONCURRENCY = (1, 4, 16)
MHASERVE_PORT = 8201
FLOOR = "python-floor"  # --floor's label
PEERS = ("pytriton-batch", "mlserver")  # the labels the ratios are taken against


@contextlib.contextmanager
def bench_lock():
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def log(message: str) -> None:
    print(f"[bench_serving] {message}", file=sys.stderr, flush=True)


def export_peer_model(module, path: Path) -> None:
    """The same module as a one-input self-attention graph: x -> (output, attn_weights)."""
    import torch

    class SelfAttention(torch.nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x)

    from torch.export import Dim

    from mhaserve.export.onnx_export import DEFAULT_OPSET, translations

    x = torch.randn(2, 5, module.d_model)
    program = torch.onnx.export(
        SelfAttention(module).eval(), (x,), input_names=["x"], output_names=["output", "attn_weights"],
        dynamo=True, dynamic_shapes={"x": {0: Dim("batch"), 1: Dim("seq")}}, opset_version=DEFAULT_OPSET,
        custom_translation_table=translations(), verbose=False,
    )  # fmt: skip
    program.save(str(path))


def in_process(module, model_dir: Path, threads: int, runs: int = 300) -> list[dict]:
    """Eager and ORT latency and serial throughput at each shape, same threads for both."""
    import torch

    from mhaserve.server.graphs import AttentionGraphs

    torch.set_num_threads(threads)
    session = AttentionGraphs.open(model_dir, device="cpu", intra_op_threads=threads)
    rows = []
    for shape in SHAPES:
        b, length, d = map(int, shape.split(","))
        x = np.random.default_rng(0).standard_normal((b, length, d), dtype=np.float32)
        mask = np.ones((1, 1, 1, length), dtype=bool)
        xt = torch.from_numpy(x)

        def eager_run(xt=xt):
            with torch.inference_mode():
                module(xt, xt, xt)

        def ort_run(x=x, mask=mask):
            session.run(("output", "attn_weights"), x, x, x, mask)

        for name, fn in (("eager", eager_run), ("ort", ort_run)):
            for _ in range(20):
                fn()
            times = []
            started = time.perf_counter()
            for _ in range(runs):
                t = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - t)
            elapsed = time.perf_counter() - started
            times = np.array(times) / 1e3
            rows.append({"variant": name, "shape": shape, "threads": threads, "p50_us": float(np.median(times)),
                         "p99_us": float(np.percentile(times, 99)), "infer_per_s": runs / elapsed})  # fmt: skip
    return rows


class MhaServer:
    """mhaserve serving ``model_dir`` on ``port`` with ``args`` (``--workers N``: N serving processes on it)."""

    def __init__(self, model_dir: Path, *args: str, port: int = MHASERVE_PORT):
        self.server = ServerProcess(model_dir, "--metrics-port", "0", *args, port=port)

    def __enter__(self):
        self.server.start(timeout=120)
        return self

    def __exit__(self, *exc):
        self.server.stop()


def loadgen(
    peers_dir: Path,
    label: str,
    url: str,
    input_name: str,
    shape: str,
    concurrency: int,
    seconds: float,
    out: Path,
    round_number: int,
) -> None:
    """The peers' loadgen.py at one point, under the lock; its result appended to ``out`` with the round."""
    python = peers_dir / "venv" / "bin" / "python"
    point_file = out.with_suffix(".point.json")
    point_file.unlink(missing_ok=True)
    command = ["flock", LOCK, str(python), str(PEERS_SCRIPTS / "loadgen.py"), "--url", url, "--model", "mha",
               "--input", input_name, "--outputs", "output,attn_weights", "--shape", shape, "-c", str(concurrency),
               "--seconds", str(seconds), "--warmup", "1.5", "--label", label, "--json", str(point_file)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PEERS_DIR": str(peers_dir)})
    print(f"round {round_number + 1}: {done.stdout.strip() or done.stderr[-2000:]}", file=sys.stderr, flush=True)
    if point_file.exists():
        with out.open("a") as f:
            for line in point_file.read_text().splitlines():
                f.write(json.dumps({**json.loads(line), "round": round_number}) + "\n")


def medians(served: list[dict]) -> list[dict]:
    """One row per server and point: the median of its rounds (errors summed), in the order first measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in served:
        groups.setdefault((r["label"], r["shape"], r["concurrency"]), []).append(r)
    rows = []
    for rounds in groups.values():
        row = {**rounds[0], "rounds": len(rounds), "errors": sum(r["errors"] for r in rounds)}
        for key in ("infer_per_s", "p50_us", "p90_us", "p99_us"):
            values = [r[key] for r in rounds if key in r]
            if values:
                row[key] = float(np.median(values))
        rows.append(row)
    return rows


def start_peer(peers_dir: Path, name: str, url: str, *command: str, env: dict | None = None) -> bool:
    environment = {**os.environ, "PEERS_DIR": str(peers_dir), **(env or {})}
    done = subprocess.run([str(PEERS_SCRIPTS / "start_peer.sh"), name, url, *command], capture_output=True,
                          text=True, env=environment)  # fmt: skip
    log(f"{name}: {done.stdout.strip()} {done.stderr.strip()[-500:]}")
    return done.returncode == 0 and "ALL OK" in done.stdout


def stop_peer(peers_dir: Path, name: str) -> None:
    subprocess.run([str(PEERS_SCRIPTS / "stop_peer.sh"), name], env={**os.environ, "PEERS_DIR": str(peers_dir)},
                   capture_output=True)  # fmt: skip


def mixed_lengths(model_dir: Path, seconds: float, out_dir: Path) -> dict:
    with MhaServer(model_dir):
        command = [sys.executable, "-m", "mhaserve.cli", "bench", "--url", f"127.0.0.1:{MHASERVE_PORT}",
                   "--concurrency", "16", "--lengths", "16..128", "--duration", str(seconds), "--warmup", "1.5",
                   "--json", str(out_dir / "mixed.json"), "--plot-dir", str(out_dir / "mixed-plots")]  # fmt: skip
        with bench_lock():
            done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout, file=sys.stderr)
    return json.loads((out_dir / "mixed.json").read_text())["points"][0]


def report(inproc: list[dict], served: list[dict], mixed: dict | None) -> None:
    """``served``: every round's rows; the tables show each point's median over its rounds."""
    print("\n### In process (2 threads)\n")
    print("| variant | shape | p50 ms | p99 ms | infer/s (serial) |\n|---|---|---|---|---|")
    for r in inproc:
        print(f"| {r['variant']} | [{r['shape']}] | {r['p50_us'] / 1e3:.3f} | {r['p99_us'] / 1e3:.3f} "
              f"| {r['infer_per_s']:.0f} |")  # fmt: skip
    rows = medians(served)
    print("\n### Served (client: peers' loadgen.py, same machine; medians of the rounds)\n")
    print("| server | shape | concurrency | rounds | infer/s | p50 ms | p90 ms | p99 ms | errors |")
    print("|---|---|---|--:|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | [{r['shape']}] | {r['concurrency']} | {r['rounds']} | {r['infer_per_s']:.0f} | "
              f"{r.get('p50_us', float('nan')) / 1e3:.2f} | {r.get('p90_us', float('nan')) / 1e3:.2f} | "
              f"{r.get('p99_us', float('nan')) / 1e3:.2f} | {r['errors']} |")  # fmt: skip
    if mixed:
        print(f"\nMixed lengths 16..128, concurrency 16 (mhaserve bench): {mixed['throughput_per_s']:.0f} infer/s, "
              f"p50 {mixed['p50_ms']:.2f} ms, p99 {mixed['p99_ms']:.2f} ms, errors {mixed['errors']}")  # fmt: skip

    print("\n### Against the best peer (ratios taken within each round; median, then the rounds)\n")
    mhaserve = sorted({r["label"] for r in served if r["label"].startswith("mhaserve")})
    float32 = [label for label in mhaserve if label != "mhaserve-int8"]  # the peers serve the float32 export
    candidates = [("mhaserve's best", float32), *((label, [label]) for label in mhaserve)]
    if any(r["label"] == FLOOR for r in served):
        candidates.append((FLOOR, [FLOOR]))
    for shape in SHAPES:
        for c in sorted({r["concurrency"] for r in served}):
            for name, labels in candidates:
                throughput, p50 = [], []
                for number in sorted({r["round"] for r in served}):
                    here = [r for r in served if r["round"] == number and r["shape"] == shape and r["concurrency"] == c]
                    ours = [r for r in here if r["label"] in labels]
                    peers = [r for r in here if r["label"] in PEERS]
                    if not ours or not peers:
                        continue
                    throughput.append(max(r["infer_per_s"] for r in ours) / max(r["infer_per_s"] for r in peers))
                    if c == 1 and all("p50_us" in r for r in ours + peers):
                        p50.append(min(r["p50_us"] for r in ours) / min(r["p50_us"] for r in peers))
                if not throughput:
                    continue
                line = f"- {name} [{shape}] c={c}: throughput {_median_of(throughput)} (goal >= 1.5)"
                if p50:
                    line += f"; p50 {_median_of(p50)} (goal <= 0.5)"
                print(line)
    for label in mhaserve:
        big = [r for r in rows if r["label"] == label and r["shape"] == "1,128,512" and r["concurrency"] == 16]
        ort = [r for r in inproc if r["variant"] == "ort" and r["shape"] == "1,128,512"]
        if big and ort:
            print(f"- {label} [1,128,512] c=16: / in-process ORT's serial throughput = "
                  f"{big[0]['infer_per_s'] / ort[0]['infer_per_s']:.2f}")  # fmt: skip


def _median_of(values: list[float]) -> str:
    return f"{np.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers-dir", type=Path, default=None, help="work folder of ../shared/peers (set up)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--int8", action="store_true", help="also serve an int8 export of the same module")
    parser.add_argument("--only", default=None, help="comma-separated labels of the mhaserve variants to run "
                        "(default all)")  # fmt: skip
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated")
    parser.add_argument("--skip-mixed", action="store_true", help="no mixed-length run")
    parser.add_argument("--floor", action="store_true", help="also the bare Python server (bench_server.py)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every server, the order rotating")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    concurrency = tuple(int(c) for c in args.concurrency.split(","))

    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.model import seeded_module

    model_dir = ensure_default_model()
    module = seeded_module(512, 8, seed=0).eval()  # the weights of the default model
    peer_model = args.out / "mha_single_input.onnx"
    export_peer_model(module, peer_model)

    log("in-process eager and ORT")
    with bench_lock():
        inproc = in_process(module, model_dir, args.threads)
    served_file = args.out / "served.jsonl"
    served_file.unlink(missing_ok=True)
    threads = ("--intra-op-threads", str(args.threads))
    variants = (
        ("mhaserve-nobatch", ("--dynamic-batching", "false", *threads)),
        ("mhaserve-batch", threads),
        # Both cores for Python's side too: two serving processes on one port (their ORT threads divided).
        ("mhaserve-workers-2", ("--workers", "2")),
    )
    folders = {label: model_dir for label, _ in variants}
    if args.int8:
        from mhaserve.export.writer import export_model_dir

        int8_dir = args.out / "int8"
        log(f"exporting the same module in int8 to {int8_dir}")
        manifest = export_model_dir(module, int8_dir, precision="int8", validation_seed=0, report=lambda _: None)
        if not manifest["valid"]:
            raise SystemExit(f"the int8 export is not valid: {manifest['validation']['worst_failure']}")
        variants += (("mhaserve-int8", threads),)
        folders["mhaserve-int8"] = int8_dir
    only = None if args.only is None else set(args.only.split(","))
    with contextlib.ExitStack() as running:
        servers = []  # (label, url, input name), all up at once, measured in turn
        for port, (label, extra) in enumerate(variants, start=MHASERVE_PORT):
            if only is None or label in only:
                log(f"starting {label}")
                running.enter_context(MhaServer(folders[label], *extra, port=port))
                servers.append((label, f"127.0.0.1:{port}", "query"))
        if args.floor:
            from bench_server import start_helper_process

            log(f"starting {FLOOR}")
            bare, url = start_helper_process("bare", model_dir, args.threads)
            running.callback(bare.wait)
            running.callback(bare.terminate)
            servers.append((FLOOR, url, "query"))
        if args.peers_dir and not args.skip_peers:
            threads_env = {"ORT_INTRA_OP_THREADS": str(args.threads)}
            peer_env = {"MODEL": str(peer_model.resolve()), "INPUT_NAME": "x", **threads_env}
            for name, url, command in (
                ("pytriton-batch", "127.0.0.1:8001", ("serve_pytriton.sh",)),
                ("mlserver", "127.0.0.1:8081", ("serve_mlserver.sh", "nobatch")),
            ):
                log(f"starting {name}")
                running.callback(stop_peer, args.peers_dir, name)
                # MLServer in-process (PARALLEL_WORKERS=0), as the peers' README runs it.
                env = {**peer_env, "PARALLEL_WORKERS": "0"} if name == "mlserver" else peer_env
                if start_peer(args.peers_dir, name, url, *command, env=env):
                    servers.append((name, url, "x"))
        for round_number in range(args.rounds):
            for shape in SHAPES:
                for c in concurrency:
                    turn = round_number % len(servers)
                    for label, url, input_name in servers[turn:] + servers[:turn]:
                        loadgen(args.peers_dir, label, url, input_name, shape, c, args.seconds, served_file,
                                round_number)  # fmt: skip
    served = [json.loads(line) for line in served_file.read_text().splitlines()]
    mixed = None
    if not args.skip_mixed:
        log("mixed lengths")
        mixed = mixed_lengths(model_dir, args.seconds, args.out)
    (args.out / "inproc.json").write_text(json.dumps(inproc, indent=1))
    report(inproc, served, mixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
