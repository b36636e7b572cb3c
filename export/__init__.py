"""ONNX export and validation (torch). The torch-free manifest helpers live in export.manifest.

``export_module`` is the public entry point for a user's own module; it is imported on first use so
that the server, which reads ``mhaserve.export.manifest``, never imports torch.
"""

__all__ = ["export_module"]


def __getattr__(name: str):
    if name == "export_module":
        from .model_dir import export_module

        return export_module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
