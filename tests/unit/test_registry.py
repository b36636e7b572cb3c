"""The model registry in the test's own event loop over a real repository folder, with a version loader that
records what it was asked to load and fails where a test says so: which versions the policy serves, what a
failed load leaves, when a failed version is tried again, and what leaves the index."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.contract.repository import ModelRepository, RepositoryPathError, VersionPolicy, check_model_name
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.registry import READY, UNAVAILABLE, ModelRegistry, ServedModel

LONG_AGO_NS = 1_000_000_000 * 1_600_000_000  # files exported well before the test rewrites them


class Loader:
    """Loads any folder unless ``refuse`` holds a reason for it; ``while_loading`` runs during a load, as a
    copy into the folder would while the server reads it."""

    def __init__(self):
        self.loads: list[tuple[str, int]] = []
        self.unloads: list[tuple[str, int]] = []
        self.refuse: dict[tuple[str, int], str] = {}
        self.while_loading = None
        self.policies: dict[str, VersionPolicy | str] = {}  # a model's config.pbtxt's policy, or why it is unread

    async def load(self, name: str, number: int, model_dir: Path, config_dir: Path, config_json=None) -> ServedModel:
        self.loads.append((name, number))
        if self.while_loading is not None:
            self.while_loading()
            self.while_loading = None
        await asyncio.sleep(0)
        if (name, number) in self.refuse:
            raise ModelDirError(self.refuse[name, number])
        served = ServedModel(None, model_dir, None, None, None, None)
        served.key = (name, number)
        return served

    async def unload(self, served: ServedModel) -> None:
        self.unloads.append(served.key)

    def version_policy(self, name: str, config_dir: Path, config_json=None) -> VersionPolicy | None:
        policy = self.policies.get(name)
        if isinstance(policy, str):
            raise ModelDirError(policy)
        return policy


def add_version(root: Path, name: str, number: int, content: bytes = b"weights v1") -> Path:
    folder = root / name / str(number)
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(content)
    os.utime(folder / "model.onnx", ns=(LONG_AGO_NS, LONG_AGO_NS))
    return folder


def rewrite_in_place(file: Path, content: bytes) -> None:
    """Same inode, same size: only the modification time tells the new file from the old."""
    assert len(content) == file.stat().st_size
    with open(file, "r+b") as out:
        out.write(content)


def registry_over(root: Path, policy: VersionPolicy | None = None) -> tuple[ModelRegistry, Loader]:
    loader = Loader()
    return ModelRegistry(loader, repository=ModelRepository(root), policy=policy), loader


def states(registry: ModelRegistry) -> dict[tuple[str, str], str]:
    return {(name, version): state for name, version, state, _ in registry.index()}


def test_the_policy_serves_the_newest_version_and_an_empty_version_resolves_to_it(tmp_path):
    for number in (1, 2, 3):
        add_version(tmp_path, "a", number)
    registry, loader = registry_over(tmp_path, VersionPolicy("latest", count=2))
    asyncio.run(registry.poll())
    assert states(registry) == {("a", "1"): UNAVAILABLE, ("a", "2"): READY, ("a", "3"): READY}
    assert registry.resolve("a", "").key == ("a", 3) and registry.resolve("a", "2").key == ("a", 2)
    assert sorted(loader.loads) == [("a", 2), ("a", 3)]


def test_a_model_s_own_policy_picks_its_versions_and_the_one_read_last_holds_while_its_file_cannot_be_read(tmp_path):
    for name in ("a", "b"):
        for number in (1, 2, 3):
            add_version(tmp_path, name, number)
    registry, loader = registry_over(tmp_path)  # the server's policy: the newest version
    loader.policies["a"] = VersionPolicy("specific", versions=(1, 3))

    async def scenario():
        await registry.poll()
        picked = dict(states(registry))
        loader.policies["a"] = "config.pbtxt: not a model configuration"  # edited, and now unreadable
        await registry.poll()
        return picked

    picked = asyncio.run(scenario())
    expected = {("a", "1"): READY, ("a", "2"): UNAVAILABLE, ("a", "3"): READY}
    expected |= {("b", "1"): UNAVAILABLE, ("b", "2"): UNAVAILABLE, ("b", "3"): READY}
    assert picked == expected
    assert states(registry) == expected  # not the server's policy: version 1 of "a" was not unloaded
    assert str(registry.policy_of("a")) == "specific:1,3" and str(registry.policy_of("b")) == "latest:1"


@pytest.mark.parametrize("version", ["²", "١", "0x1", " 1"])  # "²" passed str.isdigit and failed int(): a 500
def test_a_version_that_is_not_ascii_digits_is_no_version(tmp_path, version):
    add_version(tmp_path, "a", 1)
    registry, _ = registry_over(tmp_path)
    asyncio.run(registry.poll())
    with pytest.raises(RequestError, match=f"model 'a' has no version '{version}'; available: '1'") as refused:
        registry.resolve("a", version)
    assert refused.value.kind == ErrorKind.NOT_FOUND


def test_a_model_name_past_the_limit_is_refused_without_echoing_it_whole():
    with pytest.raises(RepositoryPathError) as refused:
        check_model_name("a" * 65536)
    said = str(refused.value)
    assert said.startswith("model name 'aaaa") and "... (65536 characters) is not allowed" in said and len(said) < 250


def test_a_new_version_that_fails_to_load_leaves_the_served_one_serving(tmp_path):
    add_version(tmp_path, "a", 1)
    registry, loader = registry_over(tmp_path)

    async def scenario():
        await registry.poll()
        add_version(tmp_path, "a", 2)
        loader.refuse["a", 2] = "model.onnx: sha256 does not match the manifest"
        await registry.poll()

    asyncio.run(scenario())
    assert states(registry) == {("a", "1"): READY, ("a", "2"): UNAVAILABLE}
    assert registry.resolve("a", "").key == ("a", 1)
    reason = dict(((n, v), r) for n, v, _, r in registry.index())["a", "2"]
    assert "sha256" in reason


def test_a_failed_version_is_not_tried_again_until_its_folder_changes(tmp_path):
    folder = add_version(tmp_path, "a", 1)
    registry, loader = registry_over(tmp_path)
    loader.refuse["a", 1] = "cut short"

    async def scenario():
        await registry.poll()
        await registry.poll()
        assert loader.loads == [("a", 1)]
        del loader.refuse["a", 1]
        rewrite_in_place(folder / "model.onnx", b"weights v2")
        await registry.poll()

    asyncio.run(scenario())
    assert loader.loads == [("a", 1), ("a", 1)] and states(registry) == {("a", "1"): READY}


def test_a_version_refused_while_its_files_were_rewritten_is_tried_again_once_they_are_written(tmp_path):
    # The load read the folder half-way through a copy into it and was refused; the copy then finished
    # before the load returned. The finished folder is not the one that was refused.
    folder = add_version(tmp_path, "a", 1)
    registry, loader = registry_over(tmp_path)
    loader.refuse["a", 1] = "model.onnx: sha256 does not match the manifest"
    loader.while_loading = lambda: rewrite_in_place(folder / "model.onnx", b"weights v2")

    async def scenario():
        await registry.poll()
        assert states(registry) == {("a", "1"): UNAVAILABLE}
        del loader.refuse["a", 1]
        await registry.poll()

    asyncio.run(scenario())
    assert loader.loads == [("a", 1), ("a", 1)] and states(registry) == {("a", "1"): READY}


def test_a_served_version_whose_files_changed_is_swapped_and_the_old_one_unloaded(tmp_path):
    folder = add_version(tmp_path, "a", 1)
    registry, loader = registry_over(tmp_path)

    async def scenario():
        await registry.poll()
        first = registry.resolve("a", "1")
        first.enter()  # a request in flight on the old session
        rewrite_in_place(folder / "model.onnx", b"weights v2")
        poll = asyncio.create_task(registry.poll())
        while registry.resolve("a", "1") is first:
            await asyncio.sleep(0)
        assert loader.unloads == []  # the old one finishes its request first
        first.leave()
        await poll
        return first

    first = asyncio.run(scenario())
    assert loader.unloads == [("a", 1)] and registry.resolve("a", "1") is not first


def test_a_model_folder_removed_from_the_repository_is_unloaded_and_leaves_the_index(tmp_path):
    add_version(tmp_path, "a", 1)
    add_version(tmp_path, "b", 1)
    registry, loader = registry_over(tmp_path)

    async def scenario():
        await registry.poll()
        shutil.rmtree(tmp_path / "b")
        await registry.poll()

    asyncio.run(scenario())
    assert loader.unloads == [("b", 1)] and states(registry) == {("a", "1"): READY}
    assert registry.served_names() == ["a"]
