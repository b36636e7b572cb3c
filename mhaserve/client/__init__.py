"""Clients for a served model: numpy in, numpy out. ``grpc`` and ``http`` hold the same calls over each
transport; what both share (TLS, the token, the result, the error a refused call raises: ``RequestFailed``)
lives in ``common``.

    from mhaserve.client import Client
    with Client("127.0.0.1:8001") as client:
        result = client.infer(query)
"""

from .common import TLS, InferResult, RepositoryEntry, RequestFailed, Sequence, SequenceStep, WeightsOptions, read_token
from .grpc import DEFAULT_RETRY, NO_RETRIES, AsyncClient, Client, RetryPolicy
from .http import HttpClient, HttpRequestFailed
from .shared_memory import SharedMemoryRegions

__all__ = [
    "DEFAULT_RETRY", "NO_RETRIES", "TLS", "AsyncClient", "Client", "HttpClient", "HttpRequestFailed", "InferResult",
    "RepositoryEntry", "RequestFailed", "RetryPolicy", "Sequence", "SequenceStep", "SharedMemoryRegions",
    "WeightsOptions", "read_token",
]  # fmt: skip
