"""Generated protobuf and gRPC stubs (protos/generate.py). Never edited by hand."""
