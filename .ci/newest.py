"""CI's newest end: print the versions installed of JAX, jaxlib, Orbax, TensorStore and
numpy next to the newest release pip can see for this Python, and fail when one is not
the newest (a test-only package that pins one lower would hold the newest end back:
gymnax 1.0.1 requires jax<0.12, so the examples extra is not installed here)."""

import importlib.metadata
import re
import subprocess
import sys

PACKAGES = ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")


def newest(name: str) -> str:
    """The newest release of `name` pip sees for this interpreter (`pip index`)."""
    found = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", found, re.MULTILINE | re.IGNORECASE)
    if match is None:
        sys.exit(f"newest end: pip index gave no version of {name}:\n{found}")
    return match.group(1)


behind = []
for name in PACKAGES:
    installed, latest = importlib.metadata.version(name), newest(name)
    print(f"{name:18} {installed:12} newest pip sees: {latest}")
    if installed != latest:
        behind.append(f"{name} {installed} (newest {latest})")
if behind:
    sys.exit(
        "newest end: not the newest release of " + ", ".join(behind) + ". Something in the "
        "test extras pins it lower: pip install --dry-run --report shows what; move that "
        "package to an extra of its own, as gymnax is (examples)."
    )
