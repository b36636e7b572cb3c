"""The descriptor pool mhaserve's generated protos are registered in: a pool of their own, not protobuf's default.

Triton's clients register the same files (grpc_service.proto, model_config.proto) and messages
(``inference.ModelInferRequest``, ...) in the default pool, and a pool refuses a file or a message defined twice, so
with both in the default pool ``tritonclient.grpc`` and ``mhaserve.client`` could not be imported in one process.
Only the method paths (``/inference.GRPCInferenceService/ModelInfer``) go on the wire, and they are the same.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()


def add_file(descriptor) -> None:
    """Register another file (gRPC health, reflection) in POOL too, so that server reflection, which reads one pool,
    describes every service the server has."""
    try:
        POOL.FindFileByName(descriptor.name)
    except KeyError:
        for dependency in descriptor.dependencies:
            add_file(dependency)
        POOL.AddSerializedFile(descriptor.serialized_pb)
