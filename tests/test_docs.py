"""The documentation's scripts run: every ```python block of docs/frameworks.md is a
complete program, executed in a fresh process in a temporary working directory."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "frameworks.md")


def blocks(path):
    with open(path) as f:
        text = f.read()
    found = re.findall(r"^## (.+?)$|^```python\n(.*?)^```$", text, re.M | re.S)
    out, title = [], None
    for heading, code in found:
        if heading:
            title = heading
        else:
            out.append(pytest.param(code, id=re.sub(r"\W+", "_", title or "top").strip("_")))
    return out


@pytest.mark.parametrize("code", blocks(DOC))
def test_frameworks_doc_block_runs(tmp_path, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert " ok" in result.stdout, result.stdout
