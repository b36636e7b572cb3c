"""The data plane: what every transport shares. Served versions (the registry), loading them, batched
inference off the event loop, the memory budget, and each request's bookkeeping (timing, in-flight
counts, its final status in statistics and metrics).

Plain Python and numpy: a transport decodes its wire format into an ``InferenceRequest`` inside
``DataPlane.inference``, encodes the ``InferenceResponse`` it gets back, and maps the ``RequestError`` kinds
to its own statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

from mhaserve.contract.model_dir import ModelDirError, read_manifest
from mhaserve.contract.repository import ModelRepository, RepositoryPathError, VersionPolicy

from . import describe, logs
from .accounting import CallMemory, RequestAccounting
from .batcher import QueueTimeout
from .calls import CallRecord, ReadHeaders
from .config import ServerSettings
from .errors import ErrorKind, RequestError, inference_failed, invalid
from .inference import NO_PARAMETERS, OFF_LOOP_BYTES, InferenceRequest, InferenceResponse, run_inputs_of
from .memory import MemoryBudget
from .metrics import Metrics
from .model_config import model_settings
from .parameters import boolean
from .registry import ModelRegistry, ServedModel
from .runtime import Runtime
from .sequences import SequenceHomes, Sequences
from .shared_memory import NOTHING_HELD, SharedMemoryRegistry
from .tensors import Limits, RunInputs
from .threads import lowered_pool, worker_board
from .trace_settings import parse_trace_config
from .tracing import Tracing
from .versions import VersionFactory

log = logging.getLogger("mhaserve.server")
T = TypeVar("T")

LONG_HOLD_S = 0.005  # the interpreter's switch interval: a call longer than this kept other threads waiting
PAUSE_AFTER_LONG_HOLD = 0.2


def _pausing_after(function, *args):
    """``function(*args)``, then, if it held the interpreter for long (one protobuf parse of millions of typed
    values is one call), a pause of a fifth of that: the event loop needs the interpreter for several turns
    to answer even a health check, and without the pause the next long call took it back first (BENCHMARKS.md,
    "Hostile clients")."""
    started = time.perf_counter()
    try:
        return function(*args)
    finally:
        held = time.perf_counter() - started
        if held > LONG_HOLD_S:
            time.sleep(held * PAUSE_AFTER_LONG_HOLD)


# How long after its port closes a draining server's refusal says to retry: a retry sent while the port is still
# open is refused again, and one that reaches gRPC as the port closes is cut off CANCELLED, which clients do not
# retry; sent once the port has closed, it finds the connection refused (or another server), UNAVAILABLE.
RETRY_PAST_CLOSE_S = 1.0


class ShuttingDown(RequestError):
    def __init__(self, retry_after_s: float):
        super().__init__(
            ErrorKind.UNAVAILABLE,
            "the server is shutting down and takes no new requests; retry elsewhere",
            retry_after_s,
        )


class StepForward(Protocol):
    """Where steps of sequences that live in another serving process go (worker_forward.StepForwarder)."""

    homes: SequenceHomes  # where the anonymous sequences live

    def home_elsewhere(self, request: InferenceRequest, caller: str) -> int | None:
        """The process that holds the request's sequence, where that is another; else None."""

    async def infer(self, home: int, request: InferenceRequest, call: InferenceCall) -> InferenceResponse | None:
        """The request answered there, as a call of ``call``'s caller; None: a start to make here instead."""

    async def tell_others(self, action: str, **arguments) -> list[str]:
        """A control call (a model loaded or unloaded, a shared-memory region registered or not) made in every
        other serving process too; why it failed in any, one line each."""


UNLOAD_DEPENDENTS = "unload_dependents"  # Triton's unload parameter: also unload the ensembles using the model
LOAD_CONFIG = "config"  # Triton's load parameter: the model's configuration as JSON, in place of its config.pbtxt


class DataPlane:
    """What the transports call: the served versions a request names, the model control calls, and
    ``inference``, one inference call's life. Built from the registry (with the version factory it loads
    through) and the request accounting; transports reach neither directly."""

    def __init__(
        self,
        settings: ServerSettings,
        model_dir: Path | None = None,
        peer_statistics: Callable[[], Awaitable[list[list[dict]]]] | None = None,
        forward: StepForward | None = None,
    ):
        """``peer_statistics``: the other serving processes' statistics, where this is one of several (the worker
        supervisor's reader, given by the process); none: this process is the whole server. ``forward``: where the
        steps of sequences that live in another of them go."""
        self.settings = settings
        self._peer_statistics = peer_statistics
        self.forward = forward
        self.limits = Limits(settings.max_batch_size, settings.max_q_len, settings.max_kv_len)
        budget = MemoryBudget(  # every model's requests: one process's memory
            settings.max_inflight_bytes,
            settings.inference_workers,
            settings.max_batch_size if settings.dynamic_batching else None,
            padded_runs=settings.dynamic_batching and not settings.length_aware_batching,
            kept_share=settings.sequence_bytes_share,
        )
        self.metrics = Metrics(lambda: budget.held, budget.limit, lambda: budget.waiting_for_memory)
        self.started = False  # the models of start-up are loaded (or failed): ServerReady may say yes
        self._port_closes_at: float | None = None  # once draining (drain), when the ports close (time.monotonic())
        # One budget and one set of inference workers for every served version: the memory and the cores
        # are the process's, however many models share them.
        self._executor = lowered_pool(settings.inference_workers, "infer", settings.inference_nice, worker_board())
        # Decodes that convert values one by one (typed contents, JSON data) run here, off the event loop.
        self._decoder = lowered_pool(1, "decode", settings.inference_nice)
        self.sequences = Sequences(
            budget,
            settings.max_sequences,
            settings.max_sequences_per_client,
            settings.max_sequence_bytes_per_client,
            None if forward is None else forward.homes,
        )
        self.metrics.watch_sequences(self.sequences)
        self.accounting = RequestAccounting(budget, self.metrics, self._executor, self._runtimes)
        self.versions = VersionFactory(
            settings, self.limits, budget, self.metrics, self._executor, self.sequences, self.accounting.quiet
        )
        repository = ModelRepository(settings.model_repository) if settings.model_repository else None
        self.registry = ModelRegistry(
            self.versions,
            repository=repository,
            single_dir=None if repository else Path(model_dir),
            policy=VersionPolicy.parse(settings.version_policy),
        )
        self.tracing = Tracing(*parse_trace_config(settings.trace_config))  # TracingUnavailable: no SDK
        self.shared_memory = SharedMemoryRegistry(
            settings.allow_client_shm, settings.client_shm_max_regions, settings.client_shm_max_bytes
        )

    def _runtimes(self) -> list[Runtime]:
        return [runtime for served in self.registry.served_models() for runtime in served.runtimes]

    # -- start-up and the model control modes ----------------------------------------------------------

    def model_configs(self) -> list[dict]:
        """The configs (d_model, num_heads) of what start-up may serve, read before anything loads."""
        if self.registry.repository is None:
            return [read_manifest(self.registry.single_dir)["config"]]
        configs = []
        repository = self.registry.repository
        for name in repository.model_names():
            try:
                numbers = repository.versions(name)
            except ValueError:  # a link out of the repository: never served, the index says why
                continue
            for number in numbers:
                try:
                    repository.version_stamp(name, number)  # no file read from outside the repository
                    configs.append(read_manifest(repository.version_dir(name, number))["config"])
                except (ModelDirError, ValueError, OSError):
                    pass  # reported when it is loaded
        return configs

    async def start(self) -> None:
        """Load what the control mode loads at start-up. A single folder that cannot load is an error; in a
        repository a broken version is reported in the index and the rest serve, but a start that was to load
        models and serves none is an error (ModelDirError naming each version's reason), unless
        --exit-on-error false."""
        repository = self.registry.repository
        if repository is None:
            await self.registry.load_single_dir()
            self.started = True
            return
        if (misplaced := repository.misplaced()) is not None:
            raise ModelDirError(misplaced)
        refused = await self._load_repository()
        meant_to_load = self.settings.model_control_mode != "explicit" or self.settings.load_model
        if meant_to_load and not self.registry.served_models() and self.settings.exit_on_error:
            rows = [f"{name} version {version}: {reason or state}" for name, version, state, reason in self.index()]
            empty = "it holds no model folders (REPOSITORY/NAME/VERSION/, an export each)"
            found = "; ".join(rows + refused) if rows or refused else empty
            raise ModelDirError(
                f"no model of --model-repository {repository.root} loaded: {found} "
                "(--exit-on-error false starts anyway, serving none)"
            )
        self.started = True

    async def _load_repository(self) -> list[str]:
        """Load what the control mode loads at start; returns the --load-model names refused outright (a version
        that fails is in the index with its reason)."""
        refused = []
        if self.settings.model_control_mode == "explicit":
            names = self.settings.load_model
            for name in self.registry.repository.model_names() if "*" in names else names:
                try:
                    for failure in await self.registry.load_model(name):
                        log.warning("model '%s' %s", name, failure)
                except RequestError as error:
                    log.warning("--load-model %s: %s", name, error.message)
                    refused.append(f"--load-model {name}: {error.message}")
        else:
            await self.registry.poll()
        return refused

    async def poll_repository(self) -> None:
        """Poll mode: rescan the repository every repository_poll_secs until cancelled."""
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            if self.draining:
                return
            try:
                await self.registry.poll()
            except Exception:  # a bad scan (a folder vanishing mid-read) must not end polling
                log.exception("polling the model repository failed; trying again next time")

    def check_control_allowed(self, action: str) -> None:
        self._refuse_while_draining()
        if self.registry.repository is not None and self.settings.model_control_mode == "explicit":
            return
        mode = self.settings.model_control_mode if self.registry.repository is not None else "none (one folder)"
        raise RequestError(
            ErrorKind.FAILED_PRECONDITION,
            f"cannot {action}: explicit model load and unload need --model-control-mode explicit and a "
            f"--model-repository; this server's mode is {mode}",
        )

    async def load_model(
        self, name: str, parameters: Mapping[str, object] = NO_PARAMETERS, *, here_only: bool = False
    ) -> None:
        """RepositoryModelLoad: refused, with every failed version's reason, unless the model serves after it (in
        every serving process, where this is one of several; ``here_only``: in this one, told by another).
        ``parameters``: the request's load parameters as plain values: Triton's ``config`` (the model's
        configuration as JSON, served in place of its config.pbtxt until a load without one), no other."""
        unknown = sorted(set(parameters) - {LOAD_CONFIG})
        if unknown:  # tritonclient's load_model(files=...): here a version's folder is what 'mhaserve export' wrote
            raise invalid(
                f"load parameters {unknown} are not supported: only '{LOAD_CONFIG}' (the model's configuration as "
                "JSON); a version is loaded from the files 'mhaserve export' wrote"
            )
        config_json = parameters.get(LOAD_CONFIG)
        if config_json is not None and not isinstance(config_json, str):
            raise invalid(f"load parameter '{LOAD_CONFIG}' must be a string of JSON, got {type(config_json).__name__}")
        self.check_control_allowed(f"load model '{name}'")
        if config_json is not None:  # refused before anything changes: the versions serving serve on
            try:
                model_settings(self.settings, self.registry.repository.model_dir(name), name, quiet=True,
                               config_json=config_json)  # fmt: skip
            except (ModelDirError, RepositoryPathError) as error:
                raise invalid(f"model '{name}': {error}") from None
        failures = await self.registry.load_model(name, config_json=config_json)
        if self.forward is not None and not here_only:
            failures += await self.forward.tell_others("load", name=name, parameters=dict(parameters))
        if failures:
            serving = self.registry.ready_versions(name)
            now = f"serving version(s) {', '.join(map(str, serving))} unchanged" if serving else "nothing serves"
            raise RequestError(
                ErrorKind.FAILED_PRECONDITION, f"model '{name}' not loaded: {'; '.join(failures)}; {now}"
            )

    async def unload_model(
        self, name: str, parameters: Mapping[str, object] = NO_PARAMETERS, *, here_only: bool = False
    ) -> None:
        """RepositoryModelUnload, in every serving process (``here_only``: in this one, told by another).
        ``parameters``: the request's unload parameters as plain values: Triton's ``unload_dependents`` (which
        tritonclient always sends; a model here has no dependents), no other."""
        unknown = sorted(set(parameters) - {UNLOAD_DEPENDENTS})
        if unknown:
            raise invalid(f"unload parameters {unknown} are not supported: only {UNLOAD_DEPENDENTS} (true or false)")
        boolean(parameters.get(UNLOAD_DEPENDENTS, False), UNLOAD_DEPENDENTS)
        self.check_control_allowed(f"unload model '{name}'")
        await self.registry.unload_model(name)
        if self.forward is None or here_only:
            return
        failures = await self.forward.tell_others("unload", name=name)
        if failures:
            raise RequestError(
                ErrorKind.UNAVAILABLE, f"model '{name}' unloaded here, not in every worker: {'; '.join(failures)}"
            )

    async def register_region(self, peer: str, owner: str, name: str, key: str, offset, byte_size) -> None:
        """A client's shared-memory region registered, with every serving process where this is one of several
        (a worker that cannot open it undoes the registration everywhere)."""
        self.shared_memory.register(peer, owner, name, key, offset, byte_size)
        if self.forward is None:
            return
        arguments = {"peer": peer, "owner": owner, "name": name, "key": key, "offset": offset, "byte_size": byte_size}
        failures = await self.forward.tell_others("register", **arguments)
        if failures:
            await self.unregister_region(peer, owner, name)
            raise RequestError(ErrorKind.INVALID_ARGUMENT, f"shared memory region '{name}': {'; '.join(failures)}")

    async def unregister_region(self, peer: str, owner: str, name: str = "") -> None:
        """A client's region (or every one of its, ``name`` empty) forgotten, by every serving process."""
        self.shared_memory.unregister(peer, owner, name)
        if self.forward is not None:
            await self.forward.tell_others("unregister", peer=peer, owner=owner, name=name)

    def control_state(self) -> dict:
        """What control calls made of this process, for a serving process started again in place of another: the
        models served, and the shared-memory regions registered."""
        return {"models": sorted({m.signature.name for m in self.served_models()}), "configs": self.registry.configs,
                "regions": self.shared_memory.registrations(), "logging": logs.switches()}  # fmt: skip

    async def take_control_state(self, state: dict) -> None:
        """Another serving process's ``control_state`` made this one's: its log settings, its models loaded
        (explicit control) and its clients' regions registered, as before this process was started again."""
        logs.switch(state["logging"])
        if self.registry.repository is not None and self.settings.model_control_mode == "explicit":
            for name in state["models"]:
                if not self.registry.ready_versions(name):
                    for failure in await self.registry.load_model(name, config_json=state["configs"].get(name)):
                        log.warning("model '%s', loaded in the other workers: %s", name, failure)
        for owner, name, key, offset, byte_size in state["regions"]:
            try:
                self.shared_memory.register("127.0.0.1", owner, name, key, offset, byte_size)
            except RequestError as error:
                log.warning("shared memory region '%s' of the other workers: %s", name, error.message)

    # -- requests ----------------------------------------------------------------------------------------

    def drain(self, port_open_s: float) -> None:
        """From now on new requests are refused UNAVAILABLE, told to come back once the ports have closed
        (``port_open_s`` from now); requests in flight finish."""
        self._port_closes_at = time.monotonic() + port_open_s

    @property
    def draining(self) -> bool:
        """Shutting down: in-flight requests finish, ready RPCs say no."""
        return self._port_closes_at is not None

    def _refuse_while_draining(self) -> None:
        if self._port_closes_at is not None:
            raise ShuttingDown(max(0.0, self._port_closes_at - time.monotonic()) + RETRY_PAST_CLOSE_S)

    @property
    def reports_ready(self) -> bool:
        """What ServerReady and health say: start-up's models loaded and not draining."""
        return self.started and not self.draining

    def resolve(self, name: str, version: str) -> ServedModel:
        """The served version a request names (RequestError: unknown, loading, unloading, shutting down)."""
        self._refuse_while_draining()
        return self.registry.resolve(name, version)

    def served_for(self, request: InferenceRequest, caller: str) -> ServedModel:
        """The served version an inference request goes to: where it continues a live sequence, the one the
        sequences say (sequences.Sequences.served_for); else the version it names."""
        self._refuse_while_draining()
        served = self.sequences.served_for(request, caller)
        return served if served is not None else self.registry.resolve(request.model, request.version)

    def statistics_of(self, name: str, version: str) -> list[ServedModel]:
        """The versions a statistics request names: one version, every version of a model, or every one."""
        if name and version:
            return [self.registry.resolve(name, version)]
        if name:
            self.registry.resolve(name, "")  # NOT_FOUND for a model this server lacks
            return [m for m in self.registry.served_models() if m.signature.name == name]
        return self.registry.served_models()

    async def statistics(self, name: str, version: str) -> list[dict]:
        """Triton's model_stats of the versions a statistics request names, for the whole server: with --workers,
        the other workers' figures of the same versions added."""
        own = [describe.model_statistics(served) for served in self.statistics_of(name, version)]
        others = await self._peer_statistics() if self._peer_statistics is not None else []
        return describe.merged_statistics(own, others) if others else own

    def model_ready(self, name: str, version: str) -> bool:
        """ModelReady, as Triton answers it: whether the version serves now; false for a model this server
        holds (served, or in its repository) in a version that does not serve (loading, unloaded, failed, or
        none such), and NOT_FOUND only for a name it does not hold."""
        try:
            self.registry.resolve(name, version)
        except RequestError as error:
            if error.kind == ErrorKind.NOT_FOUND and not self.registry.holds(name):
                raise
            return False
        return not self.draining

    async def log_settings(self, changes: Mapping[str, object], *, here_only: bool = False) -> dict[str, object]:
        """LogSettings (Triton's logging extension): the log's settings, after ``changes`` if any, made in every
        serving process (``here_only``: in this one, told by another)."""
        if not changes:
            return logs.switches().as_protocol()
        before = logs.switches()
        switches = before.updated(changes)
        # One line, by the process that took the call, written while INFO lines are: before a change that stops
        # them, after one that starts them.
        line = "log settings changed: " + ", ".join(f"{name}={value}" for name, value in changes.items())
        said = switches != before and not here_only
        if said and not switches.log_info:
            log.info("%s", line)
        logs.switch(switches)
        if said and switches.log_info:
            log.info("%s", line)
        if self.forward is not None and not here_only:
            failures = await self.forward.tell_others("logging", changes=dict(changes))
            if failures:
                raise RequestError(ErrorKind.UNAVAILABLE, f"log settings changed here, not in every worker: "
                                                          f"{'; '.join(failures)}")  # fmt: skip
        return switches.as_protocol()

    def trace_settings(self, model: str, changes: dict[str, list[str]]) -> dict[str, list[str]]:
        """TraceSetting: the settings of ``model`` (or the global ones), updated by ``changes`` if any."""
        if model and not self.registry.holds(model):
            raise RequestError(ErrorKind.NOT_FOUND, f"unknown model '{model}'")
        return self.tracing.update(model, changes) if changes else self.tracing.settings_of(model)

    @contextlib.asynccontextmanager
    async def inference(
        self,
        protocol: str,
        timeout_s: float | None = None,
        method: str = "",
        headers: ReadHeaders | None = None,
        peer: str = "",
        caller: str = "",
    ) -> AsyncIterator[InferenceCall]:
        """One inference call's life, whichever transport makes it: in it the transport reads its request, decodes
        it into the neutral InferenceRequest (slow decodes on the decode thread, ``call.off_loop``), runs it with
        ``call.infer(request)`` and encodes the answer inside ``call.encoding()``. Whatever happens inside (a
        refusal by the transport itself too) is the call's status, recorded with its timing in the statistics,
        the metrics and the stop line's counts. A failure that is no refusal leaves as an INTERNAL RequestError
        saying so, and the server keeps serving.

        A transport that writes the answer after this block calls ``call.deliver_later()`` inside it and
        ``call.record_delivery(delivered)`` once written: until then the answer's memory stays in the budget and its
        status is open (an answer never taken is counted CANCELLED, not OK).

        ``method`` names the call as its transport does (the RPC, or the HTTP route) and ``headers`` gives its
        headers or metadata, read only if the call is traced; ``peer`` the caller's address (shared memory is
        for callers on this host only); ``caller`` who it comes from (security.Callers.identify), to whom the
        sequences it starts belong."""
        call = InferenceCall(self, protocol, timeout_s, method, headers, peer, caller)
        self.accounting.requests_in_flight += 1
        try:
            yield call
            call.status = "OK"
        except RequestError as error:
            call.status, call.shed_by = error.kind.name, error.shed_by
            if log.isEnabledFor(logging.DEBUG):  # verbose: why, which only the client was told
                fields = {"request_id": call.request_id, "status": error.kind.name, "protocol": protocol}
                log.debug("%s request %r refused %s: %s", protocol, call.request_id, error.kind.name, error.message,
                          extra=fields)  # fmt: skip
            raise
        except asyncio.CancelledError:
            call.status = "CANCELLED"  # the client went away or its deadline passed
            raise
        except ConnectionError as error:  # its connection closed while the request was read (an HTTP body)
            call.status = ErrorKind.CANCELLED.name
            log.info("a %s client's connection closed before its request was read (%s): counted CANCELLED",
                     protocol, error)  # fmt: skip
            raise RequestError(ErrorKind.CANCELLED, "the connection closed before the request was read") from None
        except Exception as error:  # a bug or a runtime failure: say so, keep serving
            call.status = ErrorKind.INTERNAL.name
            log.exception("inference failed")
            raise inference_failed(error) from None
        finally:
            self.accounting.requests_in_flight -= 1
            call.end()

    async def off_loop(self, function, *args):
        """``function(*args)`` on the decode thread: work that holds the interpreter for long (converting
        values one by one, parsing megabytes of typed protobuf) is kept off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._decoder, _pausing_after, function, *args)

    async def off_loop_if_large(self, function, nbytes: int, *args):
        """``function(*args)``, on the decode thread when it moves more than OFF_LOOP_BYTES (a message to parse,
        tensors to copy), else here."""
        if nbytes > OFF_LOOP_BYTES:
            return await self.off_loop(function, *args)
        return function(*args)

    # -- what the transports describe ---------------------------------------------------------------------

    def ready_versions(self, name: str) -> list[int]:
        return self.registry.ready_versions(name)

    def served_models(self) -> list[ServedModel]:
        return self.registry.served_models()

    def index(self, ready_only: bool = False) -> list[tuple[str, str, str, str]]:
        """The repository index: (name, version, state, reason) for every version the server holds."""
        return self.registry.index(ready_only=ready_only)

    def record_unauthenticated(self, method: str) -> None:
        self.accounting.record_unauthenticated(method)

    async def drop_idle_sequences(self) -> None:
        """Until the server drains: the sequences idle past their timeout are dropped."""
        await self.sequences.drop_idle_until(lambda: self.draining, self.settings.sequence_idle_timeout_s)

    def shutdown(self) -> None:
        self.sequences.drop_all("the server stopped")
        self._executor.shutdown(wait=True)
        self._decoder.shutdown(wait=True)
        for runtime in self._runtimes():  # what each holds beyond this process's memory (live parity's process)
            runtime.close()
        self.versions.shutdown()
        self.shared_memory.close()


class InferenceCall(CallRecord):
    """One call inside ``DataPlane.inference``: the version it resolved to, its rows, timing and memory. The
    transport counts what it receives in ``receipt`` and hands over the rest with ``infer``."""

    def __init__(
        self,
        dataplane: DataPlane,
        protocol: str,
        timeout_s: float | None,
        method: str,
        headers: ReadHeaders | None,
        peer: str = "",
        caller: str = "",
    ):
        super().__init__(protocol, timeout_s, method, headers, peer, caller)
        self._dataplane = dataplane
        self.memory = CallMemory(dataplane.accounting)
        self.receipt = self.memory.receipt  # its request as received, until it is admitted
        self._deliver_later = False
        self._settle: Callable | None = None
        self._regions = NOTHING_HELD  # the shared-memory regions its tensors lie in, until it ends
        self._admitted_ns = 0  # how long its admission to the memory budget took

    async def off_loop(self, function: Callable[..., T], *args) -> T:
        """``function(*args)`` on the decode thread: a transport's decode that would hold the event loop
        (inference.decodes_slowly: values converted one by one, megabytes to copy)."""
        return await self._dataplane.off_loop(function, *args)

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Resolve the version the request names, check the request against it (off the event loop when its
        tensors are large), hand it to the version's runtime for its kind (runtime.py: batched, or a sequence's
        step), which admits and runs it, and return the outputs it asked for."""
        dataplane = self._dataplane
        home = None if dataplane.forward is None else dataplane.forward.home_elsewhere(request, self.caller)
        if home is not None:  # a step of a sequence another serving process holds: answered there
            dataplane._refuse_while_draining()
            self.forwarded, self.request_id = True, request.id
            answered = await dataplane.forward.infer(home, request, self)
            if answered is not None:
                return answered
            self.forwarded = False  # a start its old home could not take: it starts here
        self.served = served = dataplane.served_for(request, self.caller)
        served.enter()  # from here the version is not unloaded under this request
        if dataplane.tracing.active:
            self.trace = dataplane.tracing.begin(self, served.signature)
        self.request_id = request.id
        placed = request.output_placements()
        shared = sum(each.placement.byte_size for each in request.shared_inputs.values())
        if request.shared_inputs or placed:  # their regions held, windows checked, until the call ends
            self._regions = dataplane.shared_memory.held_for(self.peer, self.caller, request.shared_inputs, placed)
            self.receipt.add(shared)  # read from shared memory like a body being received
        nbytes = shared + sum(array.nbytes for array in request.inputs.values())
        attention = await dataplane.off_loop_if_large(self._check_inputs, nbytes, request)
        self.rows = attention.batch_size
        outputs = await served.runtime_for(request).infer(self, request, attention)
        placed = {name: placement for name, placement in placed.items() if name in outputs}
        if placed:
            await self._dataplane.off_loop_if_large(
                self._regions.write, sum(outputs[n].nbytes for n in placed), outputs, placed
            )
        return InferenceResponse(served.signature, request, outputs, frozenset(placed))

    def _check_inputs(self, request: InferenceRequest) -> RunInputs:
        """The request, its inputs in shared memory read, checked against the version it resolved to."""
        self._regions.read_inputs(request.shared_inputs, request.inputs)
        return run_inputs_of(request, self.served.signature, self.served.limits)

    async def admit(self, attention: RunInputs, queue_timeout: QueueTimeout | None = None) -> None:
        """Its decoded inputs, its answer and its run's workspace taken in the budget once they fit (waiting up to
        its deadline and ``queue_timeout``), or refused; its wait counts as time queued."""
        admitting = time.perf_counter_ns()
        self.timing.input_ns = admitting - self.started
        timeout_s = self.timeout_s
        if timeout_s is not None:
            timeout_s = max(0.0, timeout_s - self.timing.input_ns / 1e9)
        await self.memory.admit(attention, self.served.signature, timeout_s, queue_timeout)
        self._admitted_ns = time.perf_counter_ns() - admitting  # a wait for memory counts as time queued

    def ran(self, rows: int, started_ns: int, *, queue_ns: int, infer_ns: int) -> None:
        self.run_rows, self.run_started_ns = rows, started_ns
        self.timing.queue_ns, self.timing.infer_ns = self._admitted_ns + queue_ns, infer_ns
        self.memory.run_ended()

    @contextlib.contextmanager
    def encoding(self):
        """The transport encodes the response inside: timed as the call's output time; the inputs leave the budget
        once it is encoded (the answer stays until it is sent)."""
        started = time.perf_counter_ns()
        yield
        self.memory.answer_encoded()
        self.encoded_ns = time.perf_counter_ns()
        self.timing.output_ns = self.encoded_ns - started

    def deliver_later(self) -> None:
        """The transport writes the answer after the call's block, and says with ``record_delivery`` when it has."""
        self._deliver_later = True

    def record_delivery(self, delivered: bool, nbytes: int = 0, *, freed: bool = True) -> Callable[[], None] | None:
        """The answer (``nbytes``) was written (``delivered``) or given up on: its status is recorded and its memory
        leaves the budget; or, ``freed`` False (the transport still holds the answer), the function that releases
        it later. Nothing for a call that ended otherwise."""
        if self._settle is None:
            return None
        self.bytes_out = nbytes if delivered else 0
        settle, self._settle = self._settle, None
        return settle(delivered, freed=freed)

    def end(self) -> None:
        accounting = self._dataplane.accounting
        self._regions.release()
        self.memory.call_ended()
        if self.served is not None:
            self.served.leave()  # the answer is encoded: unloading need not wait for its delivery
        if self.status != "OK":
            self.timing.input_ns = time.perf_counter_ns() - self.started - self.timing.queue_ns - self.timing.infer_ns
        settle = functools.partial(accounting.settle, self, self.memory.reserved)
        if self.status == "OK" and self._deliver_later:
            self._settle = settle
        else:
            settle(self.status == "OK", self.status)
