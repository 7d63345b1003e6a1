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
