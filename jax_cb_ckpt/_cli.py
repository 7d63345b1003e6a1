"""The command line: `jax-cb-ckpt ls|show|verify DIRECTORY` (or `python -m jax_cb_ckpt`).

It only reads: nothing here writes, locks or deletes, so it is safe on a directory that
a training run is writing (a step being written shows as incomplete in `ls`). Exit
codes: 0 done; 1 `verify` found a corrupted or unreadable step; 2 the command could not
run (no such directory, no such step, bad arguments). `--json` prints one JSON object
for scripts instead of the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

from . import _format, _remote, _tree
from ._errors import CheckpointError, RestoreError
from ._restore import metadata, step_meta, verify

_FAILED = 1
_UNUSABLE = 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        directory = _format.resolve(args.directory, f"jax-cb-ckpt {args.command}")
        if not _remote.is_url(directory) and not os.path.isdir(directory):
            raise FileNotFoundError(f"{args.directory!r} is not a directory")
        return args.run(directory, args)
    except (CheckpointError, OSError) as e:
        prefix = f"jax-cb-ckpt {args.command}: "
        text = str(e)
        print(text if text.startswith(prefix) else prefix + text, file=sys.stderr)
        return _UNUSABLE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-cb-ckpt",
        description="Look into jax_cb_ckpt checkpoint directories (read only).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, run, text, has_step in (
        ("ls", _ls, "the steps in DIRECTORY: when saved, size on disk, complete or not", False),
        (
            "show",
            _show,
            "what a step holds: leaves, shapes, dtypes, shardings, vmap batch, "
            "versions (default: the latest step)",
            True,
        ),
        (
            "verify",
            _verify,
            "read every byte of each step (or of --step) and check it "
            "against the checksums written with it; exit code 1 on any mismatch",
            True,
        ),
    ):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("directory", metavar="DIRECTORY")
        if has_step:
            command.add_argument("--step", type=int, default=None)
        command.add_argument("--json", action="store_true", help="one JSON object")
        command.set_defaults(run=run)
    return parser


# -- ls ----------------------------------------------------------------------------------


def _ls(directory: str, args: argparse.Namespace) -> int:
    rows = [_listed(directory, step) for step in _format.list_steps(directory)]
    rows += [
        {"step": step, "saved_at": None, "bytes": _bytes(path), "complete": False}
        for step, path in _format.unfinished_steps(directory)
    ]
    rows = sorted((r for r in rows if r is not None), key=lambda r: (r["step"], r["complete"]))
    if args.json:
        _print_json({"directory": directory, "steps": rows})
        return 0
    if not rows:
        print(f"no checkpoints in {directory}")
        return 0
    print(f"{'step':>10}  {'saved at (UTC)':<23}  {'size':>9}  state")
    for r in rows:
        state = "complete" if r["complete"] else "incomplete (being written, or left by a crash)"
        saved = (r["saved_at"] or "-").replace("T", " ").split("+")[0]
        print(f"{r['step']:>10}  {saved:<23}  {_size(r['bytes']):>9}  {state}")
    return 0


def _listed(directory: str, step: int) -> dict[str, Any] | None:
    path = os.path.join(directory, str(step))
    try:
        saved_at = step_meta(directory, step=step).saved_at or _mtime(path)
    except (CheckpointError, OSError):
        if not _format.exists(path):  # removed by retention meanwhile
            return None
        saved_at = _mtime(path)
    return {"step": step, "saved_at": saved_at, "bytes": _bytes(path), "complete": True}


def _bytes(path: str) -> int | None:
    """Bytes on disk under `path`; None in object storage (listing gives no sizes)."""
    if _remote.is_url(path):
        return None
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def _mtime(path: str) -> str | None:
    if _remote.is_url(path):
        return None
    try:
        seconds = os.stat(path).st_mtime
    except OSError:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="milliseconds")


# -- show --------------------------------------------------------------------------------


def _show(directory: str, args: argparse.Namespace) -> int:
    if args.json:
        _print_json({"directory": directory, **metadata(directory, step=args.step)})
        return 0
    meta = step_meta(directory, step=args.step)
    print(f"step {meta.step} of {directory}")
    print(f"  saved at      {meta.saved_at or 'not recorded (older version)'}")
    written = ", ".join(
        f"{name} {meta.versions[key]}"
        for name, key in (
            ("jax_cb_ckpt", "library_version"),
            ("jax", "jax_version"),
            ("jaxlib", "jaxlib_version"),
            ("orbax-checkpoint", "orbax_version"),
            ("tensorstore", "tensorstore_version"),
        )
        if key in meta.versions
    )
    print(f"  written by    {written}")
    print(f"  size on disk  {_size(_bytes(os.path.join(directory, str(meta.step))))}")
    if meta.batch_shape:
        print(f"  vmap batch    {_batch(meta)}")
    checked = "yes" if meta.checksums else "no (written before checksums were kept)"
    print(f"  checksums     {checked}")
    print(f"  {len(meta.leaves)} leaves:")
    rows = [
        (
            leaf.path,
            f"key<{leaf.impl}>" if leaf.kind == _tree.KEY else leaf.dtype,
            str(leaf.shape),
            _sharding(meta.shardings[leaf.path]) if leaf.path in meta.shardings else "",
        )
        for leaf in meta.leaves
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print(("    " + "  ".join([*cells, row[3]])).rstrip())
    return 0


def _batch(meta: _format.StepMeta) -> str:
    """The batch shape of a save made under vmap, and which members it holds."""
    import numpy as np

    saved = meta.members
    held = [tuple(int(i) for i in index) for index in np.argwhere(saved)]
    if len(held) == saved.size:
        which = f"all {saved.size} members saved"
    else:
        which = f"{len(held)} of {saved.size} members saved: {held}"
    return f"shape {meta.batch_shape} (leading axes of every leaf); {which}"


def _sharding(described: dict[str, Any]) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in described["mesh"].items())
    spec = ", ".join(
        "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
        for axes in described["spec"]
    )
    return f"saved per device: mesh({mesh}) P({spec})"


# -- verify ------------------------------------------------------------------------------


def _verify(directory: str, args: argparse.Namespace) -> int:
    steps = _format.list_steps(directory) if args.step is None else [args.step]
    results = []
    for step in steps:
        result: dict[str, Any] = {"step": step}
        try:
            result["checksums"] = bool(step_meta(directory, step=step).checksums)
            verify(directory, step=step)
            result["ok"] = True
        except RestoreError as e:
            result["ok"] = False
            result["error"] = str(e)
        results.append(result)
    failed = [r for r in results if not r["ok"]]
    if args.json:
        _print_json({"directory": directory, "ok": not failed, "steps": results})
    else:
        for r in results:
            if not r["ok"]:
                print(f"step {r['step']}: FAILED: {r['error']}")
            elif r["checksums"]:
                print(f"step {r['step']}: ok (every byte matches its checksum)")
            else:
                print(f"step {r['step']}: readable; no checksums (written by an older version)")
        if not results:
            print(f"no checkpoints in {directory}")
    return _FAILED if failed else 0


# -- output ------------------------------------------------------------------------------


def _print_json(value: dict[str, Any]) -> None:
    json.dump(value, sys.stdout, indent=1)
    print()


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"
