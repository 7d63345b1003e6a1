"""The promise table (docs/promises.md) is kept true: every row points at a heading of
the docs that exists, and names tests that exist, each a function a pytest run
collects (by file, function and, for a method, class). A row without a test, or a test
renamed or removed, fails here: a promise in the docs is a test (SQLite's requirement
marks are the model: each requirement with the tests that prove it)."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "promises.md")
_ROW = re.compile(r"^\|\s*(P-[a-z]+-\d+)\s*\|(.*)\|(.*)\|(.*)\|\s*$")
# A page of the site as a link; the README (not a page of the site) as `README.md#anchor`.
_LINK = re.compile(r"^\[[^\]]*\]\(([^)#]+)(?:#([^)]*))?\)$|^`(README\.md)(?:#([^`]*))?`$")
_TEST = re.compile(r"`(tests/[\w/]+\.py)::([\w:]+)`")


def _rows():
    with open(TABLE) as f:
        return [m.groups() for m in map(_ROW.match, f.read().splitlines()) if m]


def slug(heading):
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"[\s]+", "-", text.strip())


def _anchors(path):
    with open(path) as f:
        lines = f.read().splitlines()
    out, fenced = set(), False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def _functions(path):
    """{"name", "Class::name"} of the test functions defined in `path`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return names


def test_the_table_has_rows_with_unique_ids():
    rows = _rows()
    assert len(rows) >= 50, len(rows)
    ids = [row[0] for row in rows]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def _missing_headings(rows):
    anchors = {}
    bad = []
    for pid, _promise, where, _tests in rows:
        match = _LINK.match(where.strip())
        if match is None:
            bad.append((pid, where, "not a link"))
            continue
        page, anchor, readme, readme_anchor = match.groups()
        if readme:
            page, anchor = os.path.join("..", readme), readme_anchor
        path = os.path.normpath(os.path.join(ROOT, "docs", page))
        if not os.path.isfile(path):
            bad.append((pid, page, "no such page"))
            continue
        if anchor:
            if path not in anchors:
                anchors[path] = _anchors(path)
            known = anchors[path]
            if anchor not in known:
                bad.append((pid, f"{page}#{anchor}", "no such heading"))
    return bad


def _missing_tests(rows):
    functions = {}
    bad = []
    for pid, _promise, _where, tests in rows:
        found = _TEST.findall(tests)
        if not found:
            bad.append((pid, "names no test"))
        for path, name in found:
            full = os.path.join(ROOT, path)
            if not os.path.isfile(full):
                bad.append((pid, path, "no such file"))
                continue
            if full not in functions:
                functions[full] = _functions(full)
            if name not in functions[full]:
                bad.append((pid, f"{path}::{name}", "no such test"))
            elif not name.split("::")[-1].startswith("test"):
                bad.append((pid, f"{path}::{name}", "not a test"))
    return bad


def test_every_promise_points_at_a_heading_that_exists():
    bad = _missing_headings(_rows())
    assert not bad, bad


def test_every_promise_names_tests_that_exist():
    bad = _missing_tests(_rows())
    assert not bad, bad


def test_the_checks_find_a_row_that_is_not_true():
    """(The checks themselves can fail.)"""
    rows = [
        (
            "P-x-1",
            "a promise",
            "[usage.md](usage.md#no-such-heading)",
            "`tests/test_restart.py::test_gone`",
        ),
        ("P-x-2", "a promise", "`README.md#no-such-heading`", "MISSING"),
        ("P-x-3", "a promise", "[nowhere.md](nowhere.md)", "`tests/test_nowhere.py::test_a`"),
    ]
    assert [b[0] for b in _missing_headings(rows)] == ["P-x-1", "P-x-2", "P-x-3"]
    assert [b[0] for b in _missing_tests(rows)] == ["P-x-1", "P-x-2", "P-x-3"]


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("The restart's rules", "the-restarts-rules"),
        ("Coming from Orbax's CheckpointManager", "coming-from-orbaxs-checkpointmanager"),
        (
            "vmap of a while_loop whose members stop at different steps",
            "vmap-of-a-while_loop-whose-members-stop-at-different-steps",
        ),
        ("The newest N: `max_to_keep`", "the-newest-n-max_to_keep"),
    ],
)
def test_slugs_are_the_anchors_mkdocs_makes(heading, anchor):
    """(mkdocs build --strict, in CI, also fails on an anchor that does not exist.)"""
    assert slug(heading) == anchor
