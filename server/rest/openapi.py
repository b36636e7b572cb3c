"""The REST API as an OpenAPI 3.0 document: KServe's v2 protocol with Triton's extensions, as this server serves
it, and its route table: each operation names the transport's method that answers it (``x-handler``), and the
transport's router is built from these paths, so the document and the server cannot drift apart. Tensor and
parameter names come from the served signature. Served at ``/v2/docs/openapi.json``, with Swagger UI at
``/v2/docs``.
"""

from __future__ import annotations

import functools

import mhaserve
from mhaserve.contract.datatypes import DATATYPES
from mhaserve.contract.signature import INPUT_NAMES, OUTPUT_NAMES, SHAPING_PARAMETERS

from ..errors import HTTP_STATUS

JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


ERROR_DESCRIPTIONS = {
    400: "refused: malformed (a wrong shape, datatype, name or value), or forbidden by the server's configuration",
    401: "a missing or wrong bearer token (when the server has one)",
    403: "not allowed from where it came (shared memory from a caller not on the server's host)",
    404: "no such model or version",
    409: "the name is taken (a shared-memory region registered already)",
    413: "the body is over the limit, or inflates past it",
    415: "a Content-Encoding the server cannot inflate",
    429: "over a limit, or the queue or the memory budget is full: retry later",
    499: "the client closed its connection before its request was read (counted and logged; no one reads it)",
    500: "the server failed (a bug or a runtime failure); it keeps serving",
    501: "a part of the protocol this server does not offer (CUDA shared memory)",
    503: "loading, unloading or shutting down: retry (elsewhere)",
    504: "the deadline passed, or the body did not arrive in time",
}


def _errors(*codes: int) -> dict:
    return {str(code): _json(_ref("Error"), ERROR_DESCRIPTIONS[code]) for code in codes}


COMMON = (401, 500)
LOAD_BODY = {
    "type": "object",
    "properties": {
        "parameters": {
            "type": "object",
            "properties": {
                "config": {
                    "type": "string",
                    "description": "the model's configuration, Triton's ModelConfig as JSON, served in place of its "
                    "config.pbtxt until a load without one",
                }
            },
            "additionalProperties": False,
            "description": "Triton's 'config' alone ('files' is not supported: a version loads as 'mhaserve export' "
            "wrote it)",
        }
    },
}
MODEL = ("name", "version")


def _parameters(*names: str) -> list[dict]:
    described = {
        "name": "the model's name",
        "version": "the model's version (a positive integer)",
        "region": "the shared-memory region's name",
    }
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}, "description": described[n]}
            for n in names]  # fmt: skip


def _model_paths(prefix: str, path_parameters: tuple[str, ...], example_width: int) -> dict:
    parameters = _parameters(*path_parameters)
    return {
        prefix: {
            "get": {
                "summary": "Model metadata: its versions, inputs and outputs",
                "x-handler": "model_metadata",
                "tags": ["models"],
                "parameters": parameters,
                "responses": {"200": _json(_ref("ModelMetadata"), "the model"), **_errors(404, 503, *COMMON)},
            }
        },
        prefix + "/ready": {
            "get": {
                "summary": "Whether the model (version) serves now",
                "x-handler": "model_ready",
                "tags": ["health"],
                "parameters": parameters,
                "responses": {
                    "200": {"description": "ready"},
                    "400": {"description": "held by the repository but not serving (loading, unloaded, failed)"},
                    **_errors(404, *COMMON),
                },
            }
        },
        prefix + "/config": {
            "get": {
                "summary": "The model's configuration, as Triton's model_config",
                "x-handler": "model_config",
                "tags": ["models"],
                "parameters": parameters,
                "responses": {"200": _json({"type": "object"}, "the configuration"), **_errors(404, 503, *COMMON)},
            }
        },
        prefix + "/stats": {
            "get": {
                "summary": "Statistics of the model (version), as Triton's statistics extension",
                "x-handler": "statistics",
                "tags": ["models"],
                "parameters": parameters,
                "responses": {"200": _json(_ref("Statistics"), "the statistics"), **_errors(404, 503, *COMMON)},
            }
        },
        prefix + "/infer": {
            "post": {
                "summary": "Inference: the attention output, and the attention weights shaped as asked",
                "x-handler": "infer",
                "description": (
                    "JSON, or binary tensor data: a JSON header of `Inference-Header-Content-Length` bytes followed "
                    "by each input's raw little-endian bytes (an input's `binary_data_size` parameter). Outputs are "
                    "returned the way they are asked for (`binary_data` parameter). May be sent compressed "
                    "(`Content-Encoding: gzip` or `deflate`)."
                ),
                "tags": ["inference"],
                "parameters": parameters,
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {"schema": _ref("InferenceRequest"), "examples": _infer_examples(example_width)},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                "responses": {
                    "200": {
                        "description": "the outputs asked for",
                        "content": {
                            JSON: {"schema": _ref("InferenceResponse")},
                            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                        },
                    },
                    **_errors(400, 404, 413, 415, 429, 503, 504, *COMMON),
                },
            }
        },
    }


LOG_EXAMPLE = {"log_verbose_level": 1, "access_log": True}
TRACE_EXAMPLE = {"trace_level": ["TIMESTAMPS"], "trace_rate": "100", "trace_count": "-1"}


def _infer_examples(width: int) -> dict:
    """Request bodies a server of this width accepts as they are: two tokens of self-attention."""
    query = {"name": "query", "shape": [1, 2, width], "datatype": "FP32", "data": [0.5] * width + [-0.5] * width}
    return {
        "output and weights": {"summary": "the output and every head's weights", "value": {"inputs": [query]}},
        "top keys": {
            "summary": "the output and each row's strongest key per head",
            "value": {
                "inputs": [query],
                "parameters": {"attn_top_k": 1},
                "outputs": [{"name": "output"}, {"name": "attn_weights_top_k_indices"}],
            },
        },  # fmt: skip
    }


def _shared_memory_paths(kind: str) -> dict:
    """Triton's system (or CUDA) shared-memory extension's routes."""
    prefix, region = f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{region}}"
    system = kind == "system"
    listed = {"type": "array", "items": _ref("SystemSharedMemoryRegion") if system else {"type": "object"}}
    off = " (400 while the server runs without --allow-client-shm true)"
    status = {"200": _json(listed, "the regions"), **_errors(400, 404, *COMMON)}
    done = {"200": {"description": "unregistered (a name not registered: nothing to do)"}, **_errors(400, *COMMON)}
    tags = ["shared memory"]
    register = {
        "summary": "Register a region: a window of a POSIX shared-memory object" + off
        if system
        else "Refused (501): this server offers system shared memory only",
        "x-handler": "shared_memory_register",
        "tags": tags,
        "parameters": _parameters("region"),
        "requestBody": {
            "required": True,
            "content": {
                JSON: {
                    "schema": _ref("SystemSharedMemoryRegister") if system else {"type": "object"},
                    "example": {"key": "/mha_inputs", "offset": 0, "byte_size": 1048576} if system else {},
                }
            },
        },
        "responses": {"200": {"description": "registered"}, **_errors(400, 409, 429, 501, *COMMON)},
    }
    return {
        prefix + "/status": {"get": {"summary": f"Every registered {kind} region" + off, "tags": tags,
                                     "x-handler": "shared_memory_status", "responses": status}},
        region + "/status": {"get": {"summary": f"One registered {kind} region", "tags": tags,
                                     "x-handler": "shared_memory_status", "parameters": _parameters("region"),
                                     "responses": status}},
        region + "/register": {"post": register},
        prefix + "/unregister": {"post": {"summary": f"Unregister every {kind} region", "tags": tags,
                                          "x-handler": "shared_memory_unregister", "responses": done}},
        region + "/unregister": {"post": {"summary": f"Unregister one {kind} region; requests using it finish first",
                                          "x-handler": "shared_memory_unregister", "tags": tags,
                                          "parameters": _parameters("region"), "responses": done}},
    }  # fmt: skip


# The request and answer bodies, as the protocol defines them (with Triton's extensions).
TENSOR_NAMES = {"type": "string", "description": f"one of {', '.join(INPUT_NAMES)}"}
SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "ServerMetadata": {
        "type": "object",
        "required": ["name", "version", "extensions"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
    },
    "TensorMetadata": {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": _ref("TensorMetadata")},
            "outputs": {"type": "array", "items": _ref("TensorMetadata")},
        },
    },
    "Parameters": {"type": "object", "additionalProperties": True},
    "RequestInput": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": TENSOR_NAMES,
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": sorted(DATATYPES)},
            "parameters": _ref("Parameters"),
            "data": {"type": "array", "items": {}, "description": "the values, row-major (nested or flat)"},
        },
    },
    "RequestOutput": {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "enum": list(OUTPUT_NAMES)},
            "parameters": _ref("Parameters"),
        },
    },
    "InferenceRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "allOf": [_ref("Parameters")],
                "description": "the attention weights' shaping: " + ", ".join(SHAPING_PARAMETERS),
            },
            "inputs": {"type": "array", "items": _ref("RequestInput")},
            "outputs": {"type": "array", "items": _ref("RequestOutput")},
        },
    },
    "ResponseOutput": {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "datatype": {"type": "string"},
            "parameters": _ref("Parameters"),
            "data": {"type": "array", "items": {}},
        },
    },
    "InferenceResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": _ref("Parameters"),
            "outputs": {"type": "array", "items": _ref("ResponseOutput")},
        },
    },
    "Statistics": {
        "type": "object",
        "required": ["model_stats"],
        "properties": {"model_stats": {"type": "array", "items": {"type": "object"}}},
    },
    "RepositoryIndexEntry": {
        "type": "object",
        "required": ["name", "version", "state", "reason"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "state": {"type": "string"},
            "reason": {"type": "string"},
        },
    },
    "SystemSharedMemoryRegion": {
        "type": "object",
        "required": ["name", "key", "offset", "byte_size"],
        "properties": {
            "name": {"type": "string"},
            "key": {"type": "string", "description": "the POSIX shared-memory object's name (in /dev/shm)"},
            "offset": {"type": "integer", "minimum": 0},
            "byte_size": {"type": "integer", "minimum": 1},
        },
    },
    "SystemSharedMemoryRegister": {
        "type": "object",
        "required": ["key", "byte_size"],
        "properties": {
            "key": {"type": "string", "description": "the object's name as shm_open takes it: '/name'"},
            "offset": {"type": "integer", "minimum": 0, "description": "where the region starts in the object"},
            "byte_size": {"type": "integer", "minimum": 1},
        },
    },
    "TraceSettings": {
        "type": "object",
        "description": "Triton's trace settings; trace_level a list, the others strings",
        "properties": {
            "trace_level": {"type": "array", "items": {"type": "string", "enum": ["OFF", "TIMESTAMPS"]}},
            "trace_rate": {"type": "string"},
            "trace_count": {"type": "string"},
            "trace_mode": {"type": "string"},
            "trace_file": {"type": "string"},
            "log_frequency": {"type": "string"},
        },
    },
    "LogSettings": {
        "type": "object",
        "description": "Triton's log settings, and this server's access log",
        "properties": {
            "log_file": {"type": "string", "description": "always empty: the log goes to stderr"},
            "log_info": {"type": "boolean"},
            "log_warning": {"type": "boolean"},
            "log_error": {"type": "boolean"},
            "log_verbose_level": {"type": "integer", "minimum": 0, "description": "above 0: DEBUG lines too"},
            "log_format": {"type": "string", "enum": ["text", "json"]},
            "access_log": {"type": "boolean", "description": "one line per inference request"},
        },
    },
    "LogSettingsUpdate": {
        "type": "object",
        "description": "the settings to change (log_format also takes Triton's 'default', read as text); the "
        "others stay as they are",
        "properties": {
            "log_info": {"type": "boolean"},
            "log_warning": {"type": "boolean"},
            "log_error": {"type": "boolean"},
            "log_verbose_level": {"type": "integer", "minimum": 0},
            "log_format": {"type": "string", "enum": ["text", "json", "default"]},
            "access_log": {"type": "boolean"},
        },
        "additionalProperties": False,
    },
    "TraceSettingsUpdate": {
        "type": "object",
        "description": "settings to change; a setting given null goes back to the global value (or default)",
        "additionalProperties": {
            "nullable": True,
            "oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "string"}}],
        },
    },
}


def _server_paths() -> dict:
    """Health, the server's metadata and statistics, the repository and trace settings."""
    return {**_health_and_server_paths(), **_repository_paths(), **_trace_paths(), **_logging_paths()}


def _health_and_server_paths() -> dict:
    return {
        "/v2/health/live": {
            "get": {
                "summary": "Whether the process is up (no token needed)",
                "x-handler": "live",
                "tags": ["health"],
                "security": [],
                "responses": {"200": {"description": "live"}},
            },
        },
        "/v2/health/ready": {
            "get": {
                "summary": "Whether start-up's models serve and the server is not draining (no token needed)",
                "x-handler": "ready",
                "tags": ["health"],
                "security": [],
                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
            },
        },
        "/v2": {
            "get": {
                "summary": "Server metadata: name, version, protocol extensions",
                "x-handler": "server_metadata",
                "tags": ["server"],
                "responses": {"200": _json(_ref("ServerMetadata"), "the server"), **_errors(*COMMON)},
            },
        },
        "/v2/models/stats": {
            "get": {
                "summary": "Statistics of every served version",
                "x-handler": "statistics",
                "tags": ["models"],
                "responses": {"200": _json(_ref("Statistics"), "the statistics"), **_errors(*COMMON)},
            },
        },
    }


def _repository_paths() -> dict:
    return {
        "/v2/repository/index": {
            "post": {
                "summary": "The model repository's index: every version the server holds, and its state",
                "x-handler": "repository_index",
                "tags": ["repository"],
                "requestBody": {
                    "content": {
                        JSON: {
                            "schema": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
                            "example": {"ready": True},
                        }
                    }
                },
                "responses": {
                    "200": _json({"type": "array", "items": _ref("RepositoryIndexEntry")}, "the index"),
                    **_errors(400, *COMMON),
                },
            },
        },
        "/v2/repository/models/{name}/load": {
            "post": {
                "summary": "Load a model's versions (explicit model control mode)",
                "x-handler": "load",
                "tags": ["repository"],
                "parameters": _parameters("name"),
                "requestBody": {
                    "content": {
                        JSON: {"schema": LOAD_BODY, "example": {"parameters": {"config": '{"max_batch_size": 4}'}}}
                    }
                },
                "responses": {"200": {"description": "loaded: its versions serve"}, **_errors(400, 404, 503, *COMMON)},
            },
        },
        "/v2/repository/models/{name}/unload": {
            "post": {
                "summary": "Unload a model (explicit model control mode): in-flight requests finish first",
                "x-handler": "unload",
                "tags": ["repository"],
                "parameters": _parameters("name"),
                "requestBody": {"content": {JSON: {"schema": {"type": "object"}, "example": {}}}},
                "responses": {"200": {"description": "unloaded"}, **_errors(400, 404, 503, *COMMON)},
            },
        },
    }


def _logging_paths() -> dict:
    responses = {"200": _json(_ref("LogSettings"), "every setting, as it is now"), **_errors(400, *COMMON)}
    return {
        "/v2/logging": {
            "get": {
                "summary": "The log settings",
                "x-handler": "log_setting",
                "tags": ["logging"],
                "responses": responses,
            },
            "post": {
                "summary": "Change the log settings (in every worker process)",
                "x-handler": "log_setting",
                "tags": ["logging"],
                "requestBody": {"content": {JSON: {"schema": _ref("LogSettingsUpdate"), "example": LOG_EXAMPLE}}},
                "responses": responses,
            },
        },
    }


def _trace_paths() -> dict:
    trace_responses = {"200": _json(_ref("TraceSettings"), "the settings now"), **_errors(400, 404, *COMMON)}
    return {
        "/v2/trace/setting": {
            "get": {
                "summary": "The global trace settings",
                "x-handler": "trace_setting",
                "tags": ["trace"],
                "responses": trace_responses,
            },
            "post": {
                "summary": "Change the global trace settings",
                "x-handler": "trace_setting",
                "tags": ["trace"],
                "requestBody": {"content": {JSON: {"schema": _ref("TraceSettingsUpdate"), "example": TRACE_EXAMPLE}}},
                "responses": trace_responses,
            },
        },
        "/v2/models/{name}/trace/setting": {
            "get": {
                "summary": "A model's trace settings",
                "x-handler": "trace_setting",
                "tags": ["trace"],
                "parameters": _parameters("name"),
                "responses": trace_responses,
            },
            "post": {
                "summary": "Change a model's trace settings",
                "x-handler": "trace_setting",
                "tags": ["trace"],
                "parameters": _parameters("name"),
                "requestBody": {"content": {JSON: {"schema": _ref("TraceSettingsUpdate"), "example": TRACE_EXAMPLE}}},
                "responses": trace_responses,
            },
        },
    }


def operations() -> list[tuple[str, str, str]]:
    """The route table: (method, path, handler) for every documented operation, in the order they are matched."""
    return [
        (method.upper(), path, operation["x-handler"])
        for path, item in document()["paths"].items()
        for method, operation in item.items()
    ]


@functools.cache
def document(example_width: int = 512) -> dict:
    """The OpenAPI 3.0 document of this server's REST API; its request examples ("Try it out") sized for a model
    of ``example_width`` (the served model's d_model)."""
    paths = {
        **_server_paths(),
        **_shared_memory_paths("system"),
        **_shared_memory_paths("cuda"),
        **_model_paths("/v2/models/{name}", ("name",), example_width),
        **_model_paths("/v2/models/{name}/versions/{version}", MODEL, example_width),
    }
    assert set(ERROR_DESCRIPTIONS) >= set(HTTP_STATUS.values())
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "mhaserve REST API",
            "version": mhaserve.__version__,
            "description": (
                "KServe's v2 inference protocol (the Open Inference Protocol) with Triton's extensions, as "
                "mhaserve serves it: a multi-head attention model returning its output and its attention weights. "
                "When the server has a token, every path but the health checks needs `Authorization: Bearer`."
            ),
        },
        "security": [{}, {"bearer": []}],
        "paths": paths,
        "components": {"schemas": SCHEMAS, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
