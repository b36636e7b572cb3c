"""Every server knob in one place: a default, a command-line flag, and an MHASERVE_* environment variable.

Precedence: flag, then environment variable, then default.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from mhaserve.contract.errors import UsageError
from mhaserve.contract.repository import VersionPolicy

from .cores import usable_cores
from .trace_settings import parse_trace_config

ENV_PREFIX = "MHASERVE_"


GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


@dataclass(frozen=True)
class Rule:
    """What a setting's value must be: ``holds(value)``, said as ``--flag must be <said>``."""

    holds: Callable[[object], bool]
    said: str
    show_value: bool = False  # the refusal quotes what came (a word, not a number)
    why: Callable[[], str] | None = None  # what the refusal adds, read when it is made (the cores there are now)

    def refusal(self, value) -> str:
        """``must be <said>[, got <value>][ (<why>)]``: the end of a refusal's line, after the setting's name."""
        got = f", got {value!r}" if self.show_value else ""
        return f"must be {self.said}{got}" + (f" ({self.why()})" if self.why else "")


def at_least(minimum: float) -> Rule:
    return Rule(lambda value: value >= minimum, "0 or more" if minimum == 0 else f"at least {minimum}")


def more_than(minimum: float) -> Rule:
    return Rule(lambda value: value > minimum, f"more than {minimum}")


def between(low: int, high: int, why: str) -> Rule:
    return Rule(lambda value: low <= value <= high, f"between {low} and {high} ({why})")


def one_of(*choices: str) -> Rule:
    return Rule(lambda value: value in choices, f"{', '.join(choices[:-1])} or {choices[-1]}", show_value=True)


def web_origins(text: str) -> list[str]:
    """The origins of --http-cors-origins: '*', or scheme://host[:port] each, as a browser sends them in Origin."""
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def _are_web_origins(text: str) -> bool:
    origins = web_origins(text)
    return origins == ["*"] or all(re.fullmatch(r"https?://[^/:\s]+(:\d{1,5})?", origin) for origin in origins)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def setting(default, help: str, *, rule: Rule | None = None):
    """A setting's default, its help text (``--help`` and the reference documents print it), and the rule its
    value must keep (checked wherever it comes from: flag, variable, default or a model's config.pbtxt). Its
    section is the class that declares it."""
    return field(default=default, metadata={"help": help, "rule": rule})


class Section:
    """A section of the settings: its fields, its title (--help and the settings reference list them under it),
    and its rules: each field's own, and ``check`` for those across its fields."""

    title: ClassVar[str]

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        return tuple(name for name in cls.__annotations__ if name != "title")

    def check(self) -> None:
        """Rules across this section's fields (UsageError naming the flags); none by default."""


@dataclass
class RepositorySettings(Section):
    """The model folder or the repository served, and how the repository is loaded and watched."""

    title: ClassVar[str] = "model and repository"

    model_dir: Path | None = setting(
        None,
        "model folder written by 'mhaserve export' (default: the embedded default model)",
    )
    model_repository: Path | None = setting(
        None,
        "serve a model repository instead: DIR/<model>/<version>/ folders written by 'mhaserve export "
        "--repository DIR --name NAME'",
    )
    model_control_mode: str = setting(
        "none",
        "none: load the repository at start; poll: also rescan it every --repository-poll-secs (new versions "
        "load, removed ones unload); explicit: load only --load-model at start, then what "
        "RepositoryModelLoad/Unload ask for",
        rule=one_of("none", "poll", "explicit"),
    )
    exit_on_error: bool = setting(
        True,
        "a start that loads no model of the repository ends with exit code 3, naming each version's reason; false: "
        "start anyway, serving none until one loads",
    )
    repository_poll_secs: float = setting(
        15.0, "poll mode: seconds between rescans of the repository", rule=more_than(0)
    )
    load_model: tuple[str, ...] = setting(
        (),
        "explicit mode: a model to load at start (repeat it, or comma-separate; '*' = all)",
    )
    version_policy: str = setting(
        "latest:1",
        "which versions of each model serve: latest (latest:N for the newest N), all, or specific:V[,V...] (a "
        "model's config.pbtxt may choose its own)",
        rule=Rule(
            VersionPolicy.holds, "latest, latest:N, all or specific:V[,V...] (N and each V 1 or more)", show_value=True
        ),  # fmt: skip
    )

    def check(self) -> None:
        if self.model_dir and self.model_repository:
            raise UsageError("give --model-dir or --model-repository, not both")
        if not self.model_repository and (self.model_control_mode != "none" or self.load_model):
            raise UsageError("--model-control-mode and --load-model need --model-repository")
        if self.load_model and self.model_control_mode != "explicit":
            raise UsageError("--load-model needs --model-control-mode explicit (the other modes load every model)")


@dataclass
class TransportSettings(Section):
    """The ports, connections and timeouts of gRPC, HTTP/REST and the metrics endpoint."""

    title: ClassVar[str] = "transport"

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8001, "gRPC port (0 = any free port)", rule=between(0, 65535, "a TCP port; 0: any free one"))
    http_port: int = setting(
        8000,
        "HTTP/REST port, the same protocol as gRPC (0 = any free port, -1 = no HTTP)",
        rule=between(-1, 65535, "a TCP port; 0: any free one; -1: no HTTP"),
    )
    http_read_timeout_s: float = setting(
        30.0,
        "seconds an HTTP request's body may take to arrive; a slower client is answered 504 and dropped",
        rule=more_than(0),
    )
    http_idle_timeout_s: float = setting(
        75.0, "seconds an HTTP connection may stay open without a request", rule=more_than(0)
    )
    http_max_connections: int = setting(
        1000,
        "HTTP connections open at once; beyond, new ones are answered 503 and closed",
        rule=at_least(1),
    )
    # A page's script may read a cross-origin answer only where the server says so (CORS): a browser page drawing
    # the attention weights calls the API from its own origin.
    http_cors_origins: str = setting(
        "",
        "web page origins allowed to call the HTTP/REST API from a browser (CORS), comma-separated "
        "scheme://host[:port], or * for any; none by default",
        rule=Rule(_are_web_origins, "'*' or origins like https://host:8443, comma-separated", show_value=True),
    )
    # Per connection. Above max_queue_size, so a burst meets the queue (RESOURCE_EXHAUSTED, which names the
    # limit) before HTTP/2 refuses streams (the client sees UNAVAILABLE "Stream removed").
    max_concurrent_streams: int = setting(1024, "concurrent RPCs per client connection", rule=at_least(1))
    grpc_max_connections: int = setting(
        1000,
        "gRPC connections open at once; beyond, new ones are closed before they are read (the client sees UNAVAILABLE)",
        rule=at_least(1),
    )
    # Small requests (within a stream's HTTP/2 window, grpc/receipt.py, already sent) are read in their first read,
    # a few connections at a time; only a request still arriving after it needs a turn, so a stalled sender never holds
    # them up for longer than this.
    grpc_first_read_ms: float = setting(
        25.0,
        "milliseconds a gRPC request may take to arrive without a receiving turn (see --max-receiving-bytes), and "
        "then wait for one while all are taken (a connection's first requests up to --stream-read-hold-s, longer where "
        "its own requests hold the turns or it has delivered one whole); a few connections' requests are read so at "
        "once, so what they take is bounded",
        rule=more_than(0),
    )
    grpc_read_timeout_s: float = setting(
        30.0,
        "seconds a gRPC request may take to arrive from when its read began; a slower one is refused DEADLINE_EXCEEDED",
        rule=more_than(0),
    )
    # grpcio receives a stream's next message whole as soon as its read is asked for, and a stream waiting for its
    # next request cannot be told from one receiving it: streams read in receiving turns, and one idle in its turn
    # gives way to those waiting.
    stream_read_hold_s: float = setting(
        1.0,
        "seconds a read may hold a receiving turn (see --max-receiving-bytes) with its request not arrived while "
        "other requests wait for one: then a ModelStreamInfer stream is ended UNAVAILABLE (reopen it), and a unary "
        "request that a caller of proven standing waits behind is refused RESOURCE_EXHAUSTED as a slow sender; the "
        "turn is handed on",
        rule=more_than(0),
    )
    stream_idle_timeout_s: float = setting(
        120.0,
        "seconds a ModelStreamInfer stream may wait for its next request; then it is ended DEADLINE_EXCEEDED and "
        "its place freed",
        rule=more_than(0),
    )
    reuse_port: bool = setting(
        False,
        "share the port with other mhaserve processes (SO_REUSEPORT): the kernel spreads connections over them, "
        "one Python event loop per core",
    )
    # A client that stops answering HTTP/2 pings (vanished without closing, a network partition) has its
    # connection closed, and its calls cancelled, after keepalive_time_s + keepalive_timeout_s.
    keepalive_time_s: float = setting(
        30.0, "ping each client connection after this many idle seconds", rule=more_than(0)
    )
    keepalive_timeout_s: float = setting(
        10.0,
        "close a connection whose ping is not answered within this many seconds",
        rule=more_than(0),
    )
    # An answer not taken by its client within this (gRPC or HTTP) is dropped, its call cancelled: until
    # then it counts in max_inflight_bytes, so clients that do not read hold the budget, not more.
    write_timeout_s: float = setting(
        30.0,
        "seconds a client may take to read its answer (gRPC and HTTP); a slower one has its call cancelled (HTTP:"
        " its connection closed) and the request is counted CANCELLED",
        rule=more_than(0),
    )
    metrics_port: int = setting(
        8002,
        "Prometheus metrics port (0 = any free port, -1 = no endpoint); it serves /metrics only",
        rule=between(-1, 65535, "a TCP port; 0: any free one; -1: no endpoint"),
    )
    # Plain HTTP with no token: loopback unless asked, whatever --host is (a scraper elsewhere: its address).
    metrics_host: str = setting(
        "127.0.0.1",
        "address of the metrics port, apart from --host: plain HTTP with no token, so loopback unless a scraper "
        "elsewhere needs it",
    )


@dataclass
class LimitSettings(Section):
    """What one request may carry, and the memory requests and connections may take."""

    title: ClassVar[str] = "limits and memory"

    max_q_len: int = setting(512, "longest query a request may carry", rule=at_least(1))
    max_kv_len: int = setting(512, "longest key/value a request may carry", rule=at_least(1))
    max_message_bytes: int = setting(
        0,
        "gRPC message size limit, both ways (0 = derived from the limits above)",
        rule=between(0, GRPC_MAX_MESSAGE_BYTES, "0: derived; gRPC takes no larger limit"),
    )
    # grpcio's core would receive every open call's request at once, whole, before any handler could count it;
    # read when the handler asks, a request waits unread in HTTP/2's flow-control window instead.
    max_receiving_bytes: int = setting(
        512 << 20,
        "memory gRPC requests still arriving may take: a unary request past --grpc-first-read-ms, and every "
        "ModelStreamInfer stream reading its next request, takes a turn that reserves three times "
        "--max-message-bytes (grpcio's buffers and two copies; one turn at least); with no turn free such a unary "
        "request waits for one in its first read (see --grpc-first-read-ms) and a stream waits in line, its sender "
        "held to its window",
        rule=at_least(1),
    )
    max_inference_streams: int = setting(
        64,
        "ModelStreamInfer streams open at once; beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    max_inference_streams_per_client: int = setting(
        16,
        "ModelStreamInfer streams one client (a connection) may hold open of --max-inference-streams; beyond, "
        "RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    # Every request queued or running counts its inputs and outputs; beyond this RESOURCE_EXHAUSTED, so a
    # burst of large requests meets a clear refusal rather than the kernel's out-of-memory killer.
    max_inflight_bytes: int = setting(
        1 << 30,
        "memory that requests in flight may take (inputs, answers until written, ONNX Runtime's run workspace), in "
        "each serving process (with --workers N, each worker's own: N times this in all). A request that does not "
        "fit yet waits, received, for the memory of those before it (while requests run, half is kept for "
        "requests received and waiting); RESOURCE_EXHAUSTED where waiting cannot help (larger than this, or those "
        "waiting already hold their half)",
        rule=at_least(1),
    )
    max_health_watchers: int = setting(
        64,
        "health Watch streams open at once (health needs no token); beyond, RESOURCE_EXHAUSTED (Check is not limited)",
        rule=at_least(1),
    )


@dataclass(frozen=True)
class LevelPolicy:
    """One priority level's own queue policy (Triton's ModelQueuePolicy in priority_queue_policy): in place of the
    model's for its requests, 0 meaning no bound as in Triton."""

    max_queue_size: int = 0  # its requests waiting at once (within the queue's --max-queue-size)
    default_timeout_microseconds: int = 0
    allow_timeout_override: bool = False


LEVEL_POLICY_FORMAT = "LEVEL:max_queue_size=N,default_timeout_microseconds=N,allow_timeout_override=true[;LEVEL:...]"


def level_policies(text: str) -> dict[int, LevelPolicy]:
    """--priority-queue-policy read: each level named and its policy (ValueError saying what is wrong)."""
    policies: dict[int, LevelPolicy] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        level_text, _, fields_text = part.partition(":")
        if not level_text.strip().isdigit() or int(level_text) < 1:
            raise ValueError(f"{part!r}: expected {LEVEL_POLICY_FORMAT} (levels from 1)")
        level, values = int(level_text), {}
        for assignment in filter(None, (a.strip() for a in fields_text.split(","))):
            name, _, value = assignment.partition("=")
            if name not in LevelPolicy.__dataclass_fields__:
                raise ValueError(f"level {level}: {name!r} is not one of {', '.join(LevelPolicy.__dataclass_fields__)}")
            try:
                is_switch = name == "allow_timeout_override"
                values[name] = parse_bool(value) if is_switch else _whole_number(value, name, level)
            except argparse.ArgumentTypeError as error:
                raise ValueError(f"level {level}: {name} {error}") from None
        if level in policies:
            raise ValueError(f"level {level} is given twice")
        policies[level] = LevelPolicy(**values)
    return policies


def _whole_number(text: str, name: str, level: int) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"level {level}: {name} must be 0 or more, got {text!r}")
    return int(text)


def priority_problem(levels: int, default: int, policies: str) -> tuple[str, str] | None:
    """The setting of the queue's levels that does not fit ``levels`` (a default level outside them, as Triton checks
    it, or a level's policy past the last), and what is wrong with it; None where they fit."""
    if levels and not 1 <= default <= levels:
        return "default_priority_level", f"{default} is not a level of the {levels} (1 to {levels})"
    named = sorted(level_policies(policies))
    if named and named[-1] > levels:
        return "priority_queue_policy", f"names level {named[-1]}, past the last of {levels} priority levels"
    return None


def _are_level_policies(text: str) -> bool:
    try:
        level_policies(text)
    except ValueError:
        return False
    return True


@dataclass
class BatchingSettings(Section):
    """How concurrent requests are merged into model runs."""

    title: ClassVar[str] = "batching"

    max_batch_size: int = setting(
        32,
        "largest batch a request may carry (RESOURCE_EXHAUSTED beyond); also the most rows dynamic batching "
        "merges into one run",
        rule=at_least(1),
    )
    dynamic_batching: bool = setting(True, "merge concurrent requests, of any lengths, into one model run")
    length_aware_batching: bool = setting(
        True,
        "split queued requests of different lengths into runs where padding would cost more than another run (a "
        "cost model fitted at warm-up); false: one run padded to the longest",
    )
    run_cost_cache: bool = setting(
        True,
        "keep the cost model that length-aware batching fits at warm-up (seconds of model runs) in the cache "
        "folder ($MHASERVE_CACHE/run-costs, else the user's cache folder's mhaserve/run-costs), and reuse it at a "
        "later start of the same graph on the same CPU with the same threads; false: fit at every start",
    )
    max_queue_delay_us: int = setting(
        0,
        "how long a partial batch may wait for more requests (0 = run at once when a worker is free; batches "
        "still form under load)",
        rule=at_least(0),
    )
    max_queue_size: int = setting(
        256,
        "requests allowed to wait for a worker; beyond it RESOURCE_EXHAUSTED at once",
        rule=at_least(1),
    )
    queue_timeout_us: int = setting(
        0,
        "microseconds a request may wait in its model's queue for a run; past it, refused UNAVAILABLE (the server "
        "is busy: retry) rather than computed late (0: no bound; Triton's default_timeout_microseconds)",
        rule=at_least(0),
    )
    allow_timeout_override: bool = setting(
        False,
        "a request's own 'timeout' parameter (microseconds, as tritonclient's infer(timeout=) sends it) may shorten "
        "--queue-timeout-us, never lengthen it (Triton's allow_timeout_override)",
    )
    priority_levels: int = setting(
        0,
        "priority levels of the queue (0: none, requests in the order they come): a request's 'priority' parameter "
        "(1 first, as tritonclient's infer(priority=) sends it) places it ahead of every waiting request of a later "
        "level; 0 or a level past the last takes --default-priority-level (Triton's priority_levels)",
        rule=between(0, 1 << 20, "0: none"),
    )
    default_priority_level: int = setting(
        0,
        "the level of a request that names none, 1 to --priority-levels (Triton's default_priority_level)",
        rule=at_least(0),
    )
    priority_queue_policy: str = setting(
        "",
        f"levels with a queue policy of their own (Triton's priority_queue_policy), {LEVEL_POLICY_FORMAT}: a level's "
        "requests wait as its policy says (0: no bound; at most --max-queue-size in all) in place of "
        "--queue-timeout-us and --allow-timeout-override; the other levels as those say",
        rule=Rule(_are_level_policies, LEVEL_POLICY_FORMAT, show_value=True),
    )

    def check(self) -> None:
        problem = priority_problem(self.priority_levels, self.default_priority_level, self.priority_queue_policy)
        if problem is not None:
            setting, said = problem
            raise UsageError(f"{flag_of(setting)} {said}")


@dataclass
class SequenceSettings(Section):
    """The sequences kept between steps: how many, how large, how long."""

    title: ClassVar[str] = "sequences"

    # Sequences (Triton's sequence_id/sequence_start/sequence_end): the keys and values kept between steps.
    max_sequences: int = setting(
        1024,
        "sequences live at once (their keys and values kept), in each serving process (with --workers N, each "
        "worker's own); beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    max_sequences_per_client: int = setting(
        256,
        "sequences one client may hold live of --max-sequences, where the server tells clients apart (named tokens "
        "in --auth-token-file, or client certificates); beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    max_sequence_bytes_per_client: int = setting(
        256 << 20,
        "bytes of keys and values one client's sequences may hold of --max-inflight-bytes, where the server tells "
        "clients apart; beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    # Kept keys and values outlive requests: without a ceiling of their own, sequences left open (by any client,
    # identified or not) could hold the whole budget until their idle timeout and refuse every stateless call.
    sequence_bytes_share: float = setting(
        0.5,
        "share of --max-inflight-bytes that every sequence's keys and values may hold together; the rest is kept for "
        "stateless requests; beyond, a step that grows a sequence is RESOURCE_EXHAUSTED",
        rule=Rule(lambda value: 0 < value <= 1, "more than 0 and at most 1"),
    )
    max_sequence_length: int = setting(
        4096, "rows a sequence may grow to; beyond, RESOURCE_EXHAUSTED", rule=at_least(1)
    )
    sequence_idle_timeout_s: float = setting(
        60.0,
        "a sequence with no step for this long is dropped and its memory returned (Triton's "
        "max_sequence_idle_microseconds)",
        rule=more_than(0),
    )


@dataclass
class DeviceSettings(Section):
    """Where and how the model runs: the device, ONNX Runtime's threads, the graphs used."""

    title: ClassVar[str] = "devices"

    device: str = setting(
        "auto",
        "auto: CUDA when really usable, else CPU with a warning; cuda: refuse to start without it",
        rule=one_of("auto", "cpu", "cuda"),
    )
    # ONNX Runtime's CUDA provider rounds float32 matrix products' inputs to TF32 (10 bits of mantissa) on
    # tensor cores unless told not to; false asks for exact float32 products.
    cuda_tf32: bool = setting(
        False,
        "on CUDA, let float32 matrix products run in TF32 on tensor cores (ONNX Runtime's own default: inputs "
        "rounded to 10 bits of mantissa, as float16's, which puts the scores of large inputs off by their "
        "magnitude times 1e-3); false (the default): exact float32 products",
    )
    intra_op_threads: int = setting(
        0,
        "ONNX Runtime threads per run (0 = one per core the process may use: its CPU affinity and CPU quota)",
        rule=Rule(
            lambda value: 0 <= value <= usable_cores(),
            "0 or a count up to the cores this process may use",
            show_value=True,
            why=lambda: f"it may use {usable_cores()}; more threads only wait on each other",
        ),
    )
    # ONNX Runtime's threads spin for the next run for tens of milliseconds after each: under load that keeps a
    # core ready for the runs, and on a server of sparse traffic it is CPU spent waiting (BENCHMARKS.md, "Server
    # settings that change speed").
    intra_op_spin_ms: float = setting(
        -1.0,
        "milliseconds ONNX Runtime's threads spin for the next run after one before they sleep (-1: ONNX Runtime's "
        "own, fastest under load; 0: they sleep at once; a few ms: less CPU spent between sparse requests)",
        rule=Rule(lambda value: value == -1 or value >= 0, "-1 (ONNX Runtime's own) or 0 or more"),
    )
    inference_workers: int = setting(
        1, "model runs allowed at once; more than one only helps with spare cores", rule=at_least(1)
    )
    workers: int = setting(
        1,
        "serving processes on the same ports (0: one per core the process may use), each with its own event loop, "
        "model and batching, the kernel spreading connections over them (SO_REUSEPORT); started, restarted and "
        "stopped as one server with one /metrics; ONNX Runtime's threads divided between them. A sequence lives in "
        "one worker (by its owner, or its id where callers are not told apart), and a step reaching another is "
        "forwarded there",
        rule=at_least(0),
    )
    # Inference threads run at a lower priority than the gRPC thread, so that when model runs fill every
    # core the server still receives, refuses (RESOURCE_EXHAUSTED) and answers promptly, at the same
    # throughput (BENCHMARKS.md, "Figures behind the server's defaults").
    inference_nice: int = setting(
        10,
        "nice value of the inference threads, ONNX Runtime's included (Linux; 0-19, 0 = same priority as the gRPC"
        " thread that receives, refuses and answers requests)",
        rule=between(0, 19, "a thread may lower its priority, not raise it"),
    )
    output_only_graph: bool = setting(
        True,
        "run requests that ask for no attention weights on the model folder's output-only graph, where it has "
        "one (faster from about 512 tokens; holds a second copy of the projection weights)",
    )
    summaries_graph: bool = setting(
        True,
        "run requests that ask for attention summaries and no weights on the model folder's summaries graph, where "
        "it has one (the weights never leave the run; holds another copy of the projection weights); off, the "
        "summaries are computed from the full graph's weights",
    )
    warmup_runs: int = setting(
        2, "model runs at each warm-up shape before reporting ready (0 = none)", rule=at_least(0)
    )
    parity_share: float = setting(
        0.0,
        "share of requests (0 to 1) whose answers are recomputed in float64 from the served graph's weights, off "
        "the request path, and compared within the export's tolerance: live parity (0 = none)",
        rule=Rule(lambda value: 0.0 <= value <= 1.0, "from 0 to 1 (a share of the requests)"),
    )


@dataclass
class SecuritySettings(Section):
    """TLS, client certificates and bearer tokens."""

    title: ClassVar[str] = "security"

    tls_cert_file: Path | None = setting(
        None, "PEM certificate (chain) of the gRPC port; with --tls-key-file turns TLS on"
    )
    tls_key_file: Path | None = setting(None, "PEM private key of --tls-cert-file")
    tls_client_ca_file: Path | None = setting(
        None, "PEM CA bundle; clients must present a certificate it signed (mutual TLS)"
    )
    auth_token_file: Path | None = setting(
        None,
        "file holding the bearer token every RPC but health must carry, or one 'NAME TOKEN' line per client so that "
        "each client's sequences are its own (or set $MHASERVE_AUTH_TOKEN; none: no token)",
    )


@dataclass
class SharedMemorySettings(Section):
    """Triton's system shared-memory extension."""

    title: ClassVar[str] = "shared memory"

    # Off by default, as in Triton: a registered region is opened with the server's permissions, so any local
    # client able to reach the port could have the server read and write shared-memory objects it may open.
    allow_client_shm: bool = setting(
        False,
        "let clients on this host register system shared-memory regions (objects in /dev/shm) and have inputs read "
        "from and outputs written into them (Triton's system shared-memory extension)",
    )
    client_shm_max_regions: int = setting(
        128,
        "shared-memory regions registered at once; beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )
    client_shm_max_bytes: int = setting(
        1 << 36,
        "bytes of shared-memory regions registered at once (their windows summed); beyond, RESOURCE_EXHAUSTED",
        rule=at_least(1),
    )


@dataclass
class LifecycleSettings(Section):
    """Stopping: the drain and the grace given to requests in flight."""

    title: ClassVar[str] = "lifecycle"

    drain_seconds: float = setting(
        1.0,
        "on SIGTERM/SIGINT, keep the port open this long, refusing new calls with UNAVAILABLE (retryable), before"
        " closing it (0: at once, and calls that reached gRPC but not yet a handler end CANCELLED, which clients do"
        " not retry)",
        rule=at_least(0),
    )
    grace_seconds: float = setting(10.0, "on SIGTERM/SIGINT, time for in-flight requests to finish", rule=at_least(0))


@dataclass
class LogSettings(Section):
    """Logs, the access log and OpenTelemetry traces."""

    title: ClassVar[str] = "logs and tracing"

    log_level: str = setting(
        "INFO",
        "DEBUG, INFO, WARNING or ERROR (any case)",
        rule=Rule(lambda value: value.upper() in LOG_LEVELS, "DEBUG, INFO, WARNING or ERROR", show_value=True),
    )
    log_format: str = setting(
        "text",
        "text, or json: one JSON object a line (time, level, logger, message, and the request's fields)",
        rule=one_of("text", "json"),
    )
    trace_config: tuple[str, ...] = setting(
        (),
        "tracing, as Triton's --trace-config (repeat it): mode=opentelemetry turns it on, rate=N traces one request "
        "in N (default 1000; 0: only requests whose caller's trace is sampled), count=N stops after N traces "
        "(-1: no end), level=OFF|TIMESTAMPS, "
        "opentelemetry,url=HOST:PORT/v1/traces the OTLP endpoint; export is configured by the OTEL_* variables "
        "(needs the tracing extra)",
    )
    access_log: bool = setting(
        False,
        "one line per inference request (logger mhaserve.access): protocol, model, version, status, request id, "
        "rows, bytes in and out, queue, compute and total time",
    )

    def check(self) -> None:
        try:
            parse_trace_config(self.trace_config)
        except ValueError as error:
            raise UsageError(f"--trace-config: {error}") from None


# The order of the sections (--help and the settings reference list them so).
SECTION_CLASSES = (
    RepositorySettings,
    TransportSettings,
    LimitSettings,
    BatchingSettings,
    SequenceSettings,
    DeviceSettings,
    SecuritySettings,
    SharedMemorySettings,
    LifecycleSettings,
    LogSettings,
)
SECTIONS = tuple(section.title for section in SECTION_CLASSES)
SECTION_OF = {name: section.title for section in SECTION_CLASSES for name in section.own_fields()}


@dataclass
class ServerSettings(
    LogSettings,
    LifecycleSettings,
    SharedMemorySettings,
    SecuritySettings,
    DeviceSettings,
    SequenceSettings,
    BatchingSettings,
    LimitSettings,
    TransportSettings,
    RepositorySettings,
):
    """Every server setting, the sections' fields as one flat set (``settings.max_batch_size``)."""

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


def finite_float(text: str) -> float:
    """A number a setting takes, finite: no setting reads infinity or NaN as "off" (one that can be off says how,
    0 or -1)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None  # empty (an unset compose variable): not given


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def reader_of(setting: Field):
    """What reads a setting's value from text (a flag, a variable, a model's config.pbtxt parameter)."""
    field_type = setting.type if isinstance(setting.type, str) else setting.type.__name__
    if field_type.startswith("tuple"):
        return _names
    return {"int": int, "float": finite_float, "bool": parse_bool, "str": str}.get(field_type, _optional_path)


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
        groups[SECTION_OF[f.name]].add_argument(
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
    check_settings(settings)
    return settings


def check_settings(settings: ServerSettings) -> None:
    """Every section's rules, section by section: each field's own, then those across its fields (UsageError)."""
    for section in SECTION_CLASSES:
        for name in section.own_fields():
            rule, value = SETTING_FIELDS[name].metadata["rule"], getattr(settings, name)
            if rule is not None and not rule.holds(value):
                raise UsageError(f"{flag_of(name)} {rule.refusal(value)}")
        section.check(settings)
