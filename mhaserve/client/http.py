"""The mhaserve client over HTTP/REST: numpy in, numpy out, Triton's binary tensor data extension on the wire.

    with HttpClient("127.0.0.1:8000") as client:
        result = client.infer(query)              # the same InferResult as the gRPC Client's

For a notebook or a language with no gRPC stack; ``tritonclient.http`` works against the server too.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request

import numpy as np

from mhaserve.contract.datatypes import DATATYPES, datatype_of

from .common import TLS, InferResult, RequestFailed, WeightsOptions, request_inputs, requested_outputs

HEADER_LENGTH = "Inference-Header-Content-Length"
# The REST statuses the server answers, by the name of the gRPC status with the same meaning.
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
                429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}  # fmt: skip


class HttpRequestFailed(RequestFailed):
    """A refused call over HTTP: ``status_name`` as gRPC would name it, ``details`` (and ``message``) the
    server's words."""

    def __init__(self, http_status: int, details: str):
        super().__init__(f"{http_status}: {details}")
        self.http_status = http_status
        self.status_name = STATUS_NAMES.get(http_status, f"HTTP_{http_status}")
        self.details = self.message = details

    def __str__(self) -> str:
        return f"{self.http_status}: {self.details}"


def build_http_infer_body(
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    attn_weights: bool = True,
    request_id: str = "",
    attn_weights_mean: bool = False,
    weights: WeightsOptions | None = None,
) -> tuple[bytes, dict[str, str]]:
    """An infer request's body and headers: a JSON header, then every input's bytes; outputs asked as binary,
    the weights shaped as ``weights`` says."""
    inputs, chunks = [], []
    for name, array in request_inputs(query, key, value, mask):
        inputs.append({"name": name, "shape": list(array.shape), "datatype": datatype_of(array),
                       "parameters": {"binary_data_size": array.nbytes}})  # fmt: skip
        chunks.append(memoryview(array).cast("B"))
    names = requested_outputs(attn_weights, attn_weights_mean, weights)
    document = {
        "id": request_id,
        "inputs": inputs,
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in names],
    }
    if weights is not None:
        document["parameters"] = weights.parameters()
    header = json.dumps(document).encode()
    headers = {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream"}
    return b"".join([header, *chunks]), headers


def parse_http_infer_response(body: bytes, json_length: int | None) -> InferResult:
    header = json.loads(body if json_length is None else body[:json_length])
    offset = json_length or 0
    arrays = {}
    for entry in header["outputs"]:
        dtype, shape = DATATYPES[entry["datatype"]], entry["shape"]
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is None:
            arrays[entry["name"]] = np.asarray(entry["data"], dtype=dtype).reshape(shape)
        else:
            arrays[entry["name"]] = np.frombuffer(
                body, dtype=dtype, count=size // dtype.itemsize, offset=offset
            ).reshape(shape)
            offset += size
    return InferResult.from_outputs(arrays, header.get("id", ""), header.get("model_version", ""))


def ssl_context(tls: TLS | None) -> ssl.SSLContext | None:
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
    if tls.cert:
        context.load_cert_chain(tls.cert, tls.key)
    return context


class HttpClient:
    """Blocking HTTP/REST client with the gRPC Client's calls; raises HttpRequestFailed on refusal."""

    def __init__(self, url: str = "127.0.0.1:8000", model: str = "mha", *, tls: TLS | None = None,
                 token: str | None = None, version: str = ""):  # fmt: skip
        self.base = f"{'https' if tls else 'http'}://{url}"
        self.model, self.version = model, version
        self._context = ssl_context(tls)
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def model_path(self) -> str:
        return f"/v2/models/{self.model}" + (f"/versions/{self.version}" if self.version else "")

    def _call(self, method: str, path: str, body: bytes | None = None, headers=None, timeout=None):
        request = urllib.request.Request(
            self.base + path, data=body, method=method, headers={**self._auth, **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context) as response:
                return response.read(), response.headers
        except urllib.error.HTTPError as error:
            text = error.read()
            try:
                details = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                details = text.decode(errors="replace") or error.reason
            raise HttpRequestFailed(error.code, details) from None
        except urllib.error.URLError as error:
            raise HttpRequestFailed(503, f"cannot reach {self.base}: {error.reason}") from None
        except (OSError, http.client.HTTPException) as error:  # the connection failed after it was made (TLS)
            raise HttpRequestFailed(503, f"{self.base}: {type(error).__name__}: {error}") from None

    def infer(self, query, key=None, value=None, mask=None, attn_weights=True, timeout=None, request_id="",
              attn_weights_mean=False, weights: WeightsOptions | None = None,
              traceparent: str = "") -> InferResult:  # fmt: skip
        """As the gRPC client's ``infer``."""
        body, headers = build_http_infer_body(
            query, key, value, mask, attn_weights, request_id, attn_weights_mean, weights
        )
        if traceparent:
            headers["traceparent"] = traceparent
        answer, answer_headers = self._call("POST", self.model_path + "/infer", body, headers, timeout)
        length = answer_headers.get(HEADER_LENGTH)
        return parse_http_infer_response(answer, int(length) if length is not None else None)

    def metadata(self, timeout=None) -> dict:
        return json.loads(self._call("GET", self.model_path, timeout=timeout)[0])

    def model_width(self, timeout=None) -> int:
        return int(self.metadata(timeout)["inputs"][0]["shape"][-1])

    def ready(self, timeout=None) -> bool:
        try:
            self._call("GET", self.model_path + "/ready", timeout=timeout)
            return True
        except HttpRequestFailed:
            return False

    def server_ready(self, timeout=None) -> bool:
        """The load balancer's probe: /v2/health/ready, which needs no token."""
        try:
            self._call("GET", "/v2/health/ready", timeout=timeout)
            return True
        except HttpRequestFailed:
            return False

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
