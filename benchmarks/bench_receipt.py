"""What requests take from the server's memory while they are received: hostile and careless clients against
--max-inflight-bytes, the working tree and (with --baseline REV) another revision, one after the other.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_receipt.py [--baseline REV]

Each server serves the embedded default model (512/8) with `--max-inflight-bytes 268435456` (256 MiB) and a
bearer token, and is sent, 8 clients at once, authenticated:
- HTTP bodies of about 300 KB with `Content-Encoding: gzip`, each inflating past the body limit (161 MiB);
- HTTP binary bodies of 150 MiB each, of a wrong d_model (tritonclient.http's binary form);
- gRPC messages of 150 MiB each, of a wrong d_model, then [32, 512, 512] requests over the budget.
Per attack: the idle RSS before it, the peak RSS during it, RSS 3 s after, and the answers by status. The gRPC
clients share one connection, as channels to one address in one process do.
Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from mhaserve.client import NO_RETRIES, Client, RequestFailed
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss, rss_mib
from mhaserve.server.process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_revisions import ROOT, shadow_packages  # noqa: E402

TOKEN = "receipt-benchmark-token"
BUDGET = 256 << 20
CLIENTS = 8


def wrong_width_query() -> np.ndarray:
    return np.ones((75, 512, 1024), dtype=np.float32)  # 150 MiB; the model's d_model is 512


def http_gzip(server: ServerProcess) -> list[str]:
    expanded = b" " * (170 << 20)  # past the 161 MiB body limit
    body = gzip.compress(expanded, compresslevel=9)
    headers = {"Content-Encoding": "gzip", "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    return _in_parallel(lambda: _post(server.http_url, body, headers))


def http_binary(server: ServerProcess) -> list[str]:
    query = httpclient.InferInput("query", list(wrong_width_query().shape), "FP32")
    query.set_data_from_numpy(wrong_width_query(), binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([query])
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Inference-Header-Content-Length": str(json_size),
        "Content-Type": "application/octet-stream",
    }
    return _in_parallel(lambda: _post(server.http_url, body, headers))


def grpc_messages(server: ServerProcess) -> list[str]:
    def call(query: np.ndarray) -> str:
        with Client(server.url, max_message_bytes=1 << 30, token=TOKEN, retry=NO_RETRIES) as client:
            try:
                client.infer(query, attn_weights=False, timeout=120)
                return "OK"
            except RequestFailed as error:
                return error.status_name

    statuses = _in_parallel(lambda: call(wrong_width_query()))
    large = np.ones((32, 512, 512), dtype=np.float32)
    return statuses + _in_parallel(lambda: call(large))


def _post(http_url: str, body: bytes, headers: dict) -> str:
    request = urllib.request.Request(http_url + "/v2/models/mha/infer", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            answer.read()
            return str(answer.status)
    except urllib.error.HTTPError as error:
        return str(error.code)
    except (urllib.error.URLError, ConnectionError) as error:
        return type(error).__name__


def _in_parallel(send) -> list[str]:
    statuses: list[str] = []
    threads = [threading.Thread(target=lambda: statuses.append(send())) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


ATTACKS = {
    "HTTP gzip bodies": http_gzip,
    "HTTP 150 MiB binary bodies": http_binary,
    "gRPC 150 MiB messages": grpc_messages,
}


def measure(name: str, server: ServerProcess) -> None:
    pid = server.proc.pid
    for attack, send in ATTACKS.items():
        time.sleep(3)
        idle = rss_mib(pid)
        reset_peak_rss(pid)
        started = time.perf_counter()
        statuses = send(server)
        took = time.perf_counter() - started
        peak = peak_rss_mib(pid)
        time.sleep(3)
        after = rss_mib(pid)
        counts = ", ".join(f"{status} x{n}" for status, n in sorted(collections.Counter(statuses).items()))
        print(f"| {name} | {attack} | {idle:,.0f} | {peak:,.0f} | {after:,.0f} | {took:.1f} | {counts} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a revision to measure as well (e.g. HEAD~3)")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="FLAGS",
        help='the working tree again with these server flags too (e.g. "--grpc-max-connections 1")',
    )
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(TOKEN)
        flags = ("--max-inflight-bytes", str(BUDGET), "--auth-token-file", str(token_file))
        print(
            "| server | what 8 clients sent at once | idle RSS MiB | peak RSS MiB | RSS 3 s after MiB | s | answers |"
        )
        print("|---|---|--:|--:|--:|--:|---|")
        if args.baseline:
            checkout = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), args.baseline],
                           check=True, capture_output=True)  # fmt: skip
            try:
                shadow = shadow_packages(checkout, Path(tmp) / "path")
                env = {"PYTHONPATH": str(shadow), "PYTHONSAFEPATH": "1"}
                with ServerProcess(model_dir, *flags, env=env) as baseline:
                    measure(args.baseline, baseline)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)], check=False)
        with ServerProcess(model_dir, *flags) as current:
            measure("working tree", current)
        for extra in args.also:
            with ServerProcess(model_dir, *flags, *extra.split()) as current:
                measure(f"working tree, `{extra}`", current)


if __name__ == "__main__":
    main()
