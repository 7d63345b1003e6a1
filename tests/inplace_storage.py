"""A throwaway kind of storage, written by following `_storage/README.md` ("How to add a
storage") to try it: a folder on a file system without an atomic rename nor hard
links (some FUSE mounts). Its step store, `InPlace`, writes a step under its final
name and commits it as a bucket does, with marker files (ours first, Orbax's commit
marker last); its chunk store, `CopyingChunks`, is the local one whose `link` copies.
`test_storage_protocol.py` runs the protocols' contract against it. Not part of the
package: nothing in it is promised to users."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable

from jax_cb_ckpt._layout import _format
from jax_cb_ckpt._layout._format import (
    COMMIT_NAME,
    COMPLETE,
    COMPLETE_KEYS,
    FORMAT,
    ITEMS,
    META_FILE,
    META_ITEM,
    META_MAX_BYTES,
    ORBAX_STEP_FILE,
    OURS_NAME,
    SMALL_FILE_MAX_BYTES,
    STATE_ITEM,
    STEP_FILES,
    DamagedStep,
    Examined,
)
from jax_cb_ckpt._storage._durable import NoSync, Sync
from jax_cb_ckpt._storage._local import LocalChunks
from jax_cb_ckpt._storage._lock import DirectoryLock
from jax_cb_ckpt._storage._protocol import OpenedStep, StepIdentity


class CopyingChunks(LocalChunks):
    """The local chunk store, on a file system without hard links: a link is a copy."""

    def link(self, source: str, target: str) -> None:
        path, target_path = self.location(source), self.location(target)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(f"{path} is not a regular file: not linked")
        os.makedirs(os.path.dirname(target_path), exist_ok=True)
        with open(path, "rb") as f, open(target_path, "xb") as out:
            shutil.copyfileobj(f, out)


class InPlace:
    """The steps of a folder, written in place and committed by a marker written last."""

    opened_at_once = 1
    marks_items = False

    def __init__(self, path: str) -> None:
        self.path = path
        self._files = CopyingChunks(path)

    def _at(self, step: int | str) -> str:
        return os.path.join(self.path, str(step))

    def _keys(self, step: int | str) -> set[str]:
        root = self._at(step)
        found = set()
        for folder, _, files in os.walk(root):
            found |= {os.path.relpath(os.path.join(folder, f), root) for f in files}
        return found

    def _examine(self, step: int | str) -> Examined:
        keys = self._keys(step)
        if COMPLETE_KEYS <= keys:
            return COMPLETE
        if OURS_NAME in keys and COMMIT_NAME in keys:
            return Examined("damaged", f"committed, but {sorted(COMPLETE_KEYS - keys)} missing")
        if OURS_NAME in keys:
            return _format.UNFINISHED
        return Examined("foreign", "not a complete jax_cb_ckpt checkpoint")

    def _writer(self, step: int | str) -> str | None:
        marker = self._files.get(f"{step}/{OURS_NAME}", SMALL_FILE_MAX_BYTES)
        return json.loads(marker).get("writer") if marker else None

    def _remove(self, name: str) -> None:
        path = os.path.join(self.path, name)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)

    # -- what is there

    def examine_all(self) -> dict[int, Examined]:
        names = os.listdir(self.path) if os.path.isdir(self.path) else []
        return {int(n): self._examine(n) for n in names if _format.is_step_name(n)}

    def is_checkpoint(self, step: int) -> bool:
        return self._examine(step).kind == "complete"

    def unfinished_steps(self) -> list[tuple[int, str]]:
        found = self.examine_all().items()
        return [(s, self._at(s)) for s, f in sorted(found) if f is _format.UNFINISHED]

    def set_aside_steps(self) -> list[tuple[int, str, str]]:
        found = []
        for name in os.listdir(self.path):
            match = _format.SET_ASIDE_PATTERN.fullmatch(name)
            if match is not None:
                note = self._files.get(f"{name}/{_format.SET_ASIDE_NOTE}", SMALL_FILE_MAX_BYTES)
                found.append((int(match.group(1)), name, _format.read_set_aside_note(note)))
        return sorted(found)

    def is_directory(self) -> bool:
        return os.path.isdir(self.path)

    def make(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def identity(self) -> tuple[int, int] | None:
        return None  # the lock says whose the folder is

    # -- one step, read

    def open_step(self, step: int) -> OpenedStep:
        found = self._examine(step)
        if found.kind == "damaged":
            raise DamagedStep(found.why)
        if found.kind != "complete":
            raise FileNotFoundError(f"{self._at(step)} is not a complete step")
        get = self._files.get_within
        record = _format.record_of(get(f"{step}/{ORBAX_STEP_FILE}", SMALL_FILE_MAX_BYTES) or b"")
        text = get(f"{step}/{META_ITEM}/{META_FILE}", META_MAX_BYTES) or b""
        seen = os.stat(os.path.join(self._at(step), COMMIT_NAME))
        meta = _format.check_meta_bytes(text, step, record)
        return OpenedStep(step, (seen.st_dev, seen.st_ino), meta)

    def still_there(self, step: int, seen: StepIdentity) -> bool:
        try:
            now = os.stat(os.path.join(self._at(step), COMMIT_NAME))
        except OSError:
            return False
        return self.is_checkpoint(step) and (now.st_dev, now.st_ino) == seen

    # -- one step, written and committed

    def step_sync(self) -> NoSync:
        return NoSync()  # (a throwaway: nothing made durable)

    def temp_path(self, step: int, temp_name: str) -> str:
        return self._at(step)  # written in place: no rename here

    def begin(self, temp: str, token: str = "") -> None:
        for item in ITEMS:
            os.makedirs(os.path.join(temp, item), exist_ok=True)
        marker = json.dumps({"format": FORMAT, "writer": token}).encode()
        self._files.create(f"{os.path.basename(temp)}/{OURS_NAME}", marker)

    def enter_attempt(self, temp: str, part: str) -> None:
        os.makedirs(os.path.join(temp, STATE_ITEM, part), exist_ok=True)

    def commit(self, temp: str, final: str, nbytes: int, sync: Sync) -> None:
        marker = _format.COMMITTED
        name = os.path.basename(final)
        for item in ITEMS:
            self._files.create(f"{name}/{item}/{COMMIT_NAME}", marker)
        self._files.create(f"{name}/{COMMIT_NAME}", marker)  # listed from now on

    def clean_failed(self, name: str, token: str, error: BaseException) -> str | None:
        self.remove_temp(name, token)
        return None

    # -- the lock and the fences

    def lock(self, name: str) -> DirectoryLock:
        return DirectoryLock(self.path, name)

    def fence(self, name: str, token: str, check: Callable[[], None]) -> None:
        check()
        if self._writer(name) != token:
            raise FileExistsError(f"step {self._at(name)} is no longer the one begun")

    def check_directory(self, identity: tuple[int, int] | None, lock: DirectoryLock) -> None:
        if not lock.still_ours():
            raise FileNotFoundError(f"the lock of {self.path!r} is no longer ours")

    # -- steps going away

    def set_aside(self, step: int) -> str | None:
        if not self.is_checkpoint(step):
            return None
        os.unlink(os.path.join(self._at(step), COMMIT_NAME))  # unlisted
        return self._at(step)

    def remove_aside(self, aside: str) -> None:
        self._remove(os.path.basename(aside))

    def remove_step(self, step: int) -> bool:
        aside = self.set_aside(step)
        if aside is not None:
            self.remove_aside(aside)
        return aside is not None

    def set_aside_damaged(self, step: int, why: str) -> str | None:
        keys = self._keys(step)
        if OURS_NAME not in keys and COMMIT_NAME not in keys:
            return None
        name = _format.set_aside_name(step)
        for key in sorted(keys):  # no rename here: each file linked (copied) over
            self._files.link(f"{step}/{key}", f"{name}/{key}")
        self._files.put(f"{name}/{_format.SET_ASIDE_NOTE}", _format.set_aside_note(step, why))
        self._remove(str(step))
        return name

    def remove_temp(self, name: str, writer: str = "") -> None:
        keys = self._keys(name)
        if OURS_NAME in keys and COMMIT_NAME not in keys and self._writer(name) == writer:
            self._remove(name)

    def remove_run_temps(self, run: str) -> None:
        pass  # no temporary names here

    def clean_leftovers(self, dead_writer: str = "") -> list[str]:
        for step, found in self.examine_all().items():
            whole = STEP_FILES <= self._keys(step)
            if found is _format.UNFINISHED and (not whole or self._writer(step) == dead_writer):
                self._remove(str(step))
        return []
