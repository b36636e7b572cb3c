"""What both clients share, whatever the wire: TLS settings, the token, the inputs a request carries, the
outputs it asks for, and the result it gets back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from mhaserve.contract.signature import ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN, OUTPUT

TOKEN_ENV = "MHASERVE_TOKEN"  # the bearer token the CLI sends when --token-file is not given


@dataclass(frozen=True)
class TLS:
    """How the client checks the server, and proves itself when the server asks (mutual TLS)."""

    ca: str | Path | None = None  # PEM roots that signed the server's certificate (None: the system's roots)
    cert: str | Path | None = None  # the client's certificate chain, for servers that verify clients
    key: str | Path | None = None  # its private key
    server_name: str | None = None  # the name to check the certificate against, when the URL's host differs

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")

        def read(path):
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def read_token(token_file: str | Path | None = None) -> str | None:
    """The bearer token from a file, else from $MHASERVE_TOKEN, else None (whitespace around it dropped)."""
    if token_file is not None:
        return Path(token_file).read_text().strip()
    return os.environ.get(TOKEN_ENV, "").strip() or None


@dataclass
class InferResult:
    output: np.ndarray | None
    attn_weights: np.ndarray | None
    id: str = ""
    attn_weights_mean: np.ndarray | None = None  # [B, Lq, Lk], when asked for
    model_version: str = ""  # the version that answered (the newest ready one unless a version was asked for)


def request_inputs(query, key=None, value=None, mask=None) -> list[tuple[str, np.ndarray]]:
    """The inputs a request carries, whatever the wire: the given ones, contiguous, FP32 but the mask (as given)."""
    tensors = {"query": query, "key": key, "value": value, "mask": mask}
    return [
        (name, np.ascontiguousarray(array, dtype=np.float32 if name != "mask" else None))
        for name, array in tensors.items()
        if array is not None
    ]


def requested_outputs(attn_weights: bool, attn_weights_mean: bool) -> list[str]:
    """The output, every head's weights unless not wanted, and their mean over heads when asked for."""
    return [OUTPUT] + [ATTN_WEIGHTS] * attn_weights + [ATTN_WEIGHTS_MEAN] * attn_weights_mean
