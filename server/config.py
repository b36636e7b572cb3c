"""Every server knob in one place: a default, a command-line flag, and an MHASERVE_* environment variable.

Precedence: flag, then environment variable, then default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

from mhaserve.contract.errors import UsageError
from mhaserve.contract.repository import VersionPolicy

from .trace_settings import parse_trace_config

ENV_PREFIX = "MHASERVE_"


GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


SECTIONS = ("model and repository", "transport", "limits and memory", "batching", "sequences", "devices",
            "security", "shared memory", "lifecycle", "logs and tracing")  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """What a setting's value must be: ``holds(value)``, said as ``--flag must be <said>``."""

    holds: Callable[[object], bool]
    said: str
    show_value: bool = False  # the refusal quotes what came (a word, not a number)


def at_least(minimum: float) -> Rule:
    return Rule(lambda value: value >= minimum, "0 or more" if minimum == 0 else f"at least {minimum}")


def more_than(minimum: float) -> Rule:
    return Rule(lambda value: value > minimum, f"more than {minimum}")


def between(low: int, high: int, why: str) -> Rule:
    return Rule(lambda value: low <= value <= high, f"between {low} and {high} ({why})")


def one_of(*choices: str) -> Rule:
    return Rule(lambda value: value in choices, f"{', '.join(choices[:-1])} or {choices[-1]}", show_value=True)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def setting(default, help: str, *, section: str, rule: Rule | None = None):
    """A setting's default, its help text (``--help`` and the reference documents print it), the section it is
    listed in, and the rule its value must keep (checked wherever it comes from: flag, variable or default)."""
    assert section in SECTIONS, section
    return field(default=default, metadata={"help": help, "section": section, "rule": rule})


@dataclass
class ServerSettings:
    model_dir: Path | None = setting(
        None,
        "model folder written by 'mhaserve export' (default: the embedded default model)",
        section="model and repository",
    )
    model_repository: Path | None = setting(
        None,
        "serve a model repository instead: DIR/<model>/<version>/ folders written by 'mhaserve export "
        "--repository DIR --name NAME'",
        section="model and repository",
    )
    model_control_mode: str = setting(
        "none",
        "none: load the repository at start; poll: also rescan it every --repository-poll-secs (new versions "
        "load, removed ones unload); explicit: load only --load-model at start, then what "
        "RepositoryModelLoad/Unload ask for",
        section="model and repository",
        rule=one_of("none", "poll", "explicit"),
    )
    exit_on_error: bool = setting(
        True,
        "a start that loads no model of the repository ends with exit code 3, naming each version's reason; false: "
        "start anyway, serving none until one loads",
        section="model and repository",
    )
    repository_poll_secs: float = setting(
        15.0, "poll mode: seconds between rescans of the repository", section="model and repository", rule=more_than(0)
    )
    load_model: tuple[str, ...] = setting(
        (),
        "explicit mode: a model to load at start (repeat it, or comma-separate; '*' = all)",
        section="model and repository",
    )
    version_policy: str = setting(
        "latest:1",
        "which versions of each model serve: latest (latest:N for the newest N), all, or specific:V[,V...]",
        section="model and repository",
    )
    host: str = setting("127.0.0.1", "address to listen on", section="transport")
    port: int = setting(8001, "gRPC port (0 = any free port)", section="transport")
    http_port: int = setting(
        8000, "HTTP/REST port, the same protocol as gRPC (0 = any free port, -1 = no HTTP)", section="transport"
    )
    http_read_timeout_s: float = setting(
        30.0,
        "seconds an HTTP request's body may take to arrive; a slower client is answered 504 and dropped",
        section="transport",
        rule=more_than(0),
    )
    http_idle_timeout_s: float = setting(
        75.0, "seconds an HTTP connection may stay open without a request", section="transport", rule=more_than(0)
    )
    http_max_connections: int = setting(
        1000,
        "HTTP connections open at once; beyond, new ones are answered 503 and closed",
        section="transport",
        rule=at_least(1),
    )
    device: str = setting(
        "auto",
        "auto: CUDA when really usable, else CPU with a warning; cuda: refuse to start without it",
        section="devices",
        rule=one_of("auto", "cpu", "cuda"),
    )
    # ONNX Runtime's CUDA provider rounds float32 matrix products' inputs to TF32 (10 bits of mantissa) on
    # tensor cores unless told not to; false asks for exact float32 products.
    cuda_tf32: bool = setting(
        False,
        "on CUDA, let float32 matrix products run in TF32 on tensor cores (ONNX Runtime's own default: inputs "
        "rounded to 10 bits of mantissa, as float16's, which puts the scores of large inputs off by their "
        "magnitude times 1e-3); false (the default): exact float32 products",
        section="devices",
    )
    intra_op_threads: int = setting(0, "ONNX Runtime threads per run (0 = one per core)", section="devices")
    inference_workers: int = setting(
        1, "model runs allowed at once; more than one only helps with spare cores", section="devices", rule=at_least(1)
    )
    # Inference threads run at a lower priority than the gRPC thread, so that when model runs fill every
    # core the server still receives, refuses (RESOURCE_EXHAUSTED) and answers promptly, at the same
    # throughput (BENCHMARKS.md, "Figures behind the server's defaults").
    inference_nice: int = setting(
        10,
        "nice value of the inference threads, ONNX Runtime's included (Linux; 0-19, 0 = same priority as the gRPC"
        " thread that receives, refuses and answers requests)",
        section="devices",
        rule=between(0, 19, "a thread may lower its priority, not raise it"),
    )
    max_batch_size: int = setting(
        32,
        "largest batch a request may carry (RESOURCE_EXHAUSTED beyond); also the most rows dynamic batching "
        "merges into one run",
        section="batching",
        rule=at_least(1),
    )
    dynamic_batching: bool = setting(
        True, "merge concurrent requests, of any lengths, into one model run", section="batching"
    )
    output_only_graph: bool = setting(
        True,
        "run requests that ask for no attention weights on the model folder's output-only graph, where it has "
        "one (faster from about 512 tokens; holds a second copy of the projection weights)",
        section="devices",
    )
    length_aware_batching: bool = setting(
        True,
        "split queued requests of different lengths into runs where padding would cost more than another run (a "
        "cost model fitted at warm-up); false: one run padded to the longest",
        section="batching",
    )
    max_queue_delay_us: int = setting(
        0,
        "how long a partial batch may wait for more requests (0 = run at once when a worker is free; batches "
        "still form under load)",
        section="batching",
        rule=at_least(0),
    )
    max_queue_size: int = setting(
        256,
        "requests allowed to wait for a worker; beyond it RESOURCE_EXHAUSTED at once",
        section="batching",
        rule=at_least(1),
    )
    max_q_len: int = setting(512, "longest query a request may carry", section="limits and memory", rule=at_least(1))
    max_kv_len: int = setting(
        512, "longest key/value a request may carry", section="limits and memory", rule=at_least(1)
    )
    max_message_bytes: int = setting(
        0, "gRPC message size limit, both ways (0 = derived from the limits above)", section="limits and memory"
    )
    # Sequences (Triton's sequence_id/sequence_start/sequence_end): the keys and values kept between steps.
    max_sequences: int = setting(
        1024,
        "sequences live at once (their keys and values kept); beyond, RESOURCE_EXHAUSTED",
        section="sequences",
        rule=at_least(1),
    )
    max_sequences_per_client: int = setting(
        256,
        "sequences one client may hold live of --max-sequences, where the server tells clients apart (named tokens "
        "in --auth-token-file, or client certificates); beyond, RESOURCE_EXHAUSTED",
        section="sequences",
        rule=at_least(1),
    )
    max_sequence_bytes_per_client: int = setting(
        256 << 20,
        "bytes of keys and values one client's sequences may hold of --max-inflight-bytes, where the server tells "
        "clients apart; beyond, RESOURCE_EXHAUSTED",
        section="sequences",
        rule=at_least(1),
    )
    max_sequence_length: int = setting(
        4096, "rows a sequence may grow to; beyond, RESOURCE_EXHAUSTED", section="sequences", rule=at_least(1)
    )
    sequence_idle_timeout_s: float = setting(
        60.0,
        "a sequence with no step for this long is dropped and its memory returned (Triton's "
        "max_sequence_idle_microseconds)",
        section="sequences",
        rule=more_than(0),
    )
    # Per connection. Above max_queue_size, so a burst meets the queue (RESOURCE_EXHAUSTED, which names the
    # limit) before HTTP/2 refuses streams (the client sees UNAVAILABLE "Stream removed").
    max_concurrent_streams: int = setting(1024, "concurrent RPCs per client connection", section="transport")
    grpc_max_connections: int = setting(
        1000,
        "gRPC connections open at once; beyond, new ones are closed before they are read (the client sees UNAVAILABLE)",
        section="transport",
        rule=at_least(1),
    )
    # grpcio's core would receive every open call's request at once, whole, before any handler could count it;
    # read when the handler asks, a request waits unread in HTTP/2's flow-control window instead.
    max_receiving_bytes: int = setting(
        512 << 20,
        "memory gRPC requests still arriving may take: a unary request past --grpc-first-read-ms, and every "
        "ModelStreamInfer stream reading its next request, takes a turn that reserves three times "
        "--max-message-bytes (grpcio's buffers and two copies; one turn at least); with no turn free such a unary "
        "request is refused RESOURCE_EXHAUSTED (retry) and a stream waits for one, its sender held to its window",
        section="limits and memory",
        rule=at_least(1),
    )
    # Small requests (within HTTP/2's 256 KiB stream window, already sent) are read in their first read, a few
    # connections at a time; only a request still arriving after it needs a turn, so a stalled sender never holds
    # them up for longer than this.
    grpc_first_read_ms: float = setting(
        25.0,
        "milliseconds a gRPC request may take to arrive without a receiving turn (see --max-receiving-bytes); a "
        "few connections' requests are read so at once, so what they take is bounded",
        section="transport",
        rule=more_than(0),
    )
    grpc_read_timeout_s: float = setting(
        30.0,
        "seconds a gRPC request may take to arrive from when its read began; a slower one is refused DEADLINE_EXCEEDED",
        section="transport",
        rule=more_than(0),
    )
    max_inference_streams: int = setting(
        64,
        "ModelStreamInfer streams open at once; beyond, RESOURCE_EXHAUSTED",
        section="limits and memory",
        rule=at_least(1),
    )
    max_inference_streams_per_client: int = setting(
        16,
        "ModelStreamInfer streams one client (a connection) may hold open of --max-inference-streams; beyond, "
        "RESOURCE_EXHAUSTED",
        section="limits and memory",
        rule=at_least(1),
    )
    # grpcio receives a stream's next message whole as soon as its read is asked for, and a stream waiting for its
    # next request cannot be told from one receiving it: streams read in receiving turns, and one idle in its turn
    # gives way to those waiting.
    stream_read_hold_s: float = setting(
        1.0,
        "seconds a ModelStreamInfer stream may hold a receiving turn (see --max-receiving-bytes) with no request "
        "arriving while other requests wait for one; then the stream is ended UNAVAILABLE (reopen it) and its "
        "turn handed on",
        section="transport",
        rule=more_than(0),
    )
    stream_idle_timeout_s: float = setting(
        120.0,
        "seconds a ModelStreamInfer stream may wait for its next request; then it is ended DEADLINE_EXCEEDED and "
        "its place freed",
        section="transport",
        rule=more_than(0),
    )
    reuse_port: bool = setting(
        False,
        "share the port with other mhaserve processes (SO_REUSEPORT): the kernel spreads connections over them, "
        "one Python event loop per core",
        section="transport",
    )
    # Every request queued or running counts its inputs and outputs; beyond this RESOURCE_EXHAUSTED, so a
    # burst of large requests meets a clear refusal rather than the kernel's out-of-memory killer.
    max_inflight_bytes: int = setting(
        1 << 30,
        "memory that requests in flight may take (inputs, answers until written, ONNX Runtime's run workspace); "
        "beyond it RESOURCE_EXHAUSTED at once",
        section="limits and memory",
        rule=at_least(1),
    )
    tls_cert_file: Path | None = setting(
        None, "PEM certificate (chain) of the gRPC port; with --tls-key-file turns TLS on", section="security"
    )
    tls_key_file: Path | None = setting(None, "PEM private key of --tls-cert-file", section="security")
    tls_client_ca_file: Path | None = setting(
        None, "PEM CA bundle; clients must present a certificate it signed (mutual TLS)", section="security"
    )
    auth_token_file: Path | None = setting(
        None,
        "file holding the bearer token every RPC but health must carry, or one 'NAME TOKEN' line per client so that "
        "each client's sequences are its own (or set $MHASERVE_AUTH_TOKEN; none: no token)",
        section="security",
    )
    # A client that stops answering HTTP/2 pings (vanished without closing, a network partition) has its
    # connection closed, and its calls cancelled, after keepalive_time_s + keepalive_timeout_s.
    keepalive_time_s: float = setting(
        30.0, "ping each client connection after this many idle seconds", section="transport", rule=more_than(0)
    )
    keepalive_timeout_s: float = setting(
        10.0,
        "close a connection whose ping is not answered within this many seconds",
        section="transport",
        rule=more_than(0),
    )
    # An answer not taken by its client within this (gRPC or HTTP) is dropped, its call cancelled: until
    # then it counts in max_inflight_bytes, so clients that do not read hold the budget, not more.
    write_timeout_s: float = setting(
        30.0,
        "seconds a client may take to read its answer (gRPC and HTTP); a slower one has its call cancelled (HTTP:"
        " its connection closed) and the request is counted CANCELLED",
        section="transport",
        rule=more_than(0),
    )
    drain_seconds: float = setting(
        1.0,
        "on SIGTERM/SIGINT, keep the port open this long, refusing new calls with UNAVAILABLE (retryable), before"
        " closing it",
        section="lifecycle",
        rule=at_least(0),
    )
    grace_seconds: float = setting(
        10.0, "on SIGTERM/SIGINT, time for in-flight requests to finish", section="lifecycle", rule=at_least(0)
    )
    max_health_watchers: int = setting(
        64,
        "health Watch streams open at once (health needs no token); beyond, RESOURCE_EXHAUSTED (Check is not limited)",
        section="limits and memory",
        rule=at_least(1),
    )
    warmup_runs: int = setting(
        2, "model runs at each warm-up shape before reporting ready (0 = none)", section="devices"
    )
    metrics_port: int = setting(
        8002,
        "Prometheus metrics port (0 = any free port, -1 = no endpoint); it serves /metrics only",
        section="transport",
    )
    # Plain HTTP with no token: loopback unless asked, whatever --host is (a scraper elsewhere: its address).
    metrics_host: str = setting(
        "127.0.0.1",
        "address of the metrics port, apart from --host: plain HTTP with no token, so loopback unless a scraper "
        "elsewhere needs it",
        section="transport",
    )
    log_level: str = setting(
        "INFO",
        "DEBUG, INFO, WARNING or ERROR (any case)",
        section="logs and tracing",
        rule=Rule(lambda value: value.upper() in LOG_LEVELS, "DEBUG, INFO, WARNING or ERROR", show_value=True),
    )
    log_format: str = setting(
        "text",
        "text, or json: one JSON object a line (time, level, logger, message, and the request's fields)",
        section="logs and tracing",
        rule=one_of("text", "json"),
    )
    trace_config: tuple[str, ...] = setting(
        (),
        "tracing, as Triton's --trace-config (repeat it): mode=opentelemetry turns it on, rate=N traces one request "
        "in N (default 1000; 0: only requests whose caller's trace is sampled), count=N stops after N traces "
        "(-1: no end), level=OFF|TIMESTAMPS, "
        "opentelemetry,url=HOST:PORT/v1/traces the OTLP endpoint; export is configured by the OTEL_* variables "
        "(needs the tracing extra)",
        section="logs and tracing",
    )
    # Off by default, as in Triton: a registered region is opened with the server's permissions, so any local
    # client able to reach the port could have the server read and write shared-memory objects it may open.
    allow_client_shm: bool = setting(
        False,
        "let clients on this host register system shared-memory regions (objects in /dev/shm) and have inputs read "
        "from and outputs written into them (Triton's system shared-memory extension)",
        section="shared memory",
    )
    client_shm_max_regions: int = setting(
        128,
        "shared-memory regions registered at once; beyond, RESOURCE_EXHAUSTED",
        section="shared memory",
        rule=at_least(1),
    )
    client_shm_max_bytes: int = setting(
        1 << 36,
        "bytes of shared-memory regions registered at once (their windows summed); beyond, RESOURCE_EXHAUSTED",
        section="shared memory",
        rule=at_least(1),
    )
    access_log: bool = setting(
        False,
        "one line per inference request (logger mhaserve.access): protocol, model, version, status, request id, "
        "rows, bytes in and out, queue, compute and total time",
        section="logs and tracing",
    )

    def message_limits(self, d_model: int, num_heads: int) -> tuple[int, int]:
        """(receive, send) byte limits: the configured limit for both, or the largest request and the largest
        response the limits allow. The receive limit is the request's alone: it bounds what any client,
        authenticated or not, can make the server hold (a compressed request counts expanded)."""
        if self.max_message_bytes:
            return self.max_message_bytes, self.max_message_bytes
        b, lq, lk = self.max_batch_size, self.max_q_len, self.max_kv_len
        request = 4 * b * d_model * (lq + 2 * lk) + 8 * b * lq * lk  # FP32 q/k/v, INT64 mask at worst
        response = 4 * b * lq * d_model + 4 * b * (num_heads + 1) * lq * lk  # output, weights, their mean
        envelope = 1 << 20  # headroom for the protobuf envelope
        # gRPC takes the limits as C ints (larger ones failed the start-up), and a protobuf message cannot
        # pass 2 GiB anyway.
        return min(request + envelope, GRPC_MAX_MESSAGE_BYTES), min(response + envelope, GRPC_MAX_MESSAGE_BYTES)


# Each setting's field (its type, help, section and rule), by name.
SETTING_FIELDS = {f.name: f for f in fields(ServerSettings)}


def parse_bool(text: str) -> bool:
    """A switch's value: true or false (any case), one spelling wherever a switch is set, flag or variable."""
    value = text.strip().lower()
    if value in ("true", "false"):
        return value == "true"
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None  # empty (an unset compose variable): not given


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def reader_of(setting: Field):
    """What reads a setting's value from text (a flag, a variable, a model's config.pbtxt parameter)."""
    field_type = setting.type if isinstance(setting.type, str) else setting.type.__name__
    if field_type.startswith("tuple"):
        return _names
    return {"int": int, "float": float, "bool": parse_bool, "str": str}.get(field_type, _optional_path)


def flag_of(name: str) -> str:
    """A setting's command-line flag: max_batch_size is --max-batch-size."""
    return "--" + name.replace("_", "-")


def setting_text(value) -> str:
    """A value as a setting's flag and variable take it: false and true, numbers as written."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per setting, listed by section; its default comes from the environment variable if set."""
    defaults = ServerSettings()
    groups = {section: parser.add_argument_group(section) for section in SECTIONS}
    for f in fields(ServerSettings):
        env = ENV_PREFIX + f.name.upper()
        convert = reader_of(f)
        default = getattr(defaults, f.name)
        if os.environ.get(env):  # set and not empty: Compose passes an unset variable as empty
            try:
                default = convert(os.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env}={os.environ[env]!r}: {exc}")
        repeated = convert is _names  # --load-model a --load-model b,c
        groups[f.metadata["section"]].add_argument(
            flag_of(f.name),
            dest=f.name,
            type=convert,
            default=None if repeated else default,
            action="append" if repeated else "store",
            help=f"{f.metadata['help']} [env {env}; default {shown_default(getattr(defaults, f.name))}]",
        )
        if repeated:
            parser.set_defaults(**{f.name + "_default": default})


def shown_default(default) -> str:
    """A default as the server takes it: false and 0 as such (they are values), none only where none is set."""
    if default is None or default == "" or default == ():
        return "none"
    return ",".join(map(str, default)) if isinstance(default, tuple) else setting_text(default)


def _value(args: argparse.Namespace, name: str):
    value = getattr(args, name)
    if hasattr(args, name + "_default"):  # a repeated flag: its values joined, else the env/default
        return tuple(n for names in value for n in names) if value else getattr(args, name + "_default")
    return value


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    settings = ServerSettings(**{f.name: _value(args, f.name) for f in fields(ServerSettings)})
    # An IPv6 address may come bracketed as in a URL ([::]); sockets take it bare.
    settings.host, settings.metrics_host = (host.removeprefix("[").removesuffix("]") for host in
                                            (settings.host, settings.metrics_host))  # fmt: skip
    for f in fields(ServerSettings):
        rule, value = f.metadata["rule"], getattr(settings, f.name)
        if rule is not None and not rule.holds(value):
            got = f", got {value!r}" if rule.show_value else ""
            raise UsageError(f"{flag_of(f.name)} must be {rule.said}{got}")
    try:
        parse_trace_config(settings.trace_config)
    except ValueError as error:
        raise UsageError(f"--trace-config: {error}") from None
    if settings.model_dir and settings.model_repository:
        raise UsageError("give --model-dir or --model-repository, not both")
    if not settings.model_repository and (settings.model_control_mode != "none" or settings.load_model):
        raise UsageError("--model-control-mode and --load-model need --model-repository")
    if settings.load_model and settings.model_control_mode != "explicit":
        raise UsageError("--load-model needs --model-control-mode explicit (the other modes load every model)")
    try:
        VersionPolicy.parse(settings.version_policy)
    except ValueError as error:
        raise UsageError(f"--version-policy: {error}") from None
    return settings
