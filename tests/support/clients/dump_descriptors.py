"""Print, as JSON, every message field (name, number, type, label) of one set of `inference` stubs.

    python dump_descriptors.py tritonclient|mhaserve

One process per set, so that each is read as it stands alone.
"""

import json
import sys


def fields(message, prefix=""):
    out = {}
    name = prefix + message.name
    out[name] = {
        f.name: [f.number, f.type, f.label, f.message_type.full_name if f.message_type else ""] for f in message.fields
    }
    for nested in message.nested_types:
        out.update(fields(nested, name + "."))
    return out


def main():
    if sys.argv[1] == "tritonclient":
        from tritonclient.grpc import model_config_pb2, service_pb2
    else:
        from mhaserve.protos.generated import grpc_service_pb2 as service_pb2
        from mhaserve.protos.generated import model_config_pb2
    messages, rpcs = {}, {}
    for module in (service_pb2, model_config_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            messages.update(fields(message))
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in service.methods:
        rpcs[method.name] = [method.input_type.full_name, method.output_type.full_name]
    print(json.dumps({"service": service.full_name, "messages": messages, "rpcs": rpcs}))


if __name__ == "__main__":
    main()
