"""Multi-process runs (`jax.distributed`): one writer per process, one checkpoint per step.

Every process creates a Checkpointer on the same directory. Each process's writer
writes the blocks its own devices handed over (Orbax's per-process OCDBT files,
`state/ocdbt.process_<i>/`); process 0, the primary, makes the temporary directory,
writes the small items, merges and commits. The processes agree through JAX's
coordination service (the key-value store that `jax.distributed.initialize` starts),
never through a device collective: a writer thread cannot take part in one while the
training program holds the devices.

Per attempt at a step, keys under `jax_cb_ckpt/<run>/<step>.<attempt>/`:

1. `ready`: the primary made the temporary directory (or says why it could not);
2. `wrote/<i>`: process i wrote its part (or why it failed);
3. `commit`: the primary's verdict: renamed into place only when every process wrote.

The keys and what travels under them belong to the round of one step (`GroupRound`,
made by `Group.begin`); a run of one process plays the same round alone (`SoloRound`).

Every wait has a timeout (`peer_timeout`), so a process that died makes the others fail
with an error naming it, and a step that some process did not write is never listed.
Every call to the service is bounded in this process too (`_bounded`): the service
runs inside process 0, and while process 0 is stopped (SIGSTOP, a debugger, a host
swapping) a call does not return, whatever timeout it was given (the timeout is the
service's). A process that wrote its part but heard no verdict says that whether the
step was committed is unknown: process 0 may commit it once it runs again.

At opening, the processes check that they see one directory, not one path each (a
local disk per host, a private mount): otherwise each process would write its blocks
where the others never look, process 0 would list every step, and none would restore.
Process 0 writes a file with a fresh nonce into the directory and publishes the nonce;
every other process reads the file back and says what it found; process 0 removes the
file and gives the verdict, and every process raises the same `ConfigError` on a
failure. Keys under `jax_cb_ckpt/open/<directory>/<n>/`: `sees/<i>`, `verdict`.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar

import jax

from .._base._errors import CheckpointError, ConfigError, SaveError
from .._base._heartbeat import Heartbeat
from .._layout import _format
from .._storage import _faults, _places
from .._storage._protocol import Storage

OK = "ok"
# The check file of an opening; only ever there while a run opens the directory (a
# leftover of a process 0 killed right then is removed at its next opening).
NONCE_PREFIX = ".jax_cb_ckpt.nonce-"
# The kinds of a failed check's verdict, as they travel through the key-value store.
_VERDICT_ERRORS: dict[str, type[CheckpointError]] = {"config": ConfigError, "save": SaveError}
_openings: dict[tuple[str, int], int] = {}
# How much longer than asked a call to the coordination service may take before it is
# given up on (the module doc: only a stopped process 0 holds a call for good).
_SLACK_S = 5.0
# How long a peer last seen at work on the step may stay silent (see `_get`).
_SILENCE_S = 5.0
_openings_lock = threading.Lock()
Sums = dict[str, dict[str, int]]  # a part's checksums: {leaf name: {region key: crc32}}
logger = logging.getLogger("jax_cb_ckpt")


class VerdictUnknown(SaveError):
    """This process wrote its part of a step, and heard no verdict from process 0."""


class Client(Protocol):
    """What a Group uses of JAX's coordination-service client (jaxlib's
    `DistributedRuntimeClient`, which has no stubs)."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
    def key_value_try_get(self, key: str) -> str: ...
    def key_value_delete(self, key: str) -> None: ...


_T = TypeVar("_T")


def _bounded(fn: Callable[..., _T], *args: object, bound_s: float) -> _T:
    """`fn(*args)`, given up after `bound_s` with TimeoutError (the module doc: a call
    to a stopped process 0 returns only when it runs again). The call runs in a daemon
    thread of its own, which is left to end whenever the call does; a few per step."""
    result: list[_T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def call() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=call, name="jax_cb_ckpt-coordination", daemon=True).start()
    if not done.wait(bound_s):
        raise TimeoutError(
            f"no answer from the coordination service in {bound_s:g} s (process 0, "
            "which runs it, is stopped or cannot be reached)"
        )
    if error:
        raise error[0]
    return result[0]


def _client() -> Client:
    """JAX's coordination-service client (started by `jax.distributed.initialize`)."""
    from jax._src import distributed  # private: JAX has no public handle on it

    client = distributed.global_state.client
    if client is None:
        raise ConfigError(
            f"this run has {jax.process_count()} processes but no jax.distributed "
            "client; the checkpointer coordinates processes through it. Fix: call "
            "jax.distributed.initialize(...) in every process before creating it."
        )
    return client


class Group:
    """The processes of one run writing one directory together."""

    def __init__(
        self,
        directory: str,
        timeout_s: float,
        list_steps: Callable[[], list[int]],
        *,
        client: Client | None = None,
        index: int | None = None,
        count: int | None = None,
    ) -> None:
        """Opens the directory with the others (blocks until every process did, or
        raises the same error in every process). `client`, `index`, `count`: this
        process's (jax.distributed's) unless given; tests give a group of threads in
        one process a client each."""
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count
        self.timeout_s = timeout_s
        self._client = _client() if client is None else client
        self._attempts: dict[int, int] = {}
        self._previous: str | None = None  # the primary's last attempt with keys
        # The n-th Checkpointer on this directory, in every process; a failed opening
        # (process 0 not there yet) does not count, so a retry waits for the same one.
        with _openings_lock:  # (by index too: a group of threads shares the process)
            opening = _openings.get((directory, self.index), 0)
        key = f"jax_cb_ckpt/open/{directory}/{opening}"
        if self.primary:
            self.run = uuid.uuid4().hex
            self.old_steps: list[int] = list_steps()
            nonce, trouble = _write_nonce(_places.at(directory), self.run)
            self._call("key_value_set", key, json.dumps([self.run, self.old_steps, nonce]))
        else:
            value = self._get(
                key,
                "process 0 to open the directory",
                None,
                "Every process must create its Checkpointer on the same directory path, "
                "in the same order.",
            )
            self.run, self.old_steps, nonce = json.loads(value)
            trouble = None
        with _openings_lock:
            _openings[directory, self.index] = opening + 1
        self._check_shared(directory, key, nonce, trouble)
        # Liveness: each process says every `beat_s` that it lives, which step its
        # writer works on and which step it last began to hand over. A wait for a
        # peer at work on the same step is extended (a large write or hand-off takes
        # as long as it takes); a wait for a dead peer, or one at other steps (the
        # processes did not make the same saves, or one is far behind), is not.
        self.writing: int | None = None
        self.handing: int | None = None
        self._beat_s = min(1.0, timeout_s / 4)
        self._beats = itertools.count()
        self._beats_lock = threading.Lock()
        self._heartbeat = Heartbeat("jax_cb_ckpt-heartbeat", self._beat_s, self._beat_on)
        self._beat()
        self._heartbeat.start()

    def _check_shared(self, directory: str, key: str, nonce: str, trouble: str | None) -> None:
        """Every process sees the directory process 0 opened (the module doc), or every
        process raises the same error. Before the heartbeat starts: nothing to stop."""
        storage, name = _places.at(directory), NONCE_PREFIX + self.run
        if not self.primary:
            self._call(
                "key_value_set", f"{key}/sees/{self.index}", _read_nonce(storage, name, nonce)
            )
            kind, message = json.loads(
                self._get(f"{key}/verdict", "process 0 to check the directory", None, "")
            )
            if kind != OK:
                raise _VERDICT_ERRORS[kind](message)
            return
        blind: list[str] = []
        late: SaveError | None = None
        try:
            for i in range(1, self.count):
                found = self._get(
                    f"{key}/sees/{i}",
                    f"process {i} to check the directory",
                    None,
                    "Every process must create its Checkpointer on the same directory "
                    "path, in the same order.",
                )
                if found != OK:
                    blind.append(f"process {i} {found}")
                try:  # read once, by this process only
                    self._call("key_value_delete", f"{key}/sees/{i}")
                except Exception:
                    pass
        except SaveError as e:  # a process died while opening: say so everywhere
            late = e
        finally:
            _remove_nonce(storage, name)
        if late is not None:
            verdict = ["save", str(late)]
        elif trouble is not None:
            verdict = ["config", f"Checkpointer(directory={directory!r}): process 0 {trouble}."]
        elif blind:
            verdict = ["config", _not_shared(directory, NONCE_PREFIX + self.run, blind)]
        else:
            verdict = [OK, ""]
        self._call("key_value_set", f"{key}/verdict", json.dumps(verdict))
        if late is not None:
            raise late
        if verdict[0] != OK:
            raise ConfigError(verdict[1])

    def _call(self, name: str, *args: object, bound_s: float | None = None) -> object:
        """The client's method `name`, bounded by `bound_s` (default: peer_timeout, at
        least `_SLACK_S`). The bound only stops a call to a stopped process 0 from
        blocking for good: it is generous, since a loaded machine answers slowly and
        a call given up on early would fail a save that was fine."""
        bound = max(self.timeout_s, _SLACK_S) if bound_s is None else bound_s
        return _bounded(getattr(self._client, name), *args, bound_s=bound)

    def _alive_key(self, index: int) -> str:
        return f"jax_cb_ckpt/{self.run}/alive/{index}"

    def _beat(self) -> None:
        """Say this process lives, and what it works on (a new value every time).
        Unbounded, called directly: a caller may as well wait while process 0 is
        stopped, and a thread per beat (`_bounded`) let a writer busy with a large
        state hold the beats back past a short peer_timeout."""
        with self._beats_lock:
            n = next(self._beats)
            value = f"{n} {self.writing} {self.handing}"
            self._client.key_value_set(self._alive_key(self.index), value, allow_overwrite=True)

    def _beat_on(self) -> bool:
        """A heartbeat's beat: False once the service is gone (the waits report it)."""
        try:
            self._beat()
        except Exception:
            return False
        return True

    def close(self) -> None:
        """Stop saying this process lives (its writer has stopped)."""
        self._heartbeat.stop()
        try:
            self._call("key_value_delete", self._alive_key(self.index))
        except Exception:  # the service is gone already
            pass

    @property
    def primary(self) -> bool:
        return self.index == 0

    def begin(self, step: int) -> GroupRound:
        """A new attempt at `step`, as a round (`GroupRound`): a step whose write failed
        may be saved again, and must not read the verdicts of the failed attempt. Every
        process makes the same saves in the same order, so the attempt numbers agree."""
        self._attempts[step] = self._attempts.get(step, -1) + 1
        self.writing = step
        try:  # at once: a peer waiting for this step sees it at work from now on
            self._beat()
        except Exception:  # the service is gone: the waits report it
            pass
        return GroupRound(self, step, self._attempts[step])

    def _heard_all(self, prefix: str) -> None:
        """The primary heard every process's report of the attempt `prefix`: each process
        is done with the attempt it handled before (its writer takes one step at a time),
        so that attempt's keys are deleted; the coordination service keeps them in
        memory."""
        if self._previous is not None:
            try:
                self._call("key_value_delete", self._previous)
            except Exception:  # housekeeping: the save goes on without it
                pass
        self._previous = prefix

    def _publish(self, key: str, value: str, what: str) -> None:
        try:
            self._call("key_value_set", key, value)
        except Exception as e:  # the service lives in process 0
            raise SaveError(
                f"process {self.index} could not tell the others {what} through the "
                f"coordination service, which process 0 runs ({type(e).__name__}: {e}). "
                "Process 0 has died or cannot be reached. Fix: restart every process of "
                "the run; they resume from the last complete checkpoint."
            ) from e

    def _await_peer(self, key: str, what: str, peer: int, step: int) -> str:
        """The value process `peer` tells under `key`: waited for while `peer`'s writer
        works on `step`, and at most `timeout_s` more once it does not."""
        return self._get(key, what, (peer, step), "")

    def hand_over(self, step: int) -> None:
        """This process began to hand `step` over (called from JAX's callbacks)."""
        self.handing = step

    def _get(self, key: str, what: str, peer: tuple[int, int] | None, fix: str) -> str:
        """The value under `key`, waited for `timeout_s` after the last sign of work on
        this step from `peer` (its heartbeat, looked at before every give-up: a wait
        that overran its deadline, on a loaded machine, is not the peer's silence)."""
        deadline = time.monotonic() + self.timeout_s
        heard = None  # the peer's last heartbeat
        while True:
            left = deadline - time.monotonic()
            wait_s = max(0.001, min(left, 2 * self._beat_s if peer is not None else left))
            try:
                got = self._call(
                    "blocking_key_value_get", key, int(wait_s * 1000), bound_s=wait_s + _SLACK_S
                )
                return str(got)
            except Exception as e:
                answered = not isinstance(e, TimeoutError) and "DEADLINE_EXCEEDED" not in str(e)
                if answered:
                    raise self._in_vain(what, fix, e) from e
                last = e
            if peer is not None:
                beat = self._peer_beat(peer[0])
                if beat is not None and beat != heard and str(peer[1]) in beat.split()[1:]:
                    # At work on it: wait on. Its heartbeat may pause for a while as it
                    # writes a large leaf (the writer holds the GIL in copies), so a
                    # short peer_timeout gives way to `_SILENCE_S` here.
                    deadline = time.monotonic() + max(self.timeout_s, _SILENCE_S)
                heard = beat
            if time.monotonic() >= deadline:
                raise self._in_vain(what, fix, last) from last

    def _peer_beat(self, index: int) -> str | None:
        try:
            return str(self._call("key_value_try_get", self._alive_key(index), bound_s=_SLACK_S))
        except Exception:
            return None

    def _in_vain(self, what: str, fix: str, e: BaseException) -> SaveError:
        return SaveError(
            f"process {self.index} waited for {what} in vain: no sign of work from it "
            f"for {self.timeout_s:g} s ({type(e).__name__}: {e}). That process has "
            "died, hangs, or did not "
            f"make the same call.{' ' + fix if fix else ''} Fix: restart every "
            "process of the run; they resume from the last complete checkpoint "
            "(Checkpointer(peer_timeout=...) sets how long to wait)."
        )


class GroupRound:
    """One attempt at one step, as the processes of a run agree on it (the module doc):
    the primary `start`s it, every process `report`s its part, the primary `collect`s
    the reports and `decide`s; a peer `await_start`s and `await_verdict`s. The keys
    (`ready`, `wrote/<i>`, `commit`) and what travels under them are this class's.

    A report is `ok <json>` (the part's checksums, {name: {region: crc32}}) or why the
    process failed; a decision is `ok` or why the step was not committed."""

    def __init__(self, group: Group, step: int, attempt: int) -> None:
        self.step = step
        self.index, self.count, self.primary = group.index, group.count, group.primary
        # The attempt's temporary directory, the same in every process of the run (32
        # hex digits after the prefix, as the cleanup of leftovers expects).
        self.temp_name = _format.run_temp_name(step, group.run, attempt)
        self._group = group
        self._prefix = f"jax_cb_ckpt/{group.run}/{step}.{attempt}"
        self._owed = False  # the primary owes the others a decision

    def start(self, error: BaseException | None) -> None:
        """The primary made the place the step is written to (or says why it could not:
        `error`); from then on it owes the others a decision."""
        self._publish("ready", OK if error is None else _reason(error), "that it started")
        self._owed = error is None

    def await_start(self) -> None:
        """A peer: until the primary started the step; SaveError when it could not."""
        ready = self._await_peer("ready", f"process 0 to start step {self.step}", 0)
        if ready != OK:
            raise SaveError(f"process 0 could not start step {self.step}: {ready}")

    def report(self, error: BaseException | None, sums: Sums | None = None) -> None:
        """Every process: it wrote its part, with its blocks' checksums `sums` (or why
        it failed: `error`)."""
        outcome = f"{OK} {json.dumps(sums or {})}" if error is None else _reason(error)
        self._publish(f"wrote/{self.index}", outcome, "that it wrote its part")

    def collect(self, sums: Sums) -> Sums:
        """The primary: every other process's report, its checksums merged into `sums`
        (the primary's own); SaveError naming each process that failed."""
        problems = []
        for other in range(1, self.count):
            what = f"process {other} to write its part of step {self.step}"
            outcome = self._await_peer(f"wrote/{other}", what, other)
            if outcome.startswith(OK):
                for name, regions in json.loads(outcome[len(OK) :] or "{}").items():
                    sums.setdefault(name, {}).update(regions)
            else:
                problems.append(f"process {other}: {outcome}")
        self._group._heard_all(self._prefix)
        if problems:
            raise SaveError("; ".join(problems))
        return sums

    def committed(self, storage: Storage) -> None:
        """The primary committed the step: no process writes an earlier attempt now
        (each wrote its part of this step after them), so what is left of them goes."""
        storage.remove_run_temps(self._group.run)

    def decide(self, error: BaseException | None) -> None:
        """The primary's decision, told once if owed: committed (`error` None) or why
        not. Never raises: the step's outcome is settled on disk, and a peer that hears
        nothing says its outcome is unknown (`VerdictUnknown`)."""
        if not self._owed:
            return
        self._owed = False
        try:
            self._publish("commit", OK if error is None else _reason(error), "its decision")
        except SaveError as e:
            logger.warning("%s", e)

    def await_verdict(self) -> None:
        """A peer, after its report: until the primary decides. SaveError when the step
        was not committed; `VerdictUnknown` when no decision comes."""
        try:
            verdict = self._await_peer("commit", f"process 0 to commit step {self.step}", 0)
        except SaveError as e:
            cause = e.__cause__ or e
            raise VerdictUnknown(
                f"process {self.index} wrote its part of step {self.step}, then heard no "
                f"verdict on it from process 0 in {self._group.timeout_s:g} s "
                f"({type(cause).__name__}: {cause}). Whether step {self.step} was "
                "committed is unknown: process 0 may still commit it (now, or once it "
                "runs again) or may have failed it. Fix: restart every process of the "
                "run; ckpt.latest_step() then says from which step they resume "
                "(Checkpointer(peer_timeout=...) sets how long to wait)."
            ) from e
        if verdict != OK:
            raise SaveError(f"step {self.step} was not committed: {verdict}")

    def _publish(self, name: str, value: str, what: str) -> None:
        self._group._publish(
            f"{self._prefix}/{name}", value, f"{what} ({name!r} of step {self.step})"
        )

    def _await_peer(self, name: str, what: str, peer: int) -> str:
        return self._group._await_peer(f"{self._prefix}/{name}", what, peer, self.step)


class Solo:
    """A run of one process, as a group of one: the writer has one path for one and
    many processes."""

    index = 0
    count = 1
    primary = True

    def __init__(self) -> None:
        self.writing: int | None = None

    def begin(self, step: int) -> SoloRound:
        self.writing = step
        return SoloRound(step)

    def close(self) -> None:
        pass


class SoloRound:
    """The round of a group of one: nobody to tell, nobody to wait for, and the
    primary's own checksums are all the checksums (`GroupRound`'s protocol)."""

    index = 0
    count = 1
    primary = True

    def __init__(self, step: int) -> None:
        self.step = step
        self.temp_name = _format.temp_name(step)

    def start(self, error: BaseException | None) -> None:
        pass

    def await_start(self) -> None:
        pass  # the one process is the one that starts it

    def report(self, error: BaseException | None, sums: Sums | None = None) -> None:
        pass

    def collect(self, sums: Sums) -> Sums:
        return sums

    def committed(self, storage: Storage) -> None:
        pass

    def decide(self, error: BaseException | None) -> None:
        pass

    def await_verdict(self) -> None:
        pass  # its own decision: the step is committed once `decide` is reached


Round = GroupRound | SoloRound  # one attempt at one step, in a run of many or of one
Processes = Group | Solo  # the processes writing a directory together


def _reason(e: BaseException) -> str:
    """What a process tells the others of its failure (it ends up in their errors)."""
    return _faults.scrub(f"{type(e).__name__}: {e}")


def _write_nonce(storage: Storage, run: str) -> tuple[str, str | None]:
    """Process 0's check file of this opening, holding a fresh nonce: the nonce, and
    what went wrong (None when written). Leftovers of earlier openings go first: this
    process holds the directory's lock, so no other run is opening it."""
    nonce = uuid.uuid4().hex
    try:
        for name in storage.names(NONCE_PREFIX):
            _remove_nonce(storage, name)
        storage.create_file(NONCE_PREFIX + run, nonce.encode())
    except OSError as e:  # (and a bucket's StorageError)
        return nonce, (
            f"cannot write the check file {NONCE_PREFIX + run!r} ({e}), with which every "
            "process checks that it sees the directory. Fix: make the directory writable "
            "(permissions, free space)"
        )
    return nonce, None


def _read_nonce(storage: Storage, name: str, nonce: str) -> str:
    """What this process finds in process 0's check file `name`: OK, or how it differs.
    A name never looked up before: no cache of a network file system can answer for it."""
    try:
        found = storage.read_file(name, 100)
    except OSError as e:
        return f"cannot read {name!r} there ({e})"
    if found is None:
        return f"finds no file {name!r} there"
    if found != nonce.encode():
        return f"finds other content in {name!r} ({found[:40]!r})"
    return OK


def _remove_nonce(storage: Storage, name: str) -> None:
    """Remove a check file (locally: a regular file of ours only, never a link)."""
    try:
        storage.remove_file(name)
    except OSError:  # gone already; the next opening removes a leftover
        pass


def _not_shared(directory: str, name: str, blind: list[str]) -> str:
    return (
        f"Checkpointer(directory={directory!r}): not every process of this run sees the "
        f"same directory at that path. Process 0 wrote the check file {name!r} into "
        f"it; {'; '.join(blind)}. Each process writes its own blocks of every step into "
        "the directory and process 0 commits what it sees, so with a directory that is "
        "not shared (a local disk per host, a private mount) steps would be listed that "
        "cannot be restored. Fix: put the directory on a file system that every process "
        "mounts at the same path (NFS, a cluster file system, a bucket mounted with "
        "FUSE), and pass that path to every process."
    )


def current(directory: str, timeout_s: float, list_steps: Callable[[], list[int]]) -> Group | None:
    """The run's Group when JAX runs several processes, else None."""
    if jax.process_count() == 1:
        return None
    return Group(directory, timeout_s, list_steps)  # resolved by _places.resolve
