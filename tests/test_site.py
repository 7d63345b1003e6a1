"""The documentation site's own pages run: every ```python block of docs/index.md and
docs/cli.md is a complete program, executed twice in a fresh process. (CI builds the
site itself with `mkdocs build --strict`: .ci/run.)"""

import os
import re

import pytest
from helpers import run_child, run_twice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks(*names):
    out = []
    for name in names:
        with open(os.path.join(ROOT, "docs", name)) as f:
            codes = re.findall(r"^```python\n(.*?)^```$", f.read(), re.M | re.S)
        out += [pytest.param(code, id=f"{name}-{i}") for i, code in enumerate(codes)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("code", blocks("index.md", "cli.md"))
def test_page_block_runs_twice(tmp_path, code):
    run_twice(tmp_path, code)


def test_index_block_prints_what_it_says():
    (code,) = [p.values[0] for p in blocks("index.md")]
    result = run_child(["python", "-c", code], timeout=300)
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


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    """jax_cb_ckpt/README.md (the docs site's modules page) is kept true: a module
    added, removed or renamed without the map fails here."""
    package = os.path.join(ROOT, "jax_cb_ckpt")
    with open(os.path.join(package, "README.md")) as f:
        named = set(re.findall(r"`([A-Za-z_]\w*\.py)`", f.read()))
    there = {n for n in os.listdir(package) if n.endswith(".py")}
    assert there - named == set(), f"modules missing from jax_cb_ckpt/README.md: {there - named}"
    assert named - there == set(), (
        f"jax_cb_ckpt/README.md names modules that are gone: {named - there}"
    )
    with open(os.path.join(ROOT, "docs", "modules.md")) as f:
        assert '--8<-- "jax_cb_ckpt/README.md"' in f.read()  # the site shows the same map
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "(jax_cb_ckpt/README.md)" in f.read()  # contributors find it
