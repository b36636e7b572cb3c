"""A raw HTTP/2 gRPC client (h2, a test dependency) that does what grpcio's clients never do: sends part of a request
and stops, or never reads its answers. The slow-reader and stalled-sender tests use it, and so does
benchmarks/bench_hostile.py: what a stalled or hostile client looks like to the server."""

from __future__ import annotations

import socket
import time

import h2.config
import h2.connection
import h2.events
import h2.settings

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class ZeroWindowGrpcClient:
    """Sends ModelInfer calls over one HTTP/2 connection whose receive window is 0: the server can send
    headers, never an answer's bytes. Pings are answered (h2 does it), so the connection looks alive."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.authority = address
        self.statuses: dict[int, str] = {}  # stream -> grpc-status of calls the server ended (refusals)
        self._flush()

    def _flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def _receive(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                headers = dict(event.headers)
                if b"grpc-status" in headers:  # a trailers-only answer: a refusal, no body
                    self.statuses[event.stream_id] = headers[b"grpc-status"].decode()
        self._flush()  # ping acknowledgements

    def call(self, message: bytes, stop_after: int | None = None) -> int:
        """Sends one ModelInfer call; with ``stop_after``, only that many bytes of it, the call left open."""
        stream = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", MODEL_INFER), (":authority", self.authority),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ]  # fmt: skip
        self.conn.send_headers(stream, headers)
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        if stop_after is not None:
            data = data[:stop_after]
        while data:  # within the server's flow-control window
            window = min(self.conn.local_flow_control_window(stream), self.conn.max_outbound_frame_size)
            if window == 0:
                self._receive()
                continue
            self.conn.send_data(stream, data[:window])
            data = data[window:]
            self._flush()
        if stop_after is None:
            self.conn.end_stream(stream)
            self._flush()
        return stream

    def pump(self, seconds: float) -> None:
        """Answer pings and note refusals for ``seconds``, never opening the window."""
        deadline = time.monotonic() + seconds
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                self._receive()
            except TimeoutError:
                pass

    def close(self) -> None:
        self.sock.close()
