"""The mhaserve client over HTTP/REST: numpy in, numpy out, Triton's binary tensor data extension on the wire.

    with HttpClient("127.0.0.1:8000") as client:
        result = client.infer(query)              # the same InferResult as the gRPC Client's

For a notebook or a language with no gRPC stack; ``tritonclient.http`` works against the server too.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from mhaserve.contract.datatypes import DATATYPES, datatype_of
from mhaserve.contract.ring import SEQUENCE_HEADER, sequence_header

from .common import (
    TLS,
    InferResult,
    RepositoryEntry,
    RequestFailed,
    Sequence,
    SequenceStep,
    WeightsOptions,
    checked_timeout,
    config_text,
    request_inputs,
    request_parameters,
    requested_outputs,
    with_remedy,
)
from .servers import address_of
from .shared_memory import SharedMemoryRegions

HEADER_LENGTH = "Inference-Header-Content-Length"
# The REST statuses the server answers, by the name of the gRPC status with the same meaning.
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
                429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}  # fmt: skip


def error_message(body: bytes) -> str:
    """A refusal's message: its JSON body's ``error``, else the body's text."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


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
    shared_memory: SharedMemoryRegions | None = None,
    num_heads: int = 0,
    sequence: SequenceStep | None = None,
    priority: int = 0,
) -> tuple[bytes, dict[str, str]]:
    """An infer request's body and headers: a JSON header, then every input's bytes; outputs asked as binary,
    the weights shaped as ``weights`` says. With ``shared_memory``, the tensors go through its regions instead
    (sized for a model of ``num_heads`` heads) and the body is the JSON alone."""
    inputs, chunks = request_inputs(query, key, value, mask), []
    names = requested_outputs(attn_weights, attn_weights_mean, weights)
    if shared_memory is None:
        described = [{"name": name, "shape": list(array.shape), "datatype": datatype_of(array),
                      "parameters": {"binary_data_size": array.nbytes}} for name, array in inputs]  # fmt: skip
        chunks = [memoryview(array).cast("B") for _, array in inputs]
        outputs = [{"name": n, "parameters": {"binary_data": True}} for n in names]
    else:
        in_region, placed, out_region, windows = shared_memory.place_request(inputs, names, num_heads)
        described = [{"name": name, "shape": list(array.shape), "datatype": datatype_of(array),
                      "parameters": _in_shared_memory(in_region, offset, array.nbytes)}
                     for name, array, offset in placed]  # fmt: skip
        outputs = [{"name": n, "parameters": _in_shared_memory(out_region, *windows[n])} for n in names]
    document = {"id": request_id, "inputs": described, "outputs": outputs}
    parameters = request_parameters(weights, sequence, priority)
    if parameters:
        document["parameters"] = parameters
    header = json.dumps(document).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    headers = {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream"}
    return b"".join([header, *chunks]), headers


def _in_shared_memory(region: str, offset: int, size: int) -> dict:
    return {"shared_memory_region": region, "shared_memory_offset": offset, "shared_memory_byte_size": size}


def parse_http_infer_response(
    body: bytes, json_length: int | None, shared_memory: SharedMemoryRegions | None = None
) -> InferResult:
    header = json.loads(body if json_length is None else body[:json_length])
    if shared_memory is not None:
        described = [(e["name"], e["datatype"], tuple(e["shape"])) for e in header["outputs"]]
        return InferResult.from_outputs(
            shared_memory.read_outputs(described), header.get("id", ""), header.get("model_version", "")
        )
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


JSON_BODY = {"Content-Type": "application/json"}


class HttpClient:
    """Blocking HTTP/REST client with the gRPC Client's calls; raises HttpRequestFailed on refusal."""

    def __init__(self, url: str = "127.0.0.1:8000", model: str = "mha", *, tls: TLS | None = None,
                 token: str | None = None, version: str = ""):  # fmt: skip
        """A client of the server's HTTP/REST port at ``url`` (host:port) for ``model`` (``version`` empty: its
        newest ready version), over HTTPS with ``tls``, with the bearer ``token`` if the server has one."""
        self.base = f"{'https' if tls else 'http'}://{address_of(url)}"
        self.model, self.version = model, version
        self._context = ssl_context(tls)
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._num_heads: int | None = None

    @property
    def model_path(self) -> str:
        """The model's (and version's) path under which the protocol's model endpoints lie."""
        return f"/v2/models/{self.model}" + (f"/versions/{self.version}" if self.version else "")

    def _call(self, method: str, path: str, body: bytes | None = None, headers=None, timeout=None):
        request = urllib.request.Request(
            self.base + path, data=body, method=method, headers={**self._auth, **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=checked_timeout(timeout), context=self._context) as response:
                return response.read(), response.headers
        except urllib.error.HTTPError as error:
            raise HttpRequestFailed(error.code, error_message(error.read()) or error.reason) from None
        except urllib.error.URLError as error:
            failure = f"cannot reach {self.base}: {error.reason}"
            raise HttpRequestFailed(503, with_remedy(failure, "http", self.base.split("//")[-1])) from None
        except (OSError, http.client.HTTPException) as error:  # the connection failed after it was made (TLS)
            failure = f"{self.base}: {type(error).__name__}: {error}"
            raise HttpRequestFailed(503, with_remedy(failure, "http", self.base.split("//")[-1])) from None

    def infer(self, query, key=None, value=None, mask=None, attn_weights=True, timeout=None, request_id="",
              attn_weights_mean=False, weights: WeightsOptions | None = None,
              traceparent: str = "", shared_memory: SharedMemoryRegions | None = None,
              sequence: SequenceStep | None = None, priority: int = 0) -> InferResult:  # fmt: skip
        """As the gRPC client's ``infer``."""
        heads = self.num_heads(timeout) if shared_memory is not None else 0
        body, headers = build_http_infer_body(
            query,
            key,
            value,
            mask,
            attn_weights,
            request_id,
            attn_weights_mean,
            weights,
            shared_memory,
            heads,
            sequence,
            priority,
        )
        if traceparent:
            headers["traceparent"] = traceparent
        if sequence is not None:  # a balancer in front of several servers keeps the sequence on one by it
            headers[SEQUENCE_HEADER] = sequence_header(sequence.id)
        answer, answer_headers = self._call("POST", self.model_path + "/infer", body, headers, timeout)
        length = answer_headers.get(HEADER_LENGTH)
        return parse_http_infer_response(answer, int(length) if length is not None else None, shared_memory)

    def sequence(self, sequence_id: int | str | None = None, *, resume: bool = False) -> Sequence:
        """As the gRPC client's ``sequence``."""
        return Sequence(self, sequence_id, resume=resume)

    def num_heads(self, timeout=None) -> int:
        """The model's heads (from its config's parameters), asked once."""
        if self._num_heads is None:
            self._num_heads = int(self.config(timeout)["parameters"]["num_heads"]["string_value"])
        return self._num_heads

    def config(self, timeout=None) -> dict:
        """As the gRPC client's ``config``, as JSON."""
        return json.loads(self._call("GET", self.model_path + "/config", timeout=timeout)[0])

    def shared_memory(self, name: str | None = None) -> SharedMemoryRegions:
        """As the gRPC client's ``shared_memory``."""

        def register(region: str, key: str, size: int) -> None:
            body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
            self._call("POST", f"/v2/systemsharedmemory/region/{region}/register", body)

        def unregister(region: str) -> None:
            self._call("POST", f"/v2/systemsharedmemory/region/{region}/unregister", b"")

        return SharedMemoryRegions(register, unregister, name)

    def metadata(self, timeout=None) -> dict:
        """The model's metadata as JSON: its versions, platform, and each input and output with datatype and
        shape (-1 for a dynamic axis)."""
        return json.loads(self._call("GET", self.model_path, timeout=timeout)[0])

    def statistics(self, timeout=None) -> dict:
        """The server's counters for this model's version (Triton's statistics extension), as JSON; with no
        version given, the newest served one's."""
        return json.loads(self._call("GET", self.model_path + "/stats", timeout=timeout)[0])["model_stats"][-1]

    def model_width(self, timeout=None) -> int:
        """The served model's d_model, from its metadata."""
        return int(self.metadata(timeout)["inputs"][0]["shape"][-1])

    def repository_index(self, ready: bool = False, timeout=None) -> list[RepositoryEntry]:
        """As the gRPC client's ``repository_index``."""
        body = json.dumps({"ready": ready}).encode()
        answer = json.loads(self._call("POST", "/v2/repository/index", body, JSON_BODY, timeout)[0])
        fields = ("version", "state", "reason")
        return [RepositoryEntry(m["name"], *(m.get(field, "") for field in fields)) for m in answer]

    def load_model(self, name: str | None = None, config: str | dict | None = None, timeout=None) -> None:
        """As the gRPC client's ``load_model``."""
        parameters = {} if config is None else {"config": config_text(config)}
        self._control(name, "load", parameters, timeout)

    def unload_model(self, name: str | None = None, unload_dependents: bool = False, timeout=None) -> None:
        """As the gRPC client's ``unload_model``."""
        self._control(name, "unload", {"unload_dependents": True} if unload_dependents else {}, timeout)

    def _control(self, name: str | None, action: str, parameters: dict, timeout) -> None:
        path = f"/v2/repository/models/{urllib.parse.quote(name or self.model, safe='')}/{action}"
        self._call("POST", path, json.dumps({"parameters": parameters}).encode(), JSON_BODY, timeout)

    def ready(self, timeout=None) -> bool:
        """Whether the server has a ready version of this client's model (and version, if one was named)."""
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

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server answers ready, or raise ``TimeoutError`` after ``timeout`` seconds (a server
        starting up: its port opens when it is ready to serve)."""
        deadline = time.monotonic() + timeout
        while not self.server_ready(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base}: not ready after {timeout:g} s")
            time.sleep(0.1)

    def close(self) -> None:
        """Nothing to close: each call opens and closes its own connection. For symmetry with ``Client``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
