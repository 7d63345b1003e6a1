"""Helpers shared by the tests (fixtures and strict settings live in conftest.py).

- states: `toy_state`, `toy_update`, `toy_reference`, `assert_same_state`, `state_at`;
- processes: `start_process`, `ProcessGroup`, `wait_for_step`, `kill_group`,
  `run_child`, `run_script`: the one driver for every test that starts, kills or
  interrupts a real child process (servers and multi-process runs too); `free_port`,
  `json_lines`; `PEAK_KIB`, a child's measure of its own peak memory.
- the docs' code blocks: `doc_blocks`, `doc_programs`, `doc_script`, `run_doc_program`.
"""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cb_ckpt

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def needs(module, extra, why=""):
    """A mark that skips a test where `module` is not installed, saying so in the
    summary (`-ra`): it comes with the project's `extra` extra (`why`: more of the
    reason, such as why an install may leave it out)."""
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} is not installed (pip install -e '.[{extra}]'){why}",
    )


# The interpreter under test first on PATH, as an activated venv would put it: a shell
# script a test runs (a docs recipe) calls `python` and the servers' console scripts by
# name, and CI runs `.venv/bin/python -m pytest` without activating the venv.
CHILD_ENV = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
)


def toy_state(n=4):
    """A small state with every kind of leaf the loop tests use."""
    return {
        "x": jnp.arange(n, dtype=jnp.float32),
        "count": jnp.asarray(0, jnp.int32),
        "key": jax.random.key(0),
        "half": jnp.zeros((n,), jnp.bfloat16),
    }


def state_at(step, n=3):
    """A small state whose values say which step it belongs to."""
    return {"w": jnp.full((n,), float(step)), "step": jnp.int32(step)}


def toy_update(state, step):
    """Exactly representable arithmetic: any compilation gives the same bits."""
    key, _ = jax.random.split(state["key"])
    x = state["x"] * 0.5 + step.astype(jnp.float32)
    return {
        "x": x,
        "count": state["count"] + step,
        "key": key,
        "half": x.astype(jnp.bfloat16),
    }


def toy_reference(n_steps, n=4, state=None):
    """The state after each step, computed eagerly one step at a time (no checkpointing),
    from `state` (default: `toy_state(n)`)."""
    state = toy_state(n) if state is None else state
    out = {}
    for step in range(n_steps):
        state = toy_update(state, jnp.asarray(step, jnp.int32))
        out[step] = state
    return out


def assert_same_state(a, b):
    """Bit-for-bit equality of two states with the same pytree structure and types."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), name
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y), name
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        xa, ya = np.asarray(x), np.asarray(y)
        assert xa.dtype == ya.dtype, name
        assert xa.shape == ya.shape, name
        assert xa.tobytes() == ya.tobytes(), name


# -- child processes -------------------------------------------------------------------


def start_process(args, *, ready=None, env=None, logs=None):
    """A child process (`args` for Popen) in a session of its own, so `kill_group` can
    kill it and anything it started. With `ready`, waits for that first stdout line.
    `env`: variables added to its environment. `logs`: (stdout, stderr) file paths to
    write its output to instead of pipes (a full pipe nobody reads would stall it)."""
    with contextlib.ExitStack() as files:  # the child has its own copies of the files
        if logs is None:
            stdout = stderr = subprocess.PIPE
        else:
            stdout, stderr = (files.enter_context(open(path, "w")) for path in logs)
        child = subprocess.Popen(
            args,
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=dict(CHILD_ENV, **(env or {})),
            start_new_session=True,
        )
    if ready is not None:
        line = child.stdout.readline().strip() if child.stdout else ""
        if line != ready:
            kill_group(child)
            raise AssertionError(f"the child printed {line!r}, not {ready!r}")
    return child


def start_script(tmp_path, text, *args, ready=None, env=None):
    """`start_process` of a Python script written from `text`."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(text))
    return start_process([sys.executable, str(script), *map(str, args)], ready=ready, env=env)


def run_child(args, *, timeout=240, cwd=ROOT, env=None):
    """Run a child process (`args`; `python ...` when args[0] is "python") to its end:
    its CompletedProcess, output captured as text. `env`: variables added to the
    children's environment (CHILD_ENV); cwd: the repository root by default."""
    args = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(args)]
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(CHILD_ENV, **(env or {})),
    )


# For a child's script that measures its own memory: `peak_kib()`, the peak RSS of the
# process, in KiB, from /proc's VmHWM, which starts anew at exec. getrusage's ru_maxrss
# does not: a child that Python starts (vfork + exec) begins with its parent's peak
# (pytest's, with JAX and TensorStore loaded: ~300 MiB), which hides any growth below it.
PEAK_KIB = """
def peak_kib():
    try:
        with open("/proc/self/status") as status:
            return int(next(s for s in status if s.startswith("VmHWM:")).split()[1])
    except (OSError, StopIteration):  # not Linux: the weaker measure
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""


def run_script(tmp_path, text, *args, timeout=240):
    """Run a Python script written from `text` to its end (cwd: the repository root)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    return run_child(["python", script, *args], timeout=timeout)


def kill_group(child):
    """SIGKILL the child's process group (if still there) and reap it."""
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    return child.communicate()


def free_port():
    """A TCP port on 127.0.0.1 free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def json_lines(printed):
    """The JSON lines a child printed (gloo prints lines of its own)."""
    return [json.loads(x) for x in printed.splitlines() if x.startswith("{")]


class ProcessGroup:
    """Processes that run together (the processes of one multi-process run), each
    started by `start_process` in a session of its own, output in files under
    `tmp_path`; every one is killed at the end of `wait`, or by `kill`."""

    def __init__(self, tmp_path, name, commands, env=None):
        self.logs = [
            (tmp_path / f"{name}-{i}.out", tmp_path / f"{name}-{i}.err")
            for i in range(len(commands))
        ]
        self.children = []
        try:
            for command, logs in zip(commands, self.logs, strict=True):
                self.children.append(start_process(command, env=env, logs=logs))
        except BaseException:
            self.kill()
            raise

    def kill(self):
        for child in self.children:
            kill_group(child)

    def signal(self, index, signum):
        os.kill(self.children[index].pid, signum)

    def printed(self, index):
        return self.logs[index][0].read_text()

    def errors(self, index):
        return self.logs[index][1].read_text()[-3000:]

    def wait(self, timeout):
        """Every process's exit code and last JSON line (None without one); a process
        still running after `timeout` seconds fails the test (a hang)."""
        deadline = time.monotonic() + timeout
        try:
            while any(c.poll() is None for c in self.children):
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no end in {timeout} s (a hang)\n"
                        + "\n".join(self.errors(i) for i in range(len(self.children)))
                    )
                time.sleep(0.05)
        finally:
            self.kill()
        results = []
        for i, child in enumerate(self.children):
            lines = json_lines(self.printed(i))
            results.append((child.returncode, lines[-1] if lines else None))
        return results


def wait_for_step(directory, step, child, timeout=120):
    """Wait until the child has a checkpoint >= `step` on disk (it must keep running)."""
    deadline = time.monotonic() + timeout
    while (jax_cb_ckpt.latest_step(directory) or 0) < step:
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child saved nothing"
        time.sleep(0.01)


def data_files(step_dir):
    """The state item's data files, largest first."""
    root = os.path.join(step_dir, "state")
    found = []
    for where, _dirs, files in os.walk(root):
        found += [os.path.join(where, f) for f in files if os.sep + "d" in where]
    return sorted(found, key=os.path.getsize, reverse=True)


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def flip_stored(step_dir, values):
    """Flip one bit inside the stored bytes of `values` (a stretch of a saved array,
    stored uncompressed): found in the step's data files wherever TensorStore put it, so
    the flipped byte is certainly data that a restore reads. (path, offset)."""
    pattern = np.ascontiguousarray(values).tobytes()
    for path in data_files(step_dir):
        with open(path, "rb") as f:
            at = f.read().find(pattern)
        if at >= 0:
            flip(path, at + len(pattern) // 2)
            return path, at + len(pattern) // 2
    raise AssertionError(f"the values are in no data file of {step_dir}")


def run_twice(tmp_path, code):
    """Run a documentation script twice in a fresh process, in `tmp_path` (its
    tempfile.mkdtemp() directories too), as a reader would run it again; the second
    run must not trip over the first one's checkpoints. The second run's result."""
    script = tmp_path / "block.py"
    script.write_text(code)
    for run in ("first", "second"):
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(CHILD_ENV, TMPDIR=str(tmp_path)),
        )
        assert result.returncode == 0, f"{run} run:\n{result.stderr[-3000:]}"
    return result


def checked_options(directory, **changes):
    """`_options.checked` of `directory` with the Checkpointer's defaults but
    `changes` (a stage's unit tests build the options without a Checkpointer)."""
    from jax_cb_ckpt._user._options import checked

    given = dict(
        every=None,
        max_to_keep=None,
        queue_size=2,
        on_full="block",
        compression=False,
        on_error="raise",
        on_existing="raise",
        crossing="auto",
        peer_timeout=60,
    )
    given.update(changes)
    return checked(directory, **given)


def same_as_tensorstore(root):
    """The package's own reader of OCDBT indexes (`_ocdbt`, which verify uses) finds
    every key TensorStore lists in the database at `root`, with the same bytes, and no
    other; the number of keys."""
    import tensorstore as ts

    from jax_cb_ckpt._layout import _ocdbt

    own = _ocdbt.Database(str(root))
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/"}).result()
    keys = kv.list().result()
    assert sorted(own.values) == sorted(keys)
    for key in keys:
        assert own.read(key.decode()) == kv.read(key).result().value, key
    return len(keys)


def while_batch(ckpt, ns, *, start=0, x=None, plain=False):
    """Members counting from `start` to `ns` in one vmapped while_loop, each saving its
    state `x` (the counter's value) plus one at its counter plus one when `ckpt` says
    (member k stops at ns[k]); then `ckpt.wait()`. The loop is `ckpt.while_loop` (the
    documented form), or `lax.while_loop` with `plain`. Returns the final states."""
    loop = jax.lax.while_loop if plain else ckpt.while_loop

    def run(x, start, n):
        def body(c):
            i, x = c
            ckpt.maybe_save(x + 1.0, i + 1)
            return i + 1, x + 1.0

        return loop(lambda c: c[0] < n, body, (start, x))[1]

    x = jnp.zeros(len(ns)) if x is None else x
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (len(ns),))
    final = jax.jit(jax.vmap(run))(x, start, jnp.asarray(ns))
    ckpt.wait()
    return np.asarray(final)


def fresh_copy(written, tmp_path):
    """A copy of the directory `written` (a module's fixture, saved once) in this test's
    own `tmp_path`: a test may change or delete its steps."""
    copy = tmp_path / "ckpt"
    shutil.copytree(written, copy)
    return copy


# -- the documentation's code blocks ------------------------------------------------------
#
# Every fenced block of README.md and docs/*.md is one of: ```text (output, a tree, a
# message: not code); a ```python or ```bash block that runs as written; or a block
# marked, in an HTML comment right above it (invisible on the page), with why it is not
# run here. The markers:
#
#   <!-- doc-test: skip: REASON -->    not run here; the reason is required (and a test it
#                                      names as tests/x.py::name must exist)
#   <!-- doc-test: setup               code run first, in the same process: the names a
#   CODE                               fragment takes from the program around it
#   -->
#   <!-- doc-test: after               code run after the block (checks of what it did)
#   CODE
#   -->
#   <!-- doc-test: continues -->       the block goes on from the one before it on the
#                                      page (one process, in order)

DOC_PAGES = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
DOC_LANGUAGES = ("python", "bash")  # run; "text" is shown only
_FENCE = re.compile(r"^( *)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*([\w-]+)\s*(?::\s*(.*?))?\s*(-->)?\s*$")


class DocBlock(NamedTuple):
    page: str  # "README.md", "docs/usage.md"
    line: int  # of the opening fence, 1-based
    language: str
    code: str  # dedented to the fence
    marks: dict  # {kind: reason or code ("" for continues)}
    problems: list  # what is wrong with its fence or its marks (the fast test fails on it)

    @property
    def id(self):
        return f"{self.page}:{self.line}"


def doc_blocks(page):
    """The fenced blocks of `page` (relative to the repository root), with their marks."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().split("\n")
    blocks, marks, problems, i = [], {}, [], 0
    while i < len(lines):
        line, i = lines[i], i + 1
        mark = _MARK.match(line)
        if mark:
            kind, reason, closed = mark.groups()
            body = []
            while not closed:
                if i >= len(lines):
                    problems.append(f"{page}:{i}: a doc-test mark that is never closed")
                    break
                text, i = lines[i], i + 1
                if text.strip() == "-->":
                    break
                body.append(text)
            if kind in marks:
                problems.append(f"{page}:{i}: two doc-test marks {kind!r} on one block")
            marks[kind] = (
                (reason or "")
                if kind != "setup" and kind != "after"
                else (textwrap.dedent("\n".join(body)) + "\n")
            )
            continue
        fence = _FENCE.match(line)
        if not fence:
            if line.strip() and marks:
                problems.append(
                    f"{page}:{i}: doc-test marks {sorted(marks)} not right above a block"
                )
                marks = {}
            continue
        indent, language = len(fence.group(1)), fence.group(2)
        start, code = i, []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            code.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        blocks.append(DocBlock(page, start, language, "\n".join(code) + "\n", marks, problems))
        marks, problems = {}, []
    if marks:
        problems.append(f"{page}: doc-test marks {sorted(marks)} after the last block")
    if problems:  # (marks left over: on the last block, so that the fast test sees them)
        if blocks:
            blocks[-1].problems.extend(problems)
        else:
            blocks.append(DocBlock(page, 0, "text", "", {}, problems))
    return blocks


def doc_programs(page):
    """The programs `page`'s blocks make: a list of lists of blocks (a block that
    `continues` joins the one before it), the blocks not run (text, skipped, of a
    language not run) left out."""
    programs = []
    for block in doc_blocks(page):
        if block.language not in DOC_LANGUAGES or "skip" in block.marks:
            continue  # (a block of another language fails the fast check instead)
        if "continues" in block.marks and programs:
            programs[-1].append(block)
        else:
            programs.append([block])
    return programs


def doc_script(program):
    """The script of a program: each block's set-up, the block, its checks, in order."""
    parts = []
    for block in program:
        parts += [block.marks.get("setup", ""), block.code, block.marks.get("after", "")]
    return "".join(parts)


def run_doc_program(tmp_path, program, times=1):
    """Run a program of the docs as a reader would paste it, in a fresh process whose
    working directory (and tempfile's) is `tmp_path`, `times` times in a row there (a
    reader runs a script again). The last run's result."""
    language = program[0].language
    script = tmp_path / ("doc.py" if language == "python" else "doc.sh")
    script.write_text(doc_script(program))
    command = [sys.executable, str(script)] if language == "python" else ["bash", "-e", str(script)]
    for run in range(times):
        result = subprocess.run(
            command,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(CHILD_ENV, TMPDIR=str(tmp_path)),
        )
        where = ", ".join(block.id for block in program)
        assert result.returncode == 0, f"{where}, run {run + 1}:\n{result.stderr[-3000:]}"
    return result
