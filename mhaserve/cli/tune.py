"""``mhaserve tune``: the server settings that meet an SLO at the most throughput, searched on this machine."""

from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError
from mhaserve.contract.repository import MODEL_CONFIG_FILE

from .common import (
    add_model_dir,
    add_point_arguments,
    add_request_arguments,
    check_writable,
    count,
    count_list,
    index,
    rate_list,
    require_extra,
)


def add_tune(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="search the server's settings (batching, queue delay, threads, workers) for the most throughput "
        "within an SLO, each candidate served by a real server process on this machine",
    )
    add_model_dir(p, "the model folder to serve (default: the embedded default model)", required=False)
    p.add_argument("--model-repository", type=Path, default=None, help="serve a repository instead; with --model")
    p.add_argument("--model", default="mha", help="the model to load the requests at (default mha)")
    p.add_argument("--slo", action="append", default=[], metavar="TARGET",
                   help="a target the chosen setting must meet, repeatable, as bench takes it: p99<20ms, "
                   "errors<1%%, throughput>N")  # fmt: skip
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=count_list, default=None, help="closed loop callers, e.g. 16 or 4,16 "
                      "(default 16)")  # fmt: skip
    load.add_argument("--rate", type=rate_list, default=None, help="open loop: requests/s, e.g. 500,1000")
    add_request_arguments(p)
    p.add_argument("--search", choices=("quick", "full"), default="quick", help="quick: every pairing of queue "
                   "delay and batch cap, then one knob at a time (default); full: every distinct setting")  # fmt: skip
    p.add_argument("--also-model", action="append", type=Path, default=[], metavar="DIR",
                   help="another export of the same model (float16, int8) tried as a knob of its own; int8 only "
                   "where this CPU has 8-bit dot-product instructions (repeatable)")  # fmt: skip
    p.add_argument("--knobs", default=None, metavar="NAME,...", help="search only these settings, e.g. "
                   "max_batch_size,max_queue_delay_us (default: every one that applies here)")  # fmt: skip
    p.add_argument("--repeats", type=count, default=2, help="measure each candidate's points this many times; the "
                   "median is kept, with its spread (default 2)")  # fmt: skip
    p.add_argument("--confirm", type=index, default=3, metavar="ROUNDS", help="measure the search's best and the "
                   "defaults again side by side, alternating, this many rounds; the best is kept only if it wins "
                   "most (default 3; 0: keep the search's best as measured)")  # fmt: skip
    add_point_arguments(p, duration_s=4.0, warmup_s=1.0)
    p.add_argument("--server-flags", default="", metavar="'FLAGS'", help="flags every candidate's server gets, "
                   "e.g. '--max-q-len 1024' (quoted)")  # fmt: skip
    p.add_argument("--env-file", type=Path, default=Path("mhaserve-tuned.env"), help="where the chosen setting "
                   "is written as MHASERVE_* variables (default mhaserve-tuned.env)")  # fmt: skip
    p.add_argument("--write-model-config", action="store_true", help="also write the chosen setting as the "
                   "model's config.pbtxt, where the server reads it (the model folder, or its folder in the "
                   "repository)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write every candidate's figures as JSON")
    p.add_argument("--report", type=Path, metavar="FILE.html", help="write an HTML report with the throughput-p99 "
                   "plot (needs the plot extra)")  # fmt: skip
    p.set_defaults(run=_run_tune)


def _run_tune(args) -> int:
    slos, server_flags = _checked_arguments(args)
    from mhaserve.loadtest import tune_report
    from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
    from mhaserve.loadtest.tune import CandidateRunner, full_sweep, knobs_for, quick_plan
    from mhaserve.server.process import free_port

    if args.rate:
        points = [Point("open", rate, args.duration, args.warmup) for rate in args.rate]
    else:
        points = [Point("closed", c, args.duration, args.warmup) for c in (args.concurrency or [16])]
    # A connection per caller (16 for rates), as many clients make: a server of several workers spreads
    # connections, not calls, so the load generator's default of one per client process would reach few workers.
    callers = 16 if args.rate else max(int(point.load) for point in points)
    workload = Workload(
        0, args.batch, *args.lengths, attn_weights=not args.no_weights, model=args.model, connections=callers
    )
    knobs = _chosen_knobs(args, knobs_for(workload))
    model_args, served, config_path = _served_model(args)
    planned = quick_plan(knobs) if args.search == "quick" else len(full_sweep(knobs))
    per_candidate = 3 + len(points) * args.repeats * (args.warmup + args.duration)
    processes = args.processes or default_processes()
    print(f"mhaserve tune: {args.search} search over {', '.join(k.flag for k in knobs)}; up to {planned} candidates x "
          f"{len(points)} points x {args.repeats} repeats: about {planned * per_candidate / 60:.0f} min "
          f"(Ctrl-C stops and keeps what was measured)", file=sys.stderr)  # fmt: skip
    port = free_port()
    # SIGTERM as Ctrl-C: the candidate's server and the client processes are stopped, what was measured reported.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with LoadGenerator(f"127.0.0.1:{port}", processes, timeout_s=60.0) as generator:
        runner = CandidateRunner([*model_args, "--warmup-runs", "2", *server_flags], workload, points, slos,
                                 args.repeats, generator, port)  # fmt: skip
        measured, interrupted = _measured(args, knobs, runner, planned)
        if not measured:
            return 130 if interrupted else 1
        run = tune_report.TuneRun(measured, slos, points, runner.workload, args.search, served, interrupted,
                                  sys.argv)  # fmt: skip
        _confirm_leader(args, run, runner)
    for line in run.lines():
        print(line)
    _write_outputs(args, run, config_path)
    if run.interrupted:
        return 130
    return 0 if run.chosen is not None else 1


def _checked_arguments(args) -> tuple[list, list[str]]:
    """The SLOs and the server's flags, every argument checked (and every output tried) before anything runs."""
    from mhaserve.loadtest.slo import parse_slo

    try:
        slos = [parse_slo(text) for text in args.slo]
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not slos:
        raise UsageError("give at least one --slo, e.g. --slo 'p99<20ms': tune looks for the most throughput within it")
    if args.model_dir is not None and args.model_repository is not None:
        raise UsageError("give a model folder or --model-repository, not both")
    for folder in (args.model_dir, args.model_repository):
        if folder is not None and not folder.is_dir():
            raise UsageError(f"{folder}: no such folder")
    if args.report:
        require_extra("plot", "--report")
    for path, flag in ((args.env_file, "--env-file"), (args.json, "--json"), (args.report, "--report")):
        if path is not None:  # before any candidate runs, not after
            check_writable(path, flag)
    try:
        return slos, shlex.split(args.server_flags)
    except ValueError as error:
        raise UsageError(f"--server-flags {args.server_flags!r}: {error}") from None


def _chosen_knobs(args, knobs: list) -> list:
    """The settings to try: those that apply to this machine and workload, the other exports of --also-model, and
    of them the ones --knobs names."""
    if args.also_model:
        from mhaserve.contract.cpu import int8_support
        from mhaserve.contract.model_dir import ModelDirError
        from mhaserve.loadtest.tune import exports_knob

        if args.model_repository is not None or args.model_dir is None:
            raise UsageError("--also-model takes other exports of the model folder given first, not of a repository "
                             "or the default model")  # fmt: skip
        try:
            exports, left_out = exports_knob(args.model_dir, args.also_model, int8_support().usable)
        except ModelDirError as error:
            raise UsageError(f"--also-model: {error}") from None
        for line in left_out:
            print(f"mhaserve tune: {line}", file=sys.stderr)
        knobs += [exports] if exports else []
    if args.knobs is not None:
        asked = [name.strip().replace("-", "_") for name in args.knobs.split(",") if name.strip()]
        unknown = [name for name in asked if name not in {k.name for k in knobs}]
        if unknown or not asked:
            raise UsageError(f"--knobs {args.knobs!r}: expected names among {', '.join(k.name for k in knobs)} "
                             "(the settings that apply to this machine and workload)")  # fmt: skip
        knobs = [k for k in knobs if k.name in asked]
    return knobs


def _served_model(args) -> tuple[list[str], str, Path]:
    """The server's flags naming the model tuned, how the report names it, and the config.pbtxt a tuned setting
    would be written to (refused where one already sets how the model is served)."""
    if args.model_repository is not None:
        model_args = ["--model-repository", str(args.model_repository)]
        served = f"--model-repository {args.model_repository}"
        config_path = args.model_repository / args.model / MODEL_CONFIG_FILE
    else:
        model_dir = args.model_dir
        if model_dir is None:
            from mhaserve.export.default_model import ensure_default_model

            model_dir = ensure_default_model()
        model_args = ["--model-dir", str(model_dir)]
        served = f"--model-dir {model_dir}"
        config_path = model_dir / MODEL_CONFIG_FILE
    for config in (config_path, *(folder / MODEL_CONFIG_FILE for folder in args.also_model)):
        if _sets_settings(config):  # it would override every candidate's flags
            raise UsageError(f"{config} sets how the model is served, over any candidate's flags: tune a copy of "
                             "the model without it (or move it aside), then keep the setting tune finds")  # fmt: skip
    return model_args, served, config_path


def _measured(args, knobs: list, runner, planned: int) -> tuple[list, bool]:
    """Each candidate measured, a progress line each; and whether Ctrl-C stopped the search."""
    from mhaserve.loadtest import tune_report
    from mhaserve.loadtest.tune import full_sweep, quick_search

    measured = []
    candidates = quick_search(knobs, runner) if args.search == "quick" else map(runner, full_sweep(knobs))
    try:
        for result in candidates:
            measured.append(result)
            print(tune_report.progress_line(len(measured), planned, result, measured), file=sys.stderr,
                  flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print(f"stopped after {len(measured)} candidates: reporting what was measured", file=sys.stderr)
        return measured, True
    return measured, False


def _confirm_leader(args, run, runner) -> None:
    """--confirm rounds of the leader against the defaults, alternating, which then decide."""
    from mhaserve.loadtest import tune_report
    from mhaserve.loadtest.tune import Candidate, confirm

    leader = run.leader
    if run.interrupted or not args.confirm or leader is None or not leader.candidate.changed:
        return
    run.confirmation = []
    try:
        for number, (defaults, best) in enumerate(confirm(leader.candidate, Candidate(()), runner, args.confirm), 1):
            run.confirmation.append((defaults, best))
            print(f"[confirm {number}/{args.confirm}] {leader.candidate.label}: "
                  f"{tune_report.within_slo(best)} against the defaults' {tune_report.within_slo(defaults)}",
                  file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        run.interrupted = True
        print("stopped while confirming: the rounds measured decide", file=sys.stderr)


def _write_outputs(args, run, config_path: Path) -> None:
    """The env file, and the config.pbtxt, JSON and HTML report asked for."""
    chosen = run.chosen
    run.write_env(args.env_file)
    print(f"wrote {args.env_file}", file=sys.stderr)
    if args.write_model_config and chosen is not None:
        chosen_dir = dict(chosen.candidate.changed).get("model_dir")
        config_path = chosen_dir / MODEL_CONFIG_FILE if chosen_dir else config_path
        run.write_model_config(config_path, args.model)
        print(f"wrote {config_path}: the model is served so; serve it: {run.serve_command(chosen, config_path)}")
    if args.json:
        run.write_json(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.report:
        run.write_html(args.report)
        print(f"wrote {args.report}", file=sys.stderr)


def _sets_settings(config: Path) -> bool:
    """Whether a model's config.pbtxt sets any setting (export's, every setting commented out, sets none)."""
    if not config.exists():
        return False
    from mhaserve.server.config import ServerSettings
    from mhaserve.server.model_config import ModelConfigError, model_settings

    try:
        return bool(model_settings(ServerSettings(), config.parent).configured)
    except ModelConfigError as error:
        raise UsageError(str(error)) from None
