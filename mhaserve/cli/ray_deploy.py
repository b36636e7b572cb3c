"""``mhaserve ray-deploy``: the model as a Ray Serve application on a running Ray cluster."""

from __future__ import annotations

import sys

from mhaserve.contract.errors import UsageError

from .common import add_model_dir, bounded, count, port, positive


def add_ray_deploy(sub) -> None:
    p = sub.add_parser(
        "ray-deploy",
        help="deploy a model folder on a Ray cluster as a Ray Serve application (OIP over Ray's gRPC proxy)",
    )
    add_model_dir(p, "model folder written by 'mhaserve export', at this path on every node", required=True)
    p.add_argument("--address", default="auto", help="the cluster's address, as 'ray start' printed it (default: auto)")
    p.add_argument("--name", default="mha", help="application and model name; clients send it as 'application' "
                   "metadata (default mha)")  # fmt: skip
    p.add_argument("--min-replicas", type=count, default=1, help="replicas kept however idle (default 1)")
    p.add_argument("--max-replicas", type=count, default=2, help="replicas at most, added on load (default 2)")
    p.add_argument("--target-ongoing-requests", type=positive, default=8,
                   help="requests in progress per replica that autoscaling aims at (default 8)")  # fmt: skip
    p.add_argument("--replica-cpus", type=positive, default=1, help="CPUs each replica reserves; ONNX Runtime runs as "
                   "many threads (default 1)")  # fmt: skip
    p.add_argument("--max-replicas-per-node", type=count, default=None, help="spread replicas over at least "
                   "replicas/N nodes (default: Ray's spread, no bound)")  # fmt: skip
    p.add_argument("--grpc-port", type=port, default=9000, help="the proxies' gRPC port (default 9000)")
    p.add_argument("--http-port", type=port, default=8000, help="the proxies' HTTP port (default 8000)")
    p.add_argument("--proxy-location", choices=("EveryNode", "HeadOnly"), default="EveryNode",
                   help="a proxy on every node with a replica, or on the head only (default EveryNode)")  # fmt: skip
    p.add_argument("--replica-port", type=bounded(int, 0, high=65535), default=None, metavar="PORT",
                   help="each replica also serves gRPC itself, as 'mhaserve serve' does (no Ray in a request's path), "
                   "on this port of its node, one replica per node; 0: a free port each (default: off)")  # fmt: skip
    p.set_defaults(run=_run_ray_deploy)


def _reachable(address: str, timeout_s: float = 5.0) -> bool:
    """Whether something listens at HOST:PORT (ray.init would wait for minutes on a wrong address)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _run_ray_deploy(args) -> int:
    from mhaserve.contract.model_dir import ModelDirError, read_manifest

    try:
        read_manifest(args.model_dir)
    except (ModelDirError, ValueError) as error:
        raise UsageError(f"{args.model_dir}: {error}") from None
    if args.min_replicas > args.max_replicas:
        raise UsageError(f"--min-replicas {args.min_replicas} is more than --max-replicas {args.max_replicas}")
    if args.address != "auto" and not _reachable(args.address):
        raise UsageError(f"no Ray cluster answers at --address {args.address} (start one with 'ray start --head')")
    try:
        from mhaserve.server.ray.deployment import deploy, direct_addresses, native_addresses
    except ImportError as error:
        raise UsageError(f"ray-deploy needs Ray Serve: pip install 'mhaserve[ray]' ({error})") from None
    try:
        name = deploy(
            args.model_dir,
            address=args.address,
            name=args.name,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            proxy_location=args.proxy_location,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            replica_cpus=args.replica_cpus,
            max_replicas_per_node=args.max_replicas_per_node,
            native_port=args.replica_port,
        )
    except ConnectionError as error:
        raise UsageError(f"no Ray cluster at --address {args.address}: {error}") from None
    except Exception as error:  # Ray's own failure (a replica that cannot start, a port taken): one line
        message = str(error).strip().splitlines()
        print(f"mhaserve ray-deploy: deploying failed: {type(error).__name__}: {message[-1] if message else ''}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"application '{name}' serves the Open Inference Protocol on the proxies' gRPC port {args.grpc_port}; "
          f"send metadata 'application: {name}' (mhaserve infer/bench --application {name})")  # fmt: skip
    direct = direct_addresses(name)
    if direct:  # the cluster runs Serve's direct ingress: the replicas answer at their own ports too
        print(f"its replicas also answer directly, without the proxy hop, at {', '.join(direct)} (the same "
              "metadata; replicas that start later take other ports)")  # fmt: skip
    if args.replica_port is not None:
        later = (
            f"a replica added later serves at port {args.replica_port} of its node"
            if args.replica_port
            else "a replica added later takes a free port (mhaserve.server.ray.deployment.native_addresses)"
        )
        print(f"its replicas serve natively, each its own gRPC server (no 'application' metadata needed), at "
              f"{', '.join(native_addresses(name)) or 'no address yet'}; {later}")  # fmt: skip
    return 0
