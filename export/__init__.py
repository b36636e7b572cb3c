"""ONNX export and validation (torch). The model folder's format, which the server reads too, is
torch-free and lives in ``mhaserve.contract.model_dir``.

``export_module`` is the public entry point for a user's own module; it is imported on first use so
that importing the package (``mhaserve --help``) does not load torch.
"""

__all__ = ["export_module"]


def __getattr__(name: str):
    if name == "export_module":
        from .writer import export_module

        return export_module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
