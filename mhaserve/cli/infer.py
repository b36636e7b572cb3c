"""``mhaserve infer`` and ``mhaserve health``: one call to a running server, and its health."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError

from .common import (
    add_connection_arguments,
    add_priority_argument,
    add_protocol_argument,
    add_shared_memory_argument,
    add_weights_arguments,
    connection_of,
    count,
    failure_message,
    index,
    make_client,
    model_width,
    seconds,
    weights_options,
)


def _infer_steps(client, arrays: dict, args) -> int:
    """The query's rows, ``args.steps`` a step, as a sequence: each step's newest row's strongest keys, head 0."""
    import time

    from mhaserve.client import RequestFailed, WeightsOptions

    if set(arrays) != {"query"} or args.shared_memory == "system":
        raise UsageError("--steps sends the query alone (a step's rows are its new keys and values), over the socket")
    query, top = arrays["query"], args.top_k or 3
    with client.sequence() as sequence:
        for start in range(0, query.shape[1], args.steps):
            rows = query[:, start : start + args.steps]
            end = start + rows.shape[1] >= query.shape[1]
            started = time.perf_counter()
            try:
                result = sequence.step(rows, weights=WeightsOptions(top_k=min(top, start + rows.shape[1])), end=end,
                                       timeout=args.timeout)  # fmt: skip
            except RequestFailed as error:
                print(failure_message(error, args), file=sys.stderr)
                return 1
            values, keys = result.top_k
            newest = ", ".join(f"{k} ({v:.2f})" for k, v in zip(keys[0, 0, -1], values[0, 0, -1], strict=True))
            last = start + rows.shape[1] - 1
            span = f"row {last}" if last == start else f"rows {start}..{last}"
            print(f"{span}: {(time.perf_counter() - started) * 1000:7.3f} ms; "
                  f"row {last} attends most to keys {newest} (head 0)")  # fmt: skip
    return 0


def _check_steps_flags(args) -> None:
    """--steps prints each step's strongest keys: the flags that shape or keep a single call's answer do not apply."""
    shaped = [flag for flag, given in (("--heads", args.heads), ("--rows", args.rows), ("--keys", args.keys),
              ("--top-p", args.top_p), ("--weights-precision", args.weights_precision), ("--summaries", args.summaries),
              ("--heatmap", args.heatmap), ("--save", args.save), ("--repeat", args.repeat != 1)) if given]  # fmt: skip
    if shaped:
        raise UsageError(f"--steps prints each step's strongest keys (--top-k of them); {', '.join(shaped)} "
                         "are for a single call: leave out --steps")  # fmt: skip


def add_infer(sub) -> None:
    p = sub.add_parser("infer", help="call a server with random or .npy inputs; print shapes and latency")
    add_connection_arguments(p)
    add_protocol_argument(p)
    p.add_argument("--model", default="mha", help="model name (default mha)")
    p.add_argument("--version", default="", help="model version (default: the newest ready one)")
    p.add_argument("--batch", type=count, default=1, help="batch of the random inputs")
    p.add_argument("--q-len", type=count, default=16, help="query length of the random inputs")
    p.add_argument("--kv-len", type=count, default=None, help="key/value length: cross-attention (default self)")
    for name in ("query", "key", "value", "mask"):
        help = f"{name} from a .npy file, or an .npz (its one array, or the one named {name}, as --save writes)"
        p.add_argument(f"--{name}", type=Path, help=help)
    p.add_argument("--no-weights", action="store_true", help="do not ask for every head's attn_weights")
    p.add_argument("--mean-weights", action="store_true", help="ask for attn_weights_mean [B, Lq, Lk], the weights "
                   "averaged over heads (h times fewer bytes)")  # fmt: skip
    p.add_argument("--repeat", type=count, default=1, help="calls to time (default 1)")
    p.add_argument("--steps", type=count, default=0, metavar="N", help="a sequence instead: the query's rows sent one "
                   "step at a time (N rows a step) to a sequence kept on the server, printing each step's newest row's "
                   "strongest keys (--top-k of them, default 3) as it goes")  # fmt: skip
    p.add_argument("--timeout", type=seconds, default=30.0, help="deadline per call, seconds")
    add_shared_memory_argument(p)
    add_priority_argument(p)
    p.add_argument("--save", type=Path, help="write inputs and outputs to this .npz")
    p.add_argument("--heatmap", type=Path, help="draw one item's attention weights to this .png (needs the plot extra)")
    p.add_argument("--head", type=_head, default=None, help="head for --heatmap, or 'mean' for the mean over "
                   "heads (default: the first head asked for)")  # fmt: skip
    p.add_argument("--item", type=index, default=0, help="batch item for --heatmap and --summaries (default 0)")
    p.add_argument("--seed", type=index, default=0, help="seed of the random inputs")
    add_weights_arguments(p)
    p.set_defaults(run=_run_infer)


def _head(text: str) -> int | str:
    if text == "mean":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a head number or 'mean', got {text!r}") from None


def _load_array(name: str, path: Path):
    """One array for --query/--key/--value/--mask: a .npy, or from an .npz its only array or the one named as the
    flag (``np.savez("in.npz", query=q, mask=m)``); else a one-line usage error."""
    import zipfile

    import numpy as np

    try:
        loaded = np.load(path)
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded:
            names = list(loaded.files)
            if len(names) == 1 or name in names:
                return loaded[names[0] if len(names) == 1 else name]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise UsageError(f"--{name} {path}: not a readable .npy or .npz ({error or type(error).__name__})") from None
    if not names:
        raise UsageError(f"--{name} {path}: an .npz that holds no array")
    held = ", ".join(names)
    raise UsageError(f"--{name} {path}: an .npz of several arrays ({held}) and none named {name!r}; name it so")


def _run_infer(args) -> int:
    import time

    import numpy as np

    from mhaserve.client import RequestFailed

    if args.head is not None and args.heatmap is None:
        raise UsageError("--head chooses the head --heatmap draws: give --heatmap FILE.png too")
    if args.steps:
        _check_steps_flags(args)
    weights = weights_options(args)
    ranked = weights is not None and weights.ranked
    # A heatmap of the mean needs only the mean; one of a head needs the heads' weights, or their top keys.
    mean_weights = args.mean_weights or (args.heatmap is not None and args.head == "mean")
    all_weights = not args.no_weights or (args.heatmap is not None and args.head != "mean" and not ranked)
    tls, token = connection_of(args)
    with make_client(args, tls, token) as client:
        d_model = model_width(client, args, timeout=args.timeout)
        if d_model is None:
            return 1
        rng = np.random.default_rng(args.seed)
        arrays = {name: _load_array(name, getattr(args, name)) for name in ("query", "key", "value", "mask")
                  if getattr(args, name)}  # fmt: skip
        if "query" not in arrays:
            arrays["query"] = rng.standard_normal((args.batch, args.q_len, d_model), dtype=np.float32)
        batch = arrays["query"].shape[0]
        if not args.item < batch:
            raise UsageError(f"--item {args.item}: the batch has items 0..{batch - 1}")
        if args.kv_len and "key" not in arrays:
            arrays["key"] = rng.standard_normal((batch, args.kv_len, d_model), dtype=np.float32)
            arrays["value"] = rng.standard_normal((batch, args.kv_len, d_model), dtype=np.float32)
        if args.steps:
            return _infer_steps(client, arrays, args)
        latencies = []
        regions = client.shared_memory() if args.shared_memory == "system" else contextlib.nullcontext()
        try:
            with regions:
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    result = client.infer(
                        **arrays,
                        attn_weights=all_weights,
                        attn_weights_mean=mean_weights,
                        timeout=args.timeout,
                        weights=weights,
                        shared_memory=regions if args.shared_memory == "system" else None,
                        priority=args.priority,
                    )
                    latencies.append((time.perf_counter() - started) * 1000)
        except RequestFailed as error:
            print(failure_message(error), file=sys.stderr)
            return 1
    outputs = result.outputs
    shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in arrays.items())
    print(f"inputs: {shapes}")
    print("  ".join(f"{name}: {list(array.shape)}" for name, array in outputs.items()))
    print(f"answered by model '{args.model}' version {result.model_version}")
    lat = np.array(latencies)
    print(
        f"latency ms over {len(lat)} calls: p50 {np.percentile(lat, 50):.3f}  p90 {np.percentile(lat, 90):.3f}  "
        f"min {lat.min():.3f}  max {lat.max():.3f} (first call included)"
    )
    for line in _summary_lines(result.summaries, args.item) if result.summaries else ():
        print(line)
    if args.save:
        np.savez(args.save, **arrays, **outputs)
        print(f"saved {args.save}")
    if args.heatmap:
        from mhaserve.cli.heatmap import write_heatmap

        kv_len = arrays.get("key", arrays["query"]).shape[1]
        drawn, what = _heatmap_weights(result, args, weights, kv_len)
        write_heatmap(drawn, args.heatmap, title=f"{args.model}: item {args.item}, {what}")
        print(f"wrote {args.heatmap} (item {args.item}, {what})")
    return 0


def _summary_lines(summaries: dict, item: int) -> list[str]:
    """Each head's last query row of batch item ``item``, summarised."""
    lines = [f"summaries of item {item}, last query row (entropy in nats; sink: the weight on key 0):"]
    for head in range(summaries["entropy"].shape[1]):
        entropy, sink, largest, key = (summaries[name][item, head, -1] for name in ("entropy", "sink", "max",
                                                                                      "max_index"))  # fmt: skip
        lines.append(f"  head {head}: entropy {entropy:.3f}, sink {sink:.4f}, largest {largest:.4f} at key {key}")
    return lines


def _heatmap_weights(result, args, options, kv_len: int):
    """The [Lq', Lk] map to draw for ``--head`` and what it shows: the head's (or the mean's) weights as asked
    for, or its top keys as a sparse map over every key position."""
    import numpy as np

    item = args.item
    if args.head == "mean":
        return result.attn_weights_mean[item], "mean over heads"
    chosen = list(options.heads) if options is not None and options.heads is not None else None
    head = args.head if args.head is not None else (chosen[0] if chosen else 0)
    if chosen is not None and head not in chosen:
        raise UsageError(f"--head {head}: the request asked for heads {','.join(map(str, chosen))} only")
    position = chosen.index(head) if chosen is not None else head
    if result.top_k is not None:
        if not 0 <= position < result.top_k[0].shape[1]:
            raise UsageError(f"--head {head}: the model has heads 0..{result.top_k[0].shape[1] - 1}")
        values, indices = (array[item, position] for array in result.top_k)
        sparse = np.zeros((values.shape[0], kv_len), np.float32)
        rows = np.arange(values.shape[0])[:, None].repeat(values.shape[1], axis=1)
        kept = indices >= 0
        sparse[rows[kept], indices[kept]] = values[kept]
        return sparse, f"head {head}, top keys"
    heads = result.attn_weights.shape[1]
    if not 0 <= position < heads:
        raise UsageError(f"--head {head}: the model has heads 0..{heads - 1} (or 'mean')")
    return result.attn_weights[item, position], f"head {head}"


def add_health(sub) -> None:
    p = sub.add_parser("health", help="ask a server's grpc.health.v1 service; exit 0 only when SERVING")
    add_connection_arguments(p)
    p.add_argument("--timeout", type=seconds, default=3.0, help="deadline of the health check, seconds")
    p.set_defaults(run=_run_health)


def _run_health(args) -> int:
    """For container healthchecks and scripts: one line, and the exit status says it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mhaserve.client.grpc import open_channel

    tls, _ = connection_of(args)  # health needs no token
    with open_channel(args.url, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"{args.url}: {error.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.url}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
