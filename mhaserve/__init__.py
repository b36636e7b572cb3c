"""mhaserve: a multi-head attention module exported to ONNX and served over gRPC on ONNX Runtime."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mhaserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
