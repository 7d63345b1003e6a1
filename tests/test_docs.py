"""The documentation's code runs as written (issue 52 item 5). Every fenced block of
README.md and docs/*.md is ```text (output, not code), or runs here (```python, ```bash),
or says in a mark right above it why it does not (the marks: tests/helpers.py,
`doc_blocks`); a block with neither fails the fast test below, which also compiles
every runnable block. The slow tests run every program of the docs in a fresh process in
a temporary working directory; those of docs/frameworks.md (here) and of docs/index.md
and docs/cli.md (tests/test_site.py) twice in a row there (a reader runs a script again:
a second run must not trip over the first run's checkpoints). The plain-Orbax recipes of
docs/usage.md read a checkpoint saved on 4 devices with 1 and 2 devices."""

import ast
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    DOC_LANGUAGES,
    DOC_PAGES,
    doc_blocks,
    doc_programs,
    doc_script,
    run_doc_program,
    run_script,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE = os.path.join(ROOT, "docs", "usage.md")


def sections(path):
    """[(heading of the `## ` section, code of each ```python block in it)]."""
    with open(path) as f:
        text = f.read()
    found = re.findall(r"^## (.+?)$|^```python\n(.*?)^```$", text, re.M | re.S)
    out, title = [], None
    for heading, code in found:
        if heading:
            title = heading
        else:
            out.append((title, code))
    return out


# Pages whose programs run twice, by tests of their own (their rows in docs/promises.md).
TWICE = {"docs/frameworks.md", "docs/index.md", "docs/cli.md"}
MARKS = {"skip", "setup", "after", "continues"}


def _test_exists(path, name):
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def _block_problems(block, before):
    """What keeps `block` (after the runnable block `before` of its page, or None) from
    being run or marked as not run, with a reason."""
    marks, where = block.marks, block.id
    if block.language == "text":
        return [f"{where}: a ```text block is not run; it takes no doc-test marks"] if marks else []
    if set(marks) - MARKS:
        return [
            f"{where}: unknown doc-test marks {sorted(set(marks) - MARKS)} (known: {sorted(MARKS)})"
        ]
    if "skip" in marks:
        reason = marks["skip"].strip()
        problems = [] if reason else [f"{where}: `doc-test: skip` without a reason"]
        if set(marks) != {"skip"}:
            problems.append(f"{where}: a skipped block takes no other marks")
        for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", reason):
            if not _test_exists(path, name):
                problems.append(
                    f"{where}: its skip reason names {path}::{name}, which is not there"
                )
        return problems
    if block.language not in DOC_LANGUAGES:
        return [
            f"{where}: a ```{block.language or '(no language)'} block that is not run: make it "
            "```text (output, not code) or ```python / ```bash (run here), or say why it is "
            "not run right above it: <!-- doc-test: skip: REASON -->"
        ]
    if "continues" in marks and (before is None or before.language != block.language):
        return [f"{where}: `doc-test: continues`, but no {block.language} block runs before it"]
    script = doc_script([block])
    if block.language == "python":
        try:
            compile(script, where, "exec")
        except SyntaxError as e:
            return [f"{where}: does not compile: {e}"]
    else:
        checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
        if checked.returncode:
            return [f"{where}: bash -n: {checked.stderr}"]
    return []


def test_every_doc_block_runs_or_says_why_not():
    """Fast: every block of the docs is text, or runnable (it compiles, with its marks),
    or marked as not run with a reason; the slow tests run every runnable one."""
    problems, count = [], 0
    for page in DOC_PAGES:
        before = None
        for block in doc_blocks(page):
            count += 1
            problems += block.problems + _block_problems(block, before)
            if block.language in DOC_LANGUAGES and "skip" not in block.marks:
                before = block
    assert count > 40  # (the pages were read)
    assert not problems, "\n".join(problems)


def test_a_block_that_neither_runs_nor_says_why_fails_the_check(tmp_path):
    """The check itself: a block with no language, a skip without a reason, a mark that
    is not right above a block, a block that does not compile are each named; a text
    block, a skip with a reason and a block that continues another pass."""
    page = tmp_path / "page.md"
    page.write_text(
        "```\nx = 1\n```\n\n"
        "<!-- doc-test: skip: -->\n```python\nx = 1\n```\n\n"
        "<!-- doc-test: skip: needs a GPU -->\n```python\nx = (\n```\n\n"
        "```text\nany output\n```\n\n"
        "```python\nx = 1\n```\n\n"
        "<!-- doc-test: continues -->\n```python\nassert x == 1\n```\n\n"
        "```python\nx = (\n```\n\n"
        "<!-- doc-test: setup\ny = 2\n-->\nsome prose\n\n```python\ny\n```\n"
    )
    found, before = [], None
    for block in doc_blocks(str(page)):
        found.append((block.line, block.problems + _block_problems(block, before)))
        if block.language in DOC_LANGUAGES and "skip" not in block.marks:
            before = block
    said = {line: " ".join(problems) for line, problems in found}
    assert "(no language) block that is not run" in said[1]
    assert "`doc-test: skip` without a reason" in said[6]
    assert said[11] == said[15] == said[19] == said[24] == ""
    assert "does not compile" in said[28]
    assert "marks ['setup'] not right above a block" in said[37]
    assert [len(p) for p in doc_programs(str(page))] == [2, 1, 1]


def _programs(pages):
    return [
        pytest.param(program, id=program[0].id) for page in pages for program in doc_programs(page)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("program", _programs([p for p in DOC_PAGES if p not in TWICE]))
def test_doc_program_runs_as_written(tmp_path, program):
    run_doc_program(tmp_path, program)


@pytest.mark.slow
@pytest.mark.parametrize("program", _programs(["docs/frameworks.md"]))
def test_frameworks_doc_block_runs_twice(tmp_path, program):
    result = run_doc_program(tmp_path, program, times=2)
    assert " ok" in result.stdout, result.stdout


TRANSFORMS = os.path.join(ROOT, "docs", "transforms.md")


@pytest.mark.slow
def test_transforms_pmap_restart_recipe_runs_twice(tmp_path):
    """transforms.md's pmap restart recipe (issue 53): a pmapped epoch saving with
    axis_name=, stopped and restarted with a concrete like, ends bit for bit as the
    uninterrupted run (before issue 53: the resumed state was refused by the pmap)."""
    [program] = [p for p in doc_programs(TRANSFORMS) if any("pmap restart ok" in b.code for b in p)]
    result = run_doc_program(tmp_path, program, times=2)
    assert "pmap restart ok" in result.stdout, result.stdout + result.stderr


# The usage.md recipes, between the lines a reader would have: where the checkpoint is,
# on how many devices to read it, and what each recipe must have given.
RECIPE_PREAMBLE = """
import os, sys
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[2]}"
import numpy as np
directory, step = sys.argv[1], 300
"""
RECIPE_CHECKS = [
    """
assert isinstance(arrays["params"]["w"], np.ndarray) and meta["leaves"], meta
np.testing.assert_array_equal(arrays["params"]["w"], np.load(sys.argv[3]))
""",
    """
w = state["params"]["w"]
assert w.sharding == rows and len(w.addressable_shards) == jax.device_count() == int(sys.argv[2])
np.testing.assert_array_equal(np.asarray(w), np.load(sys.argv[3]))
assert int(state["step"]) == 300
""",
    """
assert state["params"]["w"].sharding == whole
np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.load(sys.argv[3]))
print("recipes ok")
""",
]


@pytest.fixture(scope="module")
def saved_on_four_devices(tmp_path_factory):
    """A checkpoint of the recipes' state, saved per device from a 4-device mesh."""
    import jax_cb_ckpt

    root = tmp_path_factory.mktemp("plain_orbax")
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    shardings = {
        "params": {"w": NamedSharding(mesh, P("d"))},
        "step": NamedSharding(mesh, P()),
    }
    w = np.arange(512 * 128, dtype=np.float32).reshape(512, 128) / 7
    np.save(root / "w.npy", w)
    state = jax.device_put({"params": {"w": w}, "step": jnp.int32(300)}, shardings)
    with jax_cb_ckpt.Checkpointer(root / "ckpt") as ckpt:
        jax.jit(lambda s: ckpt.save(s, 300, shardings=shardings))(state)
    return root


@pytest.mark.parametrize("devices", [1, 2])
def test_plain_orbax_recipes_read_on_another_device_count(tmp_path, saved_on_four_devices, devices):
    recipes = [
        code for title, code in sections(USAGE) if title == "Reading checkpoints with plain Orbax"
    ]
    assert len(recipes) == len(RECIPE_CHECKS), "usage.md's plain-Orbax recipes changed"
    script = RECIPE_PREAMBLE + "".join(
        code + check for code, check in zip(recipes, RECIPE_CHECKS, strict=True)
    )
    root = saved_on_four_devices
    result = run_script(tmp_path, script, root / "ckpt", devices, root / "w.npy", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "recipes ok" in result.stdout, result.stdout
