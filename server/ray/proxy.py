"""What Ray Serve's gRPC proxy imports (gRPCOptions.grpc_servicer_functions): the OIP service's method table,
and one correction to the statuses the proxy answers. Kept apart from deployment.py so that the proxy process
loads grpc and the stubs only, not ONNX Runtime.
"""

from __future__ import annotations

import logging

import grpc

from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger("mhaserve.server")

# The path Ray imports, for gRPCOptions.grpc_servicer_functions.
SERVICER_FUNCTION = f"{__name__}.add_inference_service_to_proxy"


def add_inference_service_to_proxy(servicer, server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    answer_replica_deaths_unavailable()


def answer_replica_deaths_unavailable() -> None:
    """A call whose replica dies under it (its node lost) fails in Ray's proxy with a RayActorError, which Ray
    2.60 answers INTERNAL (get_grpc_response_status in ray.serve._private.grpc_util): a status no client retries,
    though the call was inference, idempotent, and the surviving replicas answer it. Answer UNAVAILABLE instead,
    gRPC's "retry" (tests/e2e/test_ray_cluster.py kills a worker node under load and counts on it)."""
    try:
        from ray.exceptions import RayActorError
        from ray.serve._private import proxy
        from ray.serve._private.proxy_request_response import ResponseStatus
    except ImportError as error:  # a Ray whose internals moved: its own statuses stand
        log.warning("replica deaths keep Ray's status (INTERNAL): %s", error)
        return
    ray_status = proxy.get_grpc_response_status
    if getattr(ray_status, "answers_replica_deaths_unavailable", False):
        return

    def status(error: BaseException, request_timeout_s, request_id) -> ResponseStatus:
        died = error if isinstance(error, RayActorError) else getattr(error, "cause", None)
        if isinstance(died, RayActorError):
            return ResponseStatus(
                code=grpc.StatusCode.UNAVAILABLE,
                is_error=True,
                message=f"the replica serving this call is gone ({type(died).__name__}); retry, another replica "
                "answers",
            )
        return ray_status(error, request_timeout_s, request_id)

    status.answers_replica_deaths_unavailable = True
    proxy.get_grpc_response_status = status
