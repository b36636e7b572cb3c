"""Requests as they are received, before they are decoded: HTTP bodies counted against the memory budget before
they are buffered (refused with 429 at once when it is full), compressed ones inflated in bounded steps and
refused with 413 as soon as they pass the body limit, unknown encodings refused with 415; gRPC messages read a few at
a time (--max-receiving-bytes), so that what gRPC holds while receiving does not grow with the connections
sending; and the memory given back afterwards.

Real server processes, raw sockets, h2 and tritonclient.http; RSS read from /proc.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient

from mhaserve.client.grpc import NO_RETRIES, Client, build_infer_request, parse_infer_response
from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss, rss_mib
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.testing.raw_grpc import ZeroWindowGrpcClient
from tests.support import SMALL_D_MODEL, eager, rand

D = SMALL_D_MODEL
BODY_LIMIT = 32 << 20
ARGS = ("--max-message-bytes", str(BODY_LIMIT), "--warmup-runs", "1")


def post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/v2/models/mha/infer", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def json_request(query: np.ndarray) -> bytes:
    inputs = [{"name": "query", "shape": list(query.shape), "datatype": "FP32", "data": query.ravel().tolist()}]
    return json.dumps({"inputs": inputs, "outputs": [{"name": "output"}]}).encode()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests_are_answered(start_server, small_model_dir, small_module, algorithm):
    server = start_server(small_model_dir, *ARGS)
    query = rand(2, 9, D, seed=4)
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    tensor = httpclient.InferInput("query", list(query.shape), "FP32")
    tensor.set_data_from_numpy(query, binary_data=True)
    result = client.infer("mha", [tensor], request_compression_algorithm=algorithm)
    want, weights = eager(small_module, query)
    np.testing.assert_allclose(result.as_numpy("output"), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("attn_weights"), weights, rtol=0, atol=1e-5)


def test_bad_compressed_bodies_are_refused_with_a_clear_error(start_server, small_model_dir):
    server = start_server(small_model_dir, *ARGS)
    body = json_request(rand(1, 4, D))
    status, answer = post(server.http_url, body, {"Content-Encoding": "br"})
    assert status == 415 and "Content-Encoding 'br' is not accepted" in answer["error"]
    status, answer = post(server.http_url, body, {"Content-Encoding": "gzip"})  # says gzip, is not
    assert status == 400 and "not valid gzip data" in answer["error"]
    status, answer = post(server.http_url, gzip.compress(body)[:-20], {"Content-Encoding": "gzip"})
    assert status == 400 and "ends inside its gzip stream" in answer["error"]
    status, answer = post(server.http_url, zlib.compress(body), {"Content-Encoding": "deflate"})
    assert status == 200 and [o["name"] for o in answer["outputs"]] == ["output"]


@pytest.mark.perf
def test_a_body_inflating_past_the_limit_is_refused_before_it_is_inflated_whole(start_server_process, small_model_dir):
    server = start_server_process(small_model_dir, *ARGS)
    bomb = gzip.compress(b" " * (8 * BODY_LIMIT), compresslevel=9)  # 256 MiB of spaces in about 250 KB
    pid = server.proc.pid
    before = rss_mib(pid)
    reset_peak_rss(pid)
    started = time.perf_counter()
    status, answer = post(server.http_url, bomb, {"Content-Encoding": "gzip"})
    took = time.perf_counter() - started
    grown = peak_rss_mib(pid) - before
    print(
        f"\na {len(bomb)}-byte gzip body of {8 * BODY_LIMIT >> 20} MiB: {status} in {took:.2f} s, peak {grown:+.0f} MiB"
    )
    assert status == 413 and f"inflates (gzip) past the limit of {BODY_LIMIT} bytes" in answer["error"]
    assert grown < (BODY_LIMIT >> 20) + 24, f"inflating took {grown:.0f} MiB for a {BODY_LIMIT >> 20} MiB limit"


def test_a_body_is_refused_before_it_is_read_when_the_budget_is_full(start_server, small_model_dir):
    # The budget counted a request only once it was received and decoded: bodies bounded the work, not memory.
    budget = 4 << 20
    server = start_server(small_model_dir, *ARGS, "--max-inflight-bytes", str(budget))
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        headers = (
            "POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {budget + 1}\r\n\r\n"
        )
        connection.sendall(headers.encode())  # and not one byte of the body
        answer = connection.recv(65536).decode(errors="replace")
    status_line, _, rest = answer.partition("\r\n")
    assert " 429 " in status_line, answer[:300]
    assert "the request as received" in rest and f"max_inflight_bytes={budget}" in rest


@pytest.mark.perf
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_many_compressed_bodies_at_once_stay_within_the_budget_and_memory_goes_back(
    start_server_process, small_model_dir
):
    budget = 64 << 20
    server = start_server_process(small_model_dir, *ARGS, "--max-inflight-bytes", str(budget))
    pid = server.proc.pid
    bomb = gzip.compress(b" " * (2 * BODY_LIMIT), compresslevel=9)
    post(server.http_url, json_request(rand(1, 4, D)), {})  # the handler's first-use allocations
    time.sleep(0.5)
    idle = rss_mib(pid)
    reset_peak_rss(pid)
    statuses: list[int] = []

    def send() -> None:
        for _ in range(3):
            statuses.append(post(server.http_url, bomb, {"Content-Encoding": "gzip"})[0])

    senders = [threading.Thread(target=send) for _ in range(8)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join()
    peak = peak_rss_mib(pid) - idle
    time.sleep(3.5)  # the idle release: arenas and the heap given back
    after = rss_mib(pid) - idle
    size = 2 * BODY_LIMIT >> 20
    print(f"\n24 gzip bodies of {size} MiB, 8 at once, budget {budget >> 20} MiB: {sorted(set(statuses))}, "
          f"peak {peak:+.0f} MiB, 3.5 s after {after:+.0f} MiB over {idle:.0f} MiB")  # fmt: skip
    assert set(statuses) <= {413, 429} and statuses.count(413) >= 1
    assert peak < (budget >> 20) + 48, f"peak {peak:.0f} MiB over idle under a {budget >> 20} MiB budget"
    assert after < 24, f"{after:.0f} MiB still held 3.5 s after"


def test_a_slow_chunked_upload_holds_its_share_while_it_arrives(start_server, small_model_dir):
    budget = 8 << 20
    server = start_server(small_model_dir, *ARGS, "--max-inflight-bytes", str(budget))
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    head = "POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        chunk = b" " * (1 << 20)
        for _ in range(5):  # 5 MiB arrived, and more to come
            slow.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        time.sleep(0.5)
        with socket.create_connection((host, int(port)), timeout=10) as other:
            other.sendall((head + f"Content-Length: {4 << 20}\r\n\r\n").encode())
            refused = other.recv(65536).decode(errors="replace")
        slow.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(b'{"inputs": 1}'), b'{"inputs": 1}'))
        answered = slow.recv(65536).decode(errors="replace")
    assert " 429 " in refused.partition("\r\n")[0], refused[:300]  # 5 MiB held + 4 MiB > 8 MiB
    assert " 400 " in answered.partition("\r\n")[0], answered[:300]  # received whole, then refused as no request
    assert "inputs" in answered


# Sends `count` ModelInfer messages of about `mib` MiB at once (or, with `stream`, one on a ModelStreamInfer stream
# each), each on a connection of its own, and prints each call's status. In its own process, so that the server's
# RSS is measured alone.
GRPC_SENDER = r"""
import sys, threading, time
import grpc
from mhaserve.protos.generated import grpc_service_pb2 as pb

url, mib, count, width, rpc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rows = (mib << 20) // (4 * width)
tensor = pb.ModelInferRequest.InferInputTensor(name="query", datatype="FP32", shape=[1, rows, width])
wire = pb.ModelInferRequest(model_name="mha", inputs=[tensor], raw_input_contents=[bytes(4 * rows * width)])
wire = wire.SerializeToString()
start = threading.Barrier(count)
statuses = []

def send():
    options = [("grpc.max_send_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(url, options=options) as channel:
        start.wait()
        try:
            if rpc.startswith("stream"):  # "stream-held": the stream stays open, idle, until stdin closes
                call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
                answers = call(held(wire), timeout=120)
                answer = pb.ModelStreamInferResponse.FromString(next(answers))
                statuses.append(answer.error_message or "OK")
                release.wait()
            else:
                channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(wire, timeout=120)
                statuses.append("OK")
        except grpc.RpcError as error:
            statuses.append(f"{error.code().name}: {error.details()}")

release = threading.Event()

def held(wire):
    yield wire
    if rpc == "stream-held":
        release.wait()

threads = [threading.Thread(target=send, daemon=True) for _ in range(count)]
for thread in threads:
    thread.start()
while len(statuses) < count and any(thread.is_alive() for thread in threads):
    time.sleep(0.05)
print("\n".join(statuses), flush=True)
if rpc == "stream-held":
    sys.stdin.read()
release.set()
for thread in threads:
    thread.join()
"""
MESSAGE_MIB, BUDGET_MIB = 96, 256
GRPC_LIMITS = (
    "--max-message-bytes", str((MESSAGE_MIB + 1) << 20), "--max-inflight-bytes", str(BUDGET_MIB << 20),
    "--warmup-runs", "1",
)  # fmt: skip


def grpc_messages_at_once(
    server, mib: int, count: int, settle: float = 3.5, rpc: str = "unary"
) -> tuple[list[str], float, float, float]:
    """``count`` messages of ``mib`` MiB (of the wrong width) at once, as ModelInfer calls or one on each of
    ``count`` ModelStreamInfer streams (``rpc="stream"``): their statuses, the server's idle RSS, its peak over idle
    while they arrived, and its RSS over idle ``settle`` seconds later."""
    time.sleep(1.0)
    pid = server.proc.pid
    idle = rss_mib(pid)
    reset_peak_rss(pid)
    done = subprocess.run([sys.executable, "-c", GRPC_SENDER, server.url, str(mib), str(count), str(D + 1), rpc],
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    peak = peak_rss_mib(pid) - idle
    time.sleep(settle)
    return done.stdout.splitlines(), idle, peak, rss_mib(pid) - idle


@pytest.mark.perf
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_grpc_receipt_stays_bounded_however_many_connections_send_at_once(
    start_server_process, small_model_dir, small_module
):
    """Requests are read a few at a time (--max-receiving-bytes), the others held unread by HTTP/2 flow control,
    so what gRPC holds while receiving does not grow with the connections sending: the server stays within
    idle + the budget + 512 MiB with its defaults, at 8 connections as at 32."""
    server = start_server_process(small_model_dir, *GRPC_LIMITS)
    for count, settle in ((8, 0.0), (32, 3.5)):
        statuses, idle, peak, after = grpc_messages_at_once(server, mib=MESSAGE_MIB, count=count, settle=settle)
        print(f"\n{count} x {MESSAGE_MIB} MiB gRPC messages at once, {BUDGET_MIB} MiB budget: peak {peak:+.0f} MiB, "
              f"{settle} s after {after:+.0f} MiB over {idle:.0f} MiB")  # fmt: skip
        # each was received and refused for its width (or by the budget): none lost, none timed out
        assert len(statuses) == count
        assert all(s.startswith(("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")) for s in statuses), statuses
        assert peak < BUDGET_MIB + 512, f"peak {peak:.0f} MiB over idle with {count} connections"
    assert after < 2 * MESSAGE_MIB, f"{after:.0f} MiB still held 3.5 s after"  # two messages' pages at most
    with Client(server.url) as client:  # and it serves as before
        query = rand(1, 5, D, seed=4)
        np.testing.assert_allclose(client.infer(query).output, eager(small_module, query)[0], atol=1e-5)


@pytest.mark.perf
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_streams_read_in_receiving_turns_stay_within_the_budget(start_server_process, small_model_dir):
    """grpcio receives a stream's next message whole once its read is asked for; streams read in the receiving
    turns that unary calls take (one per three messages of --max-message-bytes in --max-receiving-bytes), the
    others held to their window, so 16 streams sending 96 MiB each stay within idle + the budget + 512 MiB as unary
    calls do (every open stream reading at once took +1.1 to +2.3 GiB). Each stream may hold its turn 10 s: on a
    loaded machine a 96 MiB message in its turn can take over the default second to arrive, and a stream idle in
    its turn is another test's subject."""
    server = start_server_process(small_model_dir, *GRPC_LIMITS, "--stream-read-hold-s", "10")
    for count in (8, 16):
        statuses, idle, peak, after = grpc_messages_at_once(server, mib=MESSAGE_MIB, count=count, rpc="stream")
        print(f"\n{count} streams x {MESSAGE_MIB} MiB, in receiving turns, {BUDGET_MIB} MiB budget: "
              f"peak {peak:+.0f} MiB, 3.5 s after {after:+.0f} MiB over {idle:.0f} MiB")  # fmt: skip
        assert len(statuses) == count
        assert all(s.startswith(("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")) for s in statuses), statuses
        assert peak < BUDGET_MIB + 512, f"peak {peak:.0f} MiB over idle with {count} streams"
        assert after < 2 * MESSAGE_MIB, f"{after:.0f} MiB still held 3.5 s after"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_an_open_stream_holds_no_request_it_has_answered(start_server_process, small_model_dir):
    """grpcio's request iterator keeps each message until the next one comes: 8 open streams, each answered for
    its one 96 MiB request, held 8 x 96 MiB while they stayed open. Read with context.read(), they hold none. (A turn
    each to receive in: with fewer, a stream whose request is slow to arrive on a loaded machine gives way to those
    waiting, which other tests cover.)"""
    count = 8
    turns = count * 3 * ((MESSAGE_MIB + 1) << 20)
    server = start_server_process(small_model_dir, *GRPC_LIMITS, "--max-receiving-bytes", str(turns))
    time.sleep(1.0)
    idle = rss_mib(server.proc.pid)
    sender = subprocess.Popen(
        [sys.executable, "-c", GRPC_SENDER, server.url, str(MESSAGE_MIB), str(count), str(D + 1), "stream-held"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        statuses = [sender.stdout.readline().strip() for _ in range(count)]  # every stream answered, all open
        time.sleep(3.5)
        held = rss_mib(server.proc.pid) - idle
    finally:
        sender.stdin.close()
        sender.wait(timeout=60)
    print(f"\n{count} open streams, each answered for one {MESSAGE_MIB} MiB request: {held:+.0f} MiB over idle")
    assert all(s.startswith(("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")) for s in statuses), statuses
    assert held < 2 * MESSAGE_MIB, f"{held:.0f} MiB held by {count} open streams"


def test_a_stream_idle_in_the_only_receiving_turn_gives_way_within_the_hold_and_unary_calls_never_wait(
    start_server, small_model_dir, small_module
):
    """Streams read in receiving turns; a stream open but sending nothing holds one. With a single turn, another
    stream's request is read once the idle stream has held it --stream-read-hold-s (the idle one is ended
    UNAVAILABLE, to reopen), and a small unary call meanwhile is read in its first read, not behind either."""
    server = start_server(small_model_dir, "--max-receiving-bytes", str(11 << 20), "--stream-read-hold-s", "0.5")
    query = rand(1, 3, D, seed=9)
    with grpc.insecure_channel(server.url) as channel, Client(server.url) as client:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        idle_requests = queue.Queue()
        opened = time.monotonic()  # the idle stream takes its turn after this, and holds it from then
        idle = stream(iter(idle_requests.get, None), timeout=30)  # open, sending nothing: it reads, idle
        time.sleep(0.3)
        started = time.monotonic()
        unary = client.infer(query, timeout=30)
        unary_s = time.monotonic() - started
        started = time.monotonic()
        answer = next(stream(iter([build_infer_request("mha", query)]), timeout=30))
        answered = time.monotonic()
        waited, held = answered - started, answered - opened
        with pytest.raises(grpc.RpcError) as ended:
            next(idle)
        idle_requests.put(None)
    assert unary_s < 0.3, f"a unary call took {unary_s:.2f} s beside the idle stream"
    np.testing.assert_allclose(unary.output, eager(small_module, query)[0], atol=1e-5)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "--stream-read-hold-s" in ended.value.details()
    assert "has 1 turn(s), each three times --max-message-bytes" in ended.value.details()  # and how to have more
    # not before the idle stream's hold is over (however long the unary call took meanwhile), nor long after
    assert held >= 0.5 and waited < 3, f"answered {held:.2f} s after the idle stream opened, after {waited:.2f} s"
    assert not answer.error_message
    np.testing.assert_allclose(
        parse_infer_response(answer.infer_response).output, eager(small_module, query)[0], atol=1e-5
    )


# A large request (1 MiB) a raw connection sends only the start of: within a stream's window, the rest never.
STALLED_REQUEST = build_infer_request("mha", np.ones((8, 512, D), np.float32)).SerializeToString()
STALLED_PART = 200 << 10


@contextlib.contextmanager
def holding_the_only_turn(url: str):
    """A raw HTTP/2 connection whose request sends STALLED_PART and no more, once that request holds the server's
    only receiving turn (past its first read): the connection, to send more calls on and read refusals from, and
    that request's stream."""
    sender = ZeroWindowGrpcClient(url)
    try:
        holder = sender.call(STALLED_REQUEST, stop_after=STALLED_PART)
        sender.pump(0.3)
        yield sender, holder
    finally:
        sender.close()


def test_a_connections_requests_still_arriving_wait_for_its_own_turn_until_another_connection_needs_the_read(
    start_server, small_model_dir, small_module
):
    """A connection not yet proven (none of its requests has arrived whole) sends two large requests that arrive
    slowly, as one caller's do on a busy host. With one receiving turn, the first holds it and the second waits for
    it, not refused: its wait holds up only its own connection. Once another connection's call waits for the read it
    holds, it is refused RESOURCE_EXHAUSTED (retry), and that call is answered at once."""
    server = start_server(small_model_dir, "--max-message-bytes", str(4 << 20), "--max-receiving-bytes",
                          str(12 << 20), "--grpc-read-timeout-s", "30")  # fmt: skip
    with holding_the_only_turn(server.url) as (sender, holder):
        waiter = sender.call(STALLED_REQUEST, stop_after=STALLED_PART)
        sender.pump(1.0)  # forty first reads' time
        assert sender.statuses == {}, "a request refused while only its own connection's calls waited"
        query = rand(1, 3, D, seed=11)
        started = time.monotonic()
        with Client(server.url) as client:
            answer = client.infer(query, timeout=10)
        took = time.monotonic() - started
        sender.pump(0.3)
    assert took < 1.0, f"another connection's small call took {took:.2f} s"
    np.testing.assert_allclose(answer.output, eager(small_module, query)[0], atol=1e-5)
    assert (
        sender.statuses.get(waiter) == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        and holder not in sender.statuses
    )


def test_streams_stepping_every_few_seconds_keep_their_turns_where_the_message_limit_leaves_enough(
    start_server, small_model_dir, small_module
):
    """Each turn reserves three times --max-message-bytes: a limit sized to the requests (4 MiB here) leaves
    --max-receiving-bytes room for a turn per stream, so streams that step with pauses longer than the hold are
    never ended, while another stream and unary calls come and go."""
    server = start_server(small_model_dir, "--max-message-bytes", str(4 << 20), "--stream-read-hold-s", "0.5")
    query = rand(1, 3, D, seed=12)
    want = eager(small_module, query)[0]

    def stepping(channel, steps: int, pause_s: float, answers: list) -> None:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        requests = queue.Queue()
        replies = stream(iter(requests.get, None), timeout=60)
        try:
            for step in range(steps):
                if step:
                    time.sleep(pause_s)  # idle in its turn, past the hold
                requests.put(build_infer_request("mha", query))
                answers.append(next(replies))
        except grpc.RpcError as error:
            answers.append(error)
        finally:
            requests.put(None)

    with grpc.insecure_channel(server.url) as channel, Client(server.url) as client:
        answers = [[] for _ in range(5)]
        threads = [threading.Thread(target=stepping, args=(channel, 3, 1.2, answers[n])) for n in range(4)]
        threads.append(threading.Thread(target=stepping, args=(channel, 6, 0.1, answers[4])))  # another stream
        for thread in threads:
            thread.start()
        unary = [client.infer(query, timeout=30) for _ in range(5)]
        for thread in threads:
            thread.join(60)
    for got in answers:
        assert not [a for a in got if isinstance(a, grpc.RpcError)], [
            a.details() for a in got if isinstance(a, grpc.RpcError)
        ]
        for answer in got:
            assert not answer.error_message
            np.testing.assert_allclose(parse_infer_response(answer.infer_response).output, want, atol=1e-5)
    assert [len(got) for got in answers] == [3, 3, 3, 3, 6]
    for result in unary:
        np.testing.assert_allclose(result.output, want, atol=1e-5)


def test_a_new_callers_large_request_behind_a_stalled_sender_is_read_not_refused(
    start_server, small_model_dir, small_module
):
    """A stalled sender holds the only receiving turn; a new caller's large request (its connection proven by
    nothing yet) that outlasts its first read waits, and arrives meanwhile (its read is under way): it is read and
    answered, not refused for the turn the stalled sender holds."""
    # A first read of 1 ms, a busy host's, so that the new caller's request outlasts it (on loopback some MiB
    # arrive within the default's); a hold of 10 s, its wait's bound, however slow the machine
    server = start_server(small_model_dir, "--max-message-bytes", str(16 << 20), "--max-receiving-bytes",
                          str(48 << 20), "--grpc-first-read-ms", "1", "--stream-read-hold-s", "10")  # fmt: skip
    with holding_the_only_turn(server.url) as (staller, stalled):
        query = rand(32, 512, D, seed=12)  # 4 MiB: past the stream's window and the first read
        with Client(server.url, retry=NO_RETRIES) as client:
            answer = client.infer(query, attn_weights=False, timeout=10)
        staller.pump(0.1)
    np.testing.assert_allclose(answer.output, eager(small_module, query)[0], atol=1e-5)
    assert stalled not in staller.statuses  # its turn was not needed: the request arrived while it waited
