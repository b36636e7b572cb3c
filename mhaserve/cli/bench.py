"""``mhaserve bench`` and ``mhaserve bench compare``: load tests with SLO gates and reports, and runs compared."""

from __future__ import annotations

import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError

from .common import (
    add_connection_arguments,
    add_point_arguments,
    add_priority_argument,
    add_protocol_argument,
    add_request_arguments,
    add_shared_memory_argument,
    add_weights_arguments,
    check_writable,
    check_writable_folder,
    connection_of,
    count,
    count_list,
    index,
    make_client,
    model_width,
    rate_list,
    require_extra,
    seconds,
    weights_options,
)


def _compare_runs(words: list[str]) -> int:
    """``bench compare A.json B.json [C.json ...]``: each later run against A, point by point."""
    import json

    from mhaserve.loadtest.rounds import compare

    if len(words) < 3 or words[0] != "compare":
        raise UsageError(f"bench takes 'compare A.json B.json [...]' or options only, got {' '.join(words)!r}")
    runs = []
    for path in words[1:]:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except RecursionError:  # nested deeper than the parser goes: no bench file is
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file (JSON nested too deep)") from None
        except (OSError, ValueError) as error:
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file ({error})") from None
        if not isinstance(runs[-1], dict) or not isinstance(runs[-1].get("points"), list):
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file (no list of 'points')")
        try:  # every field compare reads, read before any line is printed
            compare(runs[-1], runs[-1])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            what = f"{type(error).__name__}: {error}"[:200]
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file (a point it holds: {what})") from None
    compared = 0
    for path, run in zip(words[2:], runs[1:], strict=True):
        lines = compare(runs[0], run)
        if not lines:
            print(f"no point of {path} was measured in {words[1]} (same mode, load, shape and outputs)")
            continue
        compared += 1
        print(f"{path} against {words[1]}, after / before:")
        for line in lines:
            print(line)
    return 0 if compared == len(runs) - 1 else 1


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test a server: closed-loop concurrency sweep or open-loop rates; table, JSON/CSV, plots; "
        "'bench compare A.json B.json [...]' compares runs",
    )
    p.add_argument("compare", nargs="*", metavar="compare A.json B.json [...]",
                   help="compare runs' --json files with the first, point by point, instead of measuring")  # fmt: skip
    add_connection_arguments(p)
    add_protocol_argument(p)
    p.add_argument("--model", default="mha", help="model name (default mha)")
    p.add_argument("--version", default="", help="model version (default: the newest ready one)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=count_list, default=None,
                      help="closed loop: e.g. 1,4,16,64 (default 1,4,16)")  # fmt: skip
    load.add_argument("--rate", type=rate_list, default=None, help="open loop: requests/s, e.g. 100,200,400")
    add_request_arguments(p)
    p.add_argument("--sequence", type=count, default=0, metavar="LENGTH", help="each caller grows sequences kept on "
                   "the server, one row a step, to LENGTH rows, then starts another: steps/s, and each step's latency "
                   "by its position (closed loop)")  # fmt: skip
    add_point_arguments(p, duration_s=10.0, warmup_s=2.0)
    p.add_argument("--connections", type=index, default=0, metavar="N", help="gRPC connections in all, the callers "
                   "shared out over them (default: one per client process). A server of several workers spreads "
                   "connections, not calls, over its workers: give at least a few per worker")  # fmt: skip
    p.add_argument("--timeout", type=seconds, default=60.0, help="deadline per request, seconds")
    p.add_argument("--rounds", type=count, default=1, help="measure each point this many times: the median round "
                   "is reported, each figure's lowest and highest beside it (default 1)")  # fmt: skip
    add_shared_memory_argument(p)
    add_priority_argument(p)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--csv", type=Path, help="write the results as CSV")
    p.add_argument("--plot-dir", type=Path, help="write latency_percentiles.png and latency_histogram.png here")
    p.add_argument("--report", type=Path, metavar="FILE.html", help="write one self-contained HTML report: the "
                   "run, the table, SLO verdicts, the server's side and the plots (needs the plot extra)")  # fmt: skip
    p.add_argument("--slo", action="append", default=[], metavar="TARGET", help="a target each point must meet, "
                   "repeatable: p50|p90|p95|p99|p99.9<TIME (ms or s), errors<N%%, throughput>N, breaches=N (answers "
                   "the server's live parity found off float64, at most N); the command exits 1 "
                   "when one is missed (a CI gate), and reports the goodput (requests a second within the latency "
                   "targets)")  # fmt: skip
    add_weights_arguments(p)
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    if args.compare:
        return _compare_runs(args.compare)
    slos = _checked_arguments(args)
    from mhaserve.loadtest import report
    from mhaserve.loadtest.loadgen import Point, Workload, default_processes

    tls, token = connection_of(args)
    with make_client(args, tls, token) as client:
        d_model = model_width(client, args, timeout=10)
        described = _model_described(client, args) if d_model is not None else {}
    if d_model is None:
        return 1
    _note_past_limits(args, described.get("served_with", {}))
    workload = Workload(
        d_model,
        args.batch,
        *args.lengths,
        attn_weights=not args.no_weights,
        model=args.model,
        version=args.version,
        protocol=args.protocol,
        application=args.application or "",
        weights=weights_options(args),
        shared_memory=args.shared_memory,
        sequence_length=args.sequence,
        connections=args.connections,
        priority=args.priority,
    )
    if args.rate:
        points = [Point("open", rate, args.duration, args.warmup) for rate in args.rate]
    else:
        points = [Point("closed", c, args.duration, args.warmup) for c in (args.concurrency or [1, 4, 16])]
    processes = args.processes or default_processes()
    weights = "with attn_weights" if workload.attn_weights else "output only"
    if workload.weights is not None and workload.weights.summaries:
        weights += " and the weights' summaries"
    title = f"{args.url} ({args.protocol}) {args.model} {workload.shape_text} {weights}"
    rounds = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    about = len(points) * args.rounds * (args.warmup + args.duration)
    print(f"mhaserve bench: {title}; {len(points)} points{rounds} x ({args.warmup:g} s warm-up + {args.duration:g} "
          f"s): about {about:g} s, up to {processes} client processes"
          + (f", {args.connections} connections" if args.connections else ""), file=sys.stderr)  # fmt: skip
    results, judged = _measured(args, workload, points, slos, processes, tls, token)
    missed = _judged_lines(args, results, judged, slos)
    meta = {"url": args.url, "model": args.model, "processes": processes, "title": title, "slo": args.slo,
            **report.run_metadata(sys.argv, described), **_parity_of(results)}  # fmt: skip
    _write_outputs(args, results, judged, meta, title, slos)
    from mhaserve.loadtest.slo import summary, summary_lines

    for line in summary_lines(summary(results, slos)) if slos else ():
        print(line)
    if missed:
        print(f"SLO missed: {'; '.join(missed)}")
        return 1
    if slos:
        print(f"SLO held at every point: {', '.join(args.slo)}")
    return 0


def _note_past_limits(args, served_with: dict) -> None:
    """Says before the sweep where the load's requests go past the server's limits, naming the limit and the flag
    that raises it: those requests are refused (RESOURCE_EXHAUSTED), and the run measures the refusals."""
    asked = [("--batch", args.batch, "max_batch_size")]
    if args.sequence:
        asked.append(("--sequence", args.sequence, "max_sequence_length"))
    else:
        asked += [("--lengths", args.lengths[1], "max_q_len"), ("--lengths", args.lengths[1], "max_kv_len")]
    noted = set()
    for flag, size, limit in asked:
        served = served_with.get(limit, "")
        if flag not in noted and served.isdecimal() and size > int(served):
            print(f"note: {flag} asks for up to {size}, past the server's {limit} of {served} (serve "
                  f"--{limit.replace('_', '-')} raises it): such requests are refused, and measured as refusals",
                  file=sys.stderr)  # fmt: skip
            noted.add(flag)


def _checked_arguments(args) -> list:
    """The SLOs, every argument checked (and every output tried) before the sweep: a path that cannot be written
    would otherwise lose its results."""
    if args.connections and args.protocol == "http":
        raise UsageError("--connections is for gRPC: over HTTP/REST each request in flight has a connection of its own")
    if args.sequence:
        if args.rate:
            raise UsageError("--sequence is a closed loop (each caller steps its sequences in order): give "
                             "--concurrency, not --rate")  # fmt: skip
        if args.shared_memory != "none":
            raise UsageError("--sequence sends its one-row steps over the socket; leave out --shared-memory")
        args.lengths = (1, 1)  # a step carries one new row
    from mhaserve.loadtest.slo import parse_slo

    try:
        slos = [parse_slo(text) for text in args.slo]
    except ValueError as error:
        raise UsageError(str(error)) from None
    for asked, flag in ((args.plot_dir, "--plot-dir"), (args.report, "--report")):
        if asked:
            require_extra("plot", flag)
    for path, flag in ((args.json, "--json"), (args.csv, "--csv"), (args.report, "--report")):
        if path is not None:
            check_writable(path, flag)
    if args.plot_dir is not None:
        check_writable_folder(args.plot_dir, "--plot-dir")
    return slos


def _measured(args, workload, points, slos, processes: int, tls, token) -> tuple[list, list]:
    """Each point measured (its rounds merged), a table row each; and per point its SLO verdicts and goodput."""
    from mhaserve.loadtest import report
    from mhaserve.loadtest.loadgen import LoadGenerator
    from mhaserve.loadtest.rounds import of_rounds
    from mhaserve.loadtest.server_side import counters_of
    from mhaserve.loadtest.slo import goodput, verdicts

    results, judged = [], []
    print(report.table_header())
    statistics_client = make_client(args, tls, token)  # the server's side of each point: its statistics, read twice
    with (
        statistics_client,
        LoadGenerator(
            args.url, processes, args.timeout, tls=tls, token=token, counters=counters_of(statistics_client)
        ) as generator,
    ):
        for i, point in enumerate(points, 1):
            print(f"[{i}/{len(points)}] {point.label} ...", file=sys.stderr, flush=True)
            rounds = [generator.measure(workload, point) for _ in range(args.rounds)]
            results.append(of_rounds(rounds) if args.rounds > 1 else rounds[0])
            print(report.table_row(results[-1]), flush=True)
            judged.append({"slo": verdicts(results[-1], slos), "goodput_per_s": goodput(results[-1], slos)})
    return results, judged


def _judged_lines(args, results: list, judged: list, slos: list) -> list[str]:
    """The notes, each round's line, and each point's SLO verdicts printed; returns the SLOs missed."""
    from mhaserve.loadtest import report
    from mhaserve.loadtest.rounds import rounds_line

    for line in report.notes(results):
        print(line)
    for result in results if args.rounds > 1 else ():
        print(rounds_line(result))
    missed = []
    for result, verdict in zip(results, judged, strict=True):
        if slos:
            held = ", ".join(
                f"{v['slo']} {'held' if v['held'] else 'MISSED'} ({v['observed']})" for v in verdict["slo"]
            )
            good = f"; goodput {verdict['goodput_per_s']:.1f}/s" if verdict["goodput_per_s"] is not None else ""
            print(f"{result.point.label}: {held}{good}")
        missed += [f"{v['slo']} at {result.point.label} ({v['observed']})" for v in verdict["slo"] if not v["held"]]
    return missed


def _parity_of(results: list) -> dict:
    """The server's live parity over the run, printed beside the latencies: {"parity": the checks added up, or None
    where it checked none} for the run's record; nothing where its statistics were never read."""
    from mhaserve.loadtest.server_side import parity_line, parity_of_run

    if all(r.server is None for r in results):
        return {}
    parity = parity_of_run([r.server for r in results])
    print(parity_line(parity))
    return {"parity": parity}


def _write_outputs(args, results: list, judged: list, meta: dict, title: str, slos: list) -> None:
    from mhaserve.loadtest import report

    if args.json:
        report.write_json(results, args.json, meta, judged)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.csv:
        report.write_csv(results, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot_dir:
        for path in report.plot(results, args.plot_dir, title, slos):
            print(f"wrote {path}", file=sys.stderr)
    if args.report:
        report.write_html(results, args.report, meta, judged, title, slos)
        print(f"wrote {args.report}", file=sys.stderr)


def _model_described(client, args) -> dict:
    """The model as the server describes it (name, versions, platform, precision) and how the server runs it (its
    provider and settings, from the model's configuration), for the run's record."""
    from google.protobuf import json_format

    from mhaserve.client import RequestFailed

    try:
        metadata, config = client.metadata(timeout=10), client.config(timeout=10)
    except RequestFailed:
        return {"name": args.model}
    if not isinstance(metadata, dict):  # gRPC's messages
        metadata = json_format.MessageToDict(metadata, preserving_proto_field_name=True)
        config = json_format.MessageToDict(config, preserving_proto_field_name=True)
    parameters = {name: p.get("string_value", "") for name, p in config.get("parameters", {}).items()}
    described = {key: metadata[key] for key in ("name", "versions", "platform") if key in metadata}
    described["precision"] = parameters.pop("precision", None)
    for shape in ("d_model", "num_heads", "computes_in"):
        parameters.pop(shape, None)
    provider = {"provider": parameters.pop("provider")} if "provider" in parameters else {}
    return {**described, "served_with": {**provider, **dict(sorted(parameters.items()))}}
