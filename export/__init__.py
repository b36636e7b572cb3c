"""ONNX export and validation (torch). The torch-free manifest helpers live in export.manifest."""
