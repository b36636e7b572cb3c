"""The model repository's layout, as Triton lays it out: ``DIR/<model>/<version>/``, each version a model
folder written by ``mhaserve export``. Torch-free: export writes the next version, the server reads them.

Names and versions that come from requests go through ``version_dir``, which never returns a path
outside the repository: a model name is one plain path component, a version is digits, and the
resolved path (symlinks followed) must still lie under the repository's own resolved path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# One path component a human would type: no separators, no leading dot (so no '.', '..' or hidden folders).
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
VERSION = re.compile(r"[1-9][0-9]{0,8}")
MODEL_CONFIG_FILE = "config.pbtxt"  # a model's own configuration, beside its version folders (server.model_config)


class RepositoryPathError(ValueError):
    """A model name or version that is not a folder of this repository (or would lead outside it)."""


def check_model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        # a name past the limit is shown cut, with its length: a refusal does not echo a client's 64 KiB back
        shown = repr(name) if len(name) <= 128 else f"{name[:40]!r}... ({len(name)} characters)"
        raise RepositoryPathError(
            f"model name {shown} is not allowed: expected letters, digits, '_', '.' or '-' (at most 128), "
            "not starting with '.' or '-'"
        )
    return name


class ModelRepository:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def model_names(self) -> list[str]:
        """Folders that can be models (hidden and oddly named entries are skipped), sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if MODEL_NAME.fullmatch(p.name) and p.is_dir())

    def misplaced(self) -> str | None:
        """What the folder is instead, where it is not a repository but something a user may take for one: a model
        folder itself, or one model's folder of versions. None otherwise."""
        from .model_dir import MANIFEST_FILE

        if (self.root / MANIFEST_FILE).is_file():
            return (
                f"{self.root} is a model folder (it holds {MANIFEST_FILE}), not a repository of them: serve it with "
                f"--model-dir {self.root}, or put it in a repository as REPOSITORY/NAME/1/"
            )
        entries = sorted(self.root.iterdir()) if self.root.is_dir() else []
        versions = [p.name for p in entries if VERSION.fullmatch(p.name)]
        if versions and any((self.root / v / MANIFEST_FILE).is_file() for v in versions):
            return (
                f"{self.root} holds version folders ({', '.join(versions)}): it is one model's folder; give the folder "
                f"above it as --model-repository ({self.root.parent})"
            )
        return None

    def model_dir(self, name: str) -> Path:
        return self._inside(self.root / check_model_name(name), f"model {name!r}")

    def versions(self, name: str) -> list[int]:
        """The model's version folders, ascending (a half-written export's staging folder is hidden)."""
        directory = self.model_dir(name)
        if not directory.is_dir():
            return []
        return sorted(int(p.name) for p in directory.iterdir() if VERSION.fullmatch(p.name) and p.is_dir())

    def version_dir(self, name: str, version: int | str) -> Path:
        text = str(version)
        if not VERSION.fullmatch(text):
            raise RepositoryPathError(f"version {text!r} is not allowed: expected a positive integer")
        return self._inside(self.model_dir(name) / text, f"model {name!r} version {text}")

    def version_stamp(self, name: str, number: int) -> tuple:
        """What the version's folder holds now, as the file system identifies it: the folder's own device and
        inode, and each file's relative name, device, inode, size and modification time (a symlinked file by
        its target). Any rewrite, replacement or rename of the folder or a file in it changes the stamp, and so
        does one of the model's config.pbtxt beside the version folders (every version is served as it says).

        Every file, at any depth, must resolve inside the repository: model.onnx, the manifest and external
        data are read from this folder, so a symlink out of it is refused (RepositoryPathError)."""
        directory = self.version_dir(name, number)
        try:
            own = directory.stat()
            files = []
            for parent, _, names in os.walk(directory):
                for file_name in names:
                    path = Path(parent, file_name)
                    relative = str(path.relative_to(directory))
                    self._inside(path, f"model {name!r} version {number}: file {relative!r}")
                    info = path.stat()
                    files.append((relative, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
            config = directory.parent / MODEL_CONFIG_FILE
            if config.exists():
                self._inside(config, f"model {name!r}: file {MODEL_CONFIG_FILE!r}")
                info = config.stat()
                files.append((f"../{MODEL_CONFIG_FILE}", info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
        except FileNotFoundError:  # the folder, or a dangling link in it: stamped as absent
            return ()
        return ((own.st_dev, own.st_ino), *sorted(files))

    def next_version(self, name: str) -> int:
        versions = self.versions(name)
        return versions[-1] + 1 if versions else 1

    def _inside(self, path: Path, what: str) -> Path:
        root = self.root.resolve()
        resolved = path.resolve()
        if resolved != root and root not in resolved.parents:
            raise RepositoryPathError(f"{what} leads outside the model repository (a symlink to {resolved})")
        return path


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions of a model are served, as Triton's version_policy names it."""

    kind: str  # latest | all | specific
    count: int = 1  # latest: how many
    versions: tuple[int, ...] = ()  # specific: which

    @classmethod
    def parse(cls, text: str) -> VersionPolicy:
        """``latest``, ``latest:N``, ``all`` or ``specific:1,3``."""
        kind, _, argument = text.strip().partition(":")
        try:
            if kind == "all" and not argument:
                return cls("all")
            if kind == "latest":
                count = int(argument) if argument else 1
                if count >= 1:
                    return cls("latest", count=count)
            if kind == "specific":
                versions = tuple(sorted({int(v) for v in argument.split(",")}))
                if versions and versions[0] >= 1:
                    return cls("specific", versions=versions)
        except ValueError:
            pass
        raise ValueError(f"version policy {text!r}: expected latest, latest:N, all or specific:V[,V...]")

    @classmethod
    def holds(cls, text: str) -> bool:
        try:
            cls.parse(text)
        except ValueError:
            return False
        return True

    def select(self, available: list[int]) -> list[int]:
        if self.kind == "all":
            return sorted(available)
        if self.kind == "latest":
            return sorted(available)[-self.count :]
        return sorted(v for v in available if v in self.versions)

    def __str__(self) -> str:
        if self.kind == "latest":
            return f"latest:{self.count}"
        if self.kind == "specific":
            return "specific:" + ",".join(map(str, self.versions))
        return "all"
