"""The documentation site's own pages run: every program of docs/index.md and docs/cli.md
(`helpers.doc_programs`) runs twice in a fresh process. (CI builds the
site itself with `mkdocs build --strict`: .ci/run.)"""

import os
import re

import pytest
from helpers import doc_programs, doc_script, run_child, run_doc_program

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def programs(*names):
    """The programs of docs pages (`helpers.doc_programs`: every block that runs)."""
    return [
        pytest.param(program, id=program[0].id)
        for name in names
        for program in doc_programs(f"docs/{name}")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("program", programs("index.md", "cli.md"))
def test_page_block_runs_twice(tmp_path, program):
    run_doc_program(tmp_path, program, times=2)


def test_index_block_prints_what_it_says():
    (program,) = [p.values[0] for p in programs("index.md")]
    result = run_child(["python", "-c", doc_script(program)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, value = result.stdout.splitlines()
    assert steps == "[900, 1000]", result.stdout
    assert abs(float(value) - 100 * (1 - 0.99**1000)) < 1e-3, result.stdout


def _anchors(page):
    """The anchors of a docs page's headings, as Python-Markdown's toc makes them."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    found = set()
    for heading in re.findall(r"^#+ (.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        found.add(re.sub(r"[-\s]+", "-", slug))
    return found


def _public_docstrings():
    import inspect

    import jax_cb_ckpt

    for name in sorted(n for n in dir(jax_cb_ckpt) if not n.startswith("_")):
        obj = getattr(jax_cb_ckpt, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        yield name, inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and getattr(value, "__doc__", None):
                    yield f"{name}.{member}", inspect.getdoc(value) or ""


def test_the_api_page_s_references_to_the_docs_are_links_that_resolve():
    """Issue 30 item 7: docstrings (the API page is made of them) named pages as plain
    text ("docs/usage.md"), and all_steps pointed at a section, "What is in the
    directory", that does not exist. Every reference is a link now, to a page and a
    section that exist."""
    problems = []
    for name, doc in _public_docstrings():
        problems += [f"{name}: plain '{m}'" for m in re.findall(r"docs/\w+\.md", doc)]
        for page, anchor in re.findall(r"\]\((\w+\.md)(?:#([\w-]+))?\)", doc):
            if not os.path.exists(os.path.join(ROOT, "docs", page)):
                problems.append(f"{name}: no page {page}")
            elif anchor and anchor not in _anchors(page):
                problems.append(f"{name}: no section #{anchor} in {page}")
    assert not problems, problems
    assert "the-checkpoint-directory" in _anchors("usage.md")  # (the test sees sections)


def _readme_names(path, pattern):
    with open(path) as f:
        return set(re.findall(pattern, f.read()))


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    """jax_cb_ckpt/README.md names every stage folder and top-level module, and each
    folder's README.md names every module in that folder and no other (the docs site's
    modules page includes them all): a module added, removed, renamed or moved without
    its map fails here."""
    package = os.path.join(ROOT, "jax_cb_ckpt")
    folders = sorted(
        n for n in os.listdir(package) if os.path.isfile(os.path.join(package, n, "__init__.py"))
    )
    top = _readme_names(os.path.join(package, "README.md"), r"`([A-Za-z_]\w*(?:\.py|/))`")
    there = {n for n in os.listdir(package) if n.endswith(".py")} | {f + "/" for f in folders}
    assert there - top == set(), f"missing from jax_cb_ckpt/README.md: {there - top}"
    assert {n for n in top if "/" not in n} - there == set(), (
        f"jax_cb_ckpt/README.md names modules that are gone: {top - there}"
    )
    with open(os.path.join(ROOT, "docs", "modules.md")) as f:
        page = f.read()
    assert '--8<-- "jax_cb_ckpt/README.md"' in page  # the site shows the same maps
    for folder in folders:
        readme = os.path.join(package, folder, "README.md")
        assert os.path.exists(readme), f"{folder}/ has no README.md"
        named = _readme_names(readme, r"`(_\w+\.py)`")
        inside = {n for n in os.listdir(os.path.join(package, folder)) if n.endswith(".py")}
        inside.discard("__init__.py")
        assert inside - named == set(), f"missing from {folder}/README.md: {inside - named}"
        # (a module of another folder is named as `_folder/_x.py`, which is not matched)
        assert named - inside == set(), (
            f"{folder}/README.md names modules not there: {named - inside}"
        )
        assert f'--8<-- "jax_cb_ckpt/{folder}/README.md"' in page
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "(jax_cb_ckpt/README.md)" in f.read()  # contributors find it


# Which stage folder may import which (jax_cb_ckpt/README.md says why), at run time and
# under `if TYPE_CHECKING:` alike: a type named from a floor above is an arrow upward too.
_MAY_IMPORT = {
    "_base": set(),
    "_layout": {"_base"},
    "_storage": {"_base", "_layout"},
    "_handoff": {"_base", "_layout"},
    "_save": {"_base", "_layout", "_handoff"},
    "_read": {"_base", "_layout", "_storage"},
    "_write": {"_base", "_layout", "_storage", "_handoff", "_read"},
    "_user": {"_base", "_layout", "_storage", "_handoff", "_save", "_read", "_write"},
    "_cli": {"_base", "_layout", "_storage", "_read"},
}


def _stage_imports(path):
    """The package's folders a module imports (relative imports), those under
    `if TYPE_CHECKING:` and inside functions included."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 2:
            yield (node.module or "").split(".")[0], node.lineno


def test_the_stages_import_only_what_is_below_them():
    """The arrows between stage folders are the ones the package map allows: `_read/`
    never imports the traced side, `_write/` never `_save/` (both meet in `_handoff/`),
    `_layout/` and `_storage/` nothing above them, type checking's imports included. An
    import that runs the other way fails here, naming the file and line."""
    package = os.path.join(ROOT, "jax_cb_ckpt")
    wrong = []
    for folder, allowed in _MAY_IMPORT.items():
        for name in sorted(os.listdir(os.path.join(package, folder))):
            if not name.endswith(".py"):
                continue
            for target, line in _stage_imports(os.path.join(package, folder, name)):
                if target.startswith("_") and target not in allowed and target != "_version":
                    wrong.append(f"jax_cb_ckpt/{folder}/{name}:{line} imports {target}/")
    folders = {
        n for n in os.listdir(package) if os.path.isfile(os.path.join(package, n, "__init__.py"))
    }
    assert folders == set(_MAY_IMPORT), (
        f"a stage folder is not in _MAY_IMPORT: {folders ^ set(_MAY_IMPORT)}"
    )
    assert wrong == [], "imports against the stages' order:\n" + "\n".join(wrong)


def test_no_function_of_the_package_is_over_60_lines():
    """Structure round 4: a function a reader takes in at once (from `def` to the last
    line of its body, docstring included), so each does one thing and says it."""
    import ast

    package = os.path.join(os.path.dirname(__file__), "..", "jax_cb_ckpt")
    long = []
    for folder, _, names in os.walk(package):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert node.end_lineno is not None
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        where = os.path.relpath(path, os.path.dirname(package))
                        long.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
