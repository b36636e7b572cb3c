"""The served versions: which (model, version) pairs exist, their state, and the objects that serve them.

Layered as MLServer layers it (registry -> runtime): the registry knows names, versions, states and
the reasons a version is not served; each loaded version is one ``ServedModel``: its signature, its settings
and its runtimes (runtime.py: batched, and sequence steps, each owning its graphs), with its statistics and
metric labels. Transports resolve (name, version) here and never touch a graph themselves.

Two sources: one model folder (served as version 1 under the manifest's name, as before repositories)
or a model repository, ``DIR/<model>/<version>/``, where the version policy picks what is served.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mhaserve.contract.model_dir import ModelDirError, read_manifest
from mhaserve.contract.repository import ModelRepository, RepositoryPathError, VersionPolicy
from mhaserve.contract.signature import ModelSignature

from .errors import ErrorKind, RequestError
from .inference import InferenceRequest
from .metrics import ModelMetrics
from .model_config import ModelSettings
from .runtime import BatchedRuntime, Runtime
from .sequences import SequenceRuntime
from .statistics import ModelStatistics
from .tensors import Limits

log = logging.getLogger("mhaserve.server")

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
RELOAD_FAILED = "its files changed and no longer load; serving the files loaded before"


@dataclass(eq=False)
class ServedModel:
    """One loaded version and everything that serves it."""

    signature: ModelSignature
    model_dir: Path
    settings: ModelSettings  # how it is served: its config.pbtxt over the server's settings
    batched: BatchedRuntime  # its stateless requests
    sequence_steps: SequenceRuntime  # its sequences' steps (refused, saying why, where its folder has no step graph)
    metrics: ModelMetrics
    stats: ModelStatistics = field(default_factory=ModelStatistics)
    requests_in_flight: int = 0  # inference calls resolved to this version and not yet answered
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever requests_in_flight is 0
    pins: int = 0  # state kept on this version between requests (live sequences): it is not unloaded under them
    _unload_once_released: Callable[[], None] | None = None  # an unload put off until its last pin goes

    def __post_init__(self):
        self.idle.set()

    @functools.cached_property
    def limits(self) -> Limits:
        """What one request may carry: its model's limits (read once; every request is checked against them)."""
        return self.settings.limits()

    @property
    def runtimes(self) -> tuple[Runtime, ...]:
        return self.batched, self.sequence_steps

    def runtime_for(self, request: InferenceRequest) -> Runtime:
        """The runtime that takes this kind of request: a stateless one, or a sequence's step."""
        return next(runtime for runtime in self.runtimes if runtime.takes(request))

    def enter(self) -> None:
        self.requests_in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.requests_in_flight -= 1
        if not self.requests_in_flight:
            self.idle.set()

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if not self.pins and self._unload_once_released is not None:
            unload, self._unload_once_released = self._unload_once_released, None
            unload()

    def unload_once_released(self, unload: Callable[[], None]) -> None:
        """``unload()`` once its last pin goes, its last live sequence ended (at once if none is live): an unload or a
        newer version waits for requests in flight, never for a sequence's idle timeout; its sequences step on."""
        if self.pins:
            self._unload_once_released = unload
        else:
            unload()


@dataclass
class VersionState:
    """One version as the repository index reports it."""

    state: str
    reason: str = ""
    served: ServedModel | None = None
    # The folder as it was when this version was loaded (or failed to load). Each poll compares it with the
    # folder now: a served version whose files changed is reloaded, a failed one is not retried until then.
    stamp: tuple | None = None


class ModelNotFound(RequestError):
    def __init__(self, name: str, known: list[str]):
        served = ", ".join(f"'{n}'" for n in known) or "none"
        super().__init__(ErrorKind.NOT_FOUND, f"unknown model '{name}'; this server serves {served}")


class VersionLoader(Protocol):
    """What makes and takes apart served versions (server.versions.VersionFactory)."""

    async def load(
        self, name: str, number: int, model_dir: Path, config_dir: Path, config_json: str | None = None
    ) -> ServedModel: ...

    async def unload(self, served: ServedModel) -> None: ...

    def version_policy(self, name: str, config_dir: Path, config_json: str | None = None) -> VersionPolicy | None:
        """The policy ``config_dir``'s config.pbtxt (or ``config_json``) sets, or None (ModelDirError: one that
        cannot be read)."""


class ModelRegistry:
    """(name, version) -> state, and the loading, unloading and swapping of versions.

    Versions are made and taken apart by ``versions`` (the same code at start-up, polling and the
    repository RPCs). One load or unload per model
    at a time (a lock per name); requests never wait on it.
    """

    def __init__(
        self,
        versions: VersionLoader,
        *,
        repository: ModelRepository | None = None,
        single_dir: Path | None = None,
        policy: VersionPolicy | None = None,
    ):
        self._versions = versions
        self.repository = repository
        self.single_dir = single_dir
        self.policy = policy or VersionPolicy("latest")  # the server's; a model's config.pbtxt may set its own
        self._policies: dict[str, VersionPolicy] = {}  # each model's, as its file said when last read
        self.configs: dict[str, str] = {}  # configurations given with a model's load, in place of its file
        self.models: dict[str, dict[int, VersionState]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refused: set[str] = set()  # model folders polling cannot serve (said once in the log)
        self._deferred_unloads: set[asyncio.Task] = set()  # unloads put off until a version's sequences ended

    # -- resolving requests ------------------------------------------------------------------------------

    def resolve(self, name: str, version: str) -> ServedModel:
        """The version a request names; an empty version is the newest ready one."""
        versions = self.models.get(name)
        if not versions or not any(v.state in (READY, LOADING, UNLOADING) for v in versions.values()):
            if not self.holds(name):
                raise ModelNotFound(name, self.served_names())
            # There but not serving (unloaded, or no version loads): a state that may pass, as Triton says it.
            reasons = "; ".join(f"version {n}: {v.reason}" for n, v in sorted((versions or {}).items()) if v.reason)
            raise RequestError(
                ErrorKind.UNAVAILABLE, f"model '{name}' has no available version" + (f" ({reasons})" if reasons else "")
            )
        ready = sorted(n for n, v in versions.items() if v.state == READY)
        if not version:
            if not ready:
                raise RequestError(ErrorKind.UNAVAILABLE, f"model '{name}' has no ready version yet (loading)")
            return versions[ready[-1]].served
        number = int(version) if version.isascii() and version.isdigit() and len(version) < 10 else None
        entry = versions.get(number) if number is not None else None
        if entry is None or entry.state == UNAVAILABLE:
            listed = ", ".join(f"'{n}'" for n in ready) or "none ready"
            if entry is None:
                raise RequestError(
                    ErrorKind.NOT_FOUND, f"model '{name}' has no version '{version}'; available: {listed}"
                )
            why = f" ({entry.reason})" if entry.reason else ""
            raise RequestError(
                ErrorKind.UNAVAILABLE, f"model '{name}' version {number} does not serve{why}; available: {listed}"
            )
        if entry.state != READY:
            raise RequestError(
                ErrorKind.UNAVAILABLE, f"model '{name}' version {number} is {entry.state.lower()}; retry"
            )
        return entry.served

    def holds(self, name: str) -> bool:
        """Whether ``name`` is a model this server knows: one it served or tried to, or a folder of its repository."""
        if name in self.models:
            return True
        return self.repository is not None and name in self.repository.model_names()

    def served_names(self) -> list[str]:
        return sorted(n for n, vs in self.models.items() if any(v.state != UNAVAILABLE for v in vs.values()))

    def ready_versions(self, name: str) -> list[int]:
        return sorted(n for n, v in self.models.get(name, {}).items() if v.state == READY)

    def served_models(self) -> list[ServedModel]:
        return [v.served for _, vs in sorted(self.models.items()) for _, v in sorted(vs.items()) if v.served]

    def index(self, ready_only: bool = False) -> list[tuple[str, str, str, str]]:
        """(name, version, state, reason) of every version the repository holds or the server serves."""
        rows = []
        names = set(self.models)
        if self.repository is not None:
            names.update(self.repository.model_names())
        for name in sorted(names):
            known = dict(self.models.get(name, {}))
            if self.repository is not None:
                try:
                    numbers = self.repository.versions(name)
                except RepositoryPathError as error:  # e.g. a symlink out of the repository: never served
                    if not ready_only:
                        rows.append((name, "", UNAVAILABLE, str(error)))
                    continue
                for number in numbers:
                    known.setdefault(number, VersionState(UNAVAILABLE, "not loaded"))
            for number, entry in sorted(known.items()):
                if ready_only and entry.state != READY:
                    continue
                rows.append((name, str(number), entry.state, entry.reason))
        return rows

    # -- loading and unloading ---------------------------------------------------------------------------

    async def load_single_dir(self) -> ServedModel:
        """Single-folder serving: the folder is version 1 of the model its manifest names."""
        name = str(read_manifest(self.single_dir).get("name") or "mha")
        self.models[name] = {1: VersionState(LOADING)}
        try:
            served = await self._versions.load(name, 1, self.single_dir, self.single_dir)
        except BaseException:
            del self.models[name]
            raise
        self.models[name][1] = VersionState(READY, served=served)
        return served

    async def load_model(self, name: str, retry_failed: bool = True, config_json: str | None = None) -> list[str]:
        """Serve the versions the policy picks from what the repository holds now; unload the others once
        those are ready (a swap: requests move to the new version, those in flight finish on the old).
        ``config_json``: a configuration (Triton's ModelConfig as JSON) served in place of the model's config.pbtxt
        until a load without one; a change of it reloads the versions, as a changed file does.

        A version that fails to load is marked with its reason, and the policy picks again without it,
        so a broken new version leaves the serving one untouched. Returns the failures' reasons. Without
        ``retry_failed`` (polling) a version that failed is not tried again until its folder changes.
        """
        repository = self._require_repository()
        try:
            numbers = repository.versions(name)
        except RepositoryPathError as error:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, str(error)) from None
        if not numbers:
            raise RequestError(ErrorKind.NOT_FOUND, f"model '{name}': no version folders in {repository.root / name}")
        async with self._locks.setdefault(name, asyncio.Lock()):
            if config_json is None:
                self.configs.pop(name, None)
            else:
                self.configs[name] = config_json
            versions = self.models.setdefault(name, {})
            if retry_failed:
                for entry in versions.values():
                    if entry.state == UNAVAILABLE:
                        entry.stamp = None
            failures: list[str] = []
            tried: set[int] = set()  # once per call: a folder still being written is taken up at the next poll
            policy = self.policy_of(name)
            while True:
                usable = [n for n in numbers if not self._failed_unchanged(name, n, versions.get(n))]
                wanted = policy.select(usable)
                to_load = [n for n in wanted if n not in tried and self._needs_load(name, n, versions.get(n))]
                if not to_load:
                    break
                for number in to_load:
                    tried.add(number)
                    reason = await self._load_one(name, number, versions)
                    if reason:
                        failures.append(f"version {number}: {reason}")
            for number in sorted(set(versions) - set(wanted)):
                await self._unload_one(name, number, versions, reason="not selected by the version policy")
            # A version whose folder is gone (removed from the repository) leaves the index too.
            for number in [n for n, v in versions.items() if v.state == UNAVAILABLE and n not in numbers]:
                del versions[number]
            return failures

    def policy_of(self, name: str) -> VersionPolicy:
        """The versions of ``name`` served: as its config.pbtxt says, else as the server's --version-policy. While
        that file cannot be read, the policy read from it last (each version's load then fails, saying why, and
        a version serving stays serving)."""
        try:
            policy = self._versions.version_policy(name, self.repository.model_dir(name), self.configs.get(name))
            self._policies[name] = policy or self.policy
        except ModelDirError:
            pass
        return self._policies.get(name, self.policy)

    async def unload_model(self, name: str) -> None:
        versions = self.models.get(name)
        if not versions or all(v.state == UNAVAILABLE for v in versions.values()):
            raise ModelNotFound(name, self.served_names())
        async with self._locks.setdefault(name, asyncio.Lock()):
            for number in sorted(versions):
                await self._unload_one(name, number, versions, reason="unloaded")

    async def poll(self) -> None:
        """One rescan: every model in the repository as load_model would have it, vanished models unloaded."""
        repository = self._require_repository()
        present = set(repository.model_names())
        for name in sorted(present):
            try:
                if not repository.versions(name):
                    continue
                await self.load_model(name, retry_failed=False)  # each version that fails logs its one line
            except (RequestError, RepositoryPathError) as error:  # the index says why; the rest still load
                if name not in self._refused:
                    log.warning("model '%s' not served: %s", name, getattr(error, "message", error))
                self._refused.add(name)
        for name in sorted(set(self.models) - present):
            if any(v.state != UNAVAILABLE for v in self.models[name].values()):
                await self.unload_model(name)
            self.models.pop(name, None)

    async def _load_one(self, name: str, number: int, versions: dict[int, VersionState]) -> str:
        """Load a version, or reload one whose folder changed. A reload is a swap: the old session serves on
        while the new one loads, then requests move to the new one and the old is unloaded once its requests
        in flight have finished; if the folder no longer loads, the old one serves on and the index says why."""
        previous = versions.get(number)
        replaced = previous.served if previous is not None and previous.state == READY else None
        if replaced is None:
            versions[number] = VersionState(LOADING)
        stamp = None
        try:
            # Taken before loading, whether the load succeeds or fails: a folder still being written while it
            # loads (read half old, half new) differs from this stamp at the next poll, which tries it again.
            stamp = self._stamp(name, number, refuse=True)  # a file linked out of the repository is refused
            version_dir = self.repository.version_dir(name, number)
            served = await self._versions.load(name, number, version_dir, version_dir.parent, self.configs.get(name))
        except (ModelDirError, RepositoryPathError, ValueError, RuntimeError) as error:
            reason = str(error)
            if stamp is None:  # the stamp itself was refused: kept as the refusal, compared like any stamp
                stamp = self._stamp(name, number)
            if replaced is not None:
                # As Triton does: the version loaded before serves on, unchanged, until its folder loads again.
                reason = f"{RELOAD_FAILED}: {reason}"
                versions[number] = VersionState(READY, reason, served=replaced, stamp=stamp)
                log.warning("model '%s' version %d: %s", name, number, reason)
                return reason
            versions[number] = VersionState(UNAVAILABLE, reason, stamp=stamp)
            log.warning("model '%s' version %d not loaded: %s", name, number, reason)
            return reason
        except BaseException:
            versions[number] = previous or VersionState(UNAVAILABLE, "loading was interrupted")
            raise
        versions[number] = VersionState(READY, served=served, stamp=stamp)
        if replaced is not None:
            log.info("model '%s' version %d reloaded: its files changed", name, number)
            await self._retire(replaced)
        else:
            log.info("model '%s' version %d ready", name, number)
        return ""

    async def _retire(
        self, served: ServedModel, versions: dict[int, VersionState] | None = None, number: int = 0, reason: str = ""
    ) -> None:
        """Unload a session once the requests in flight on it have finished. With ``versions``, the version
        it served is shown UNLOADING (and takes no new requests) meanwhile."""
        if versions is not None:
            versions[number] = VersionState(UNLOADING, reason)
        await served.idle.wait()
        if not served.pins:
            await self._versions.unload(served)
            return
        log.info(
            "model '%s' version %s: unloaded once its %d live sequence(s) end; they step on it until then",
            served.signature.name, served.signature.version, served.pins,
        )  # fmt: skip
        loop = asyncio.get_running_loop()  # its last sequence may end on another thread (a stop's drop_all)
        served.unload_once_released(lambda: loop.is_closed() or loop.call_soon_threadsafe(self._unload_later, served))

    def _unload_later(self, served: ServedModel) -> None:
        task = asyncio.ensure_future(self._versions.unload(served))
        self._deferred_unloads.add(task)  # held until done: a task only the loop references may be collected
        task.add_done_callback(self._deferred_unloads.discard)

    async def _unload_one(self, name: str, number: int, versions: dict[int, VersionState], reason: str) -> None:
        entry = versions.get(number)
        if entry is None or entry.served is None:
            if entry is not None and entry.state != UNAVAILABLE:
                versions[number] = VersionState(UNAVAILABLE, reason)
            return
        # New requests stop resolving to it now; the ones in flight finish on it.
        await self._retire(entry.served, versions, number, reason)
        versions[number] = VersionState(UNAVAILABLE, reason)
        log.info("model '%s' version %d unloaded (%s)", name, number, reason)

    def _failed_unchanged(self, name: str, number: int, entry: VersionState | None) -> bool:
        if entry is None or entry.state != UNAVAILABLE or entry.stamp is None:
            return False
        return entry.stamp == self._stamp(name, number)

    def _needs_load(self, name: str, number: int, entry: VersionState | None) -> bool:
        """Not served yet, or served from files that have changed since (rewritten, replaced, renamed)."""
        if entry is None or entry.state != READY:
            return True
        return entry.stamp != self._stamp(name, number)

    def _stamp(self, name: str, number: int, refuse: bool = False) -> tuple:
        """What a version is served from: its files, and the configuration its load gave, if any. ``refuse``: a
        folder that cannot be stamped raises (else the error is the stamp, compared like any: a new one is a
        change)."""
        try:
            files = self.repository.version_stamp(name, number)
        except (RepositoryPathError, OSError) as error:
            if refuse:
                raise
            files = ("unreadable", str(error))
        return files, self.configs.get(name)

    def _require_repository(self) -> ModelRepository:
        if self.repository is None:
            raise RequestError(
                ErrorKind.FAILED_PRECONDITION,
                f"this server serves one model folder ({self.single_dir}), not a model repository; "
                "start it with --model-repository DIR to load and unload models",
            )
        return self.repository
