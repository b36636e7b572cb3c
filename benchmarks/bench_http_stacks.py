"""The HTTP stack under the REST transport: aiohttp (the one shipped) against Starlette on uvicorn, side by side.

    .venv/bin/pip install --target /tmp/stacks-pkgs starlette==1.10.0 uvicorn==0.54.0 httptools   # once
    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_http_stacks.py --stacks-path /tmp/stacks-pkgs

Each candidate serves POST /v2/models/{name}/infer from its own process with the same work behind it: the
data plane (batcher, budget, statistics) on the default model, decode_rest_request and encode_rest_response
(Triton's binary tensor data extension both ways), the answer kept in the budget until written. Only the
HTTP stack differs:
- aiohttp: the REST transport exactly as `mhaserve serve` runs it (rest.RestTransport on http_site's
  listener), its C HTTP parser;
- Starlette 1.10 on uvicorn 0.54 with httptools (its fastest parser), and with h11 (pure Python);
both on the standard asyncio loop, since the process shares its loop with grpc.aio (which does not run on
uvloop). Starlette and uvicorn come from --stacks-path, appended to sys.path so they never shadow the
project's packages; they are not dependencies of mhaserve.

One client for every candidate (bench_http.py's closed loop: aiohttp in this process, requests built
beforehand; its CPU is printed). Rounds alternate between candidates; the median round is kept.
Not a test: it prints numbers; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import http_sender, measure  # noqa: E402

from mhaserve.client.http import build_http_infer_body  # noqa: E402
from mhaserve.export.default_model import ensure_default_model  # noqa: E402

STACKS = {"aiohttp": "aiohttp", "starlette+uvicorn(httptools)": "httptools", "starlette+uvicorn(h11)": "h11"}


# -- one candidate's server process ---------------------------------------------------------------------


async def serve(stack: str, port: int, model_dir: Path, stacks_path: str | None) -> None:
    from mhaserve.server.config import ServerSettings
    from mhaserve.server.dataplane import DataPlane
    from mhaserve.server.rest.routes import RestTransport

    settings = ServerSettings(model_dir=model_dir)
    dataplane = DataPlane(settings, model_dir)
    await dataplane.start()
    body_limit = 1 << 30
    rest = RestTransport(dataplane, None, body_limit, settings.http_read_timeout_s, settings.write_timeout_s)
    if stack == "aiohttp":
        from mhaserve.server.rest.site import start_site

        await start_site(rest.application(), "127.0.0.1", port, max_connections=1000, idle_timeout_s=75, what="HTTP")
        print("serving", flush=True)
        await asyncio.Event().wait()
    if stacks_path:
        sys.path.append(stacks_path)
    import uvicorn
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from mhaserve.server.errors import HTTP_STATUS, RequestError
    from mhaserve.server.rest.codec import HEADER_LENGTH, header_length_of, infer_rest

    async def infer(request):
        """RestTransport.infer on Starlette's request and response: the same infer_rest."""
        try:
            async with dataplane.inference("http") as call:
                header_length = header_length_of(request.headers.get(HEADER_LENGTH))
                body = await request.body()
                payload, json_length = await infer_rest(call, request.path_params["name"], "", body, header_length)
                call.deliver_later()
        except RequestError as error:
            return JSONResponse({"error": error.message}, HTTP_STATUS[error.kind])
        headers = {HEADER_LENGTH: str(json_length)} if json_length is not None else None
        # The background task runs once the response is sent: the answer leaves the budget then.
        return Response(payload, headers=headers, background=BackgroundTask(call.record_delivery, True))

    app = Starlette(routes=[Route("/v2/models/{name}/infer", infer, methods=["POST"])])
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=STACKS[stack], log_level="warning", lifespan="off", access_log=False
    )
    print("serving", flush=True)
    await uvicorn.Server(config).serve()


# -- the driver ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(stack: str, model_dir: Path, stacks_path: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, __file__, "--serve", stack, "--port", str(port), "--model-dir", str(model_dir)]
    if stacks_path:
        command += ["--stacks-path", stacks_path]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "serving":
        raise SystemExit(f"{stack} did not start")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{stack} did not listen on {port}")


async def drive(args) -> None:
    model_dir = ensure_default_model()
    servers = {stack: start(stack, model_dir, args.stacks_path) for stack in STACKS}
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def sender(url: str):
        infer = f"{url}/v2/models/mha/infer"
        return lambda q, w: http_sender(session, infer, *build_http_infer_body(q, attn_weights=w))

    targets = {stack: (sender(url), (True, False)) for stack, (_, url) in servers.items()}
    try:
        rows = await measure(targets, [(1, 16, 512), (1, 128, 512)], (1, 16), args.seconds, args.warmup, args.rounds)
    finally:
        await session.close()
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    print("\nratios, aiohttp against each (same shape, weights and concurrency):")
    by_key = {(r["server"], tuple(r["shape"]), r["weights"], r["c"]): r for r in rows}
    for (stack, shape, weights, c), row in by_key.items():
        ours = by_key[("aiohttp", shape, weights, c)]
        if stack != "aiohttp" and row["throughput"]:
            throughput, p50 = ours["throughput"] / row["throughput"], ours["p50"] / row["p50"]
            label = f"{list(shape)} weights={'yes' if weights else 'no '} c={c:<3}"
            print(f"  vs {stack:>28} {label}: throughput x{throughput:.2f}, p50 x{p50:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stacks-path", help="a folder holding starlette, uvicorn and httptools (pip --target)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.port, args.model_dir, args.stacks_path))
    else:
        asyncio.run(drive(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
