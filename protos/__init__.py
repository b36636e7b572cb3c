"""The Open Inference Protocol (KServe v2) with Triton extensions: .proto sources and generated stubs."""
