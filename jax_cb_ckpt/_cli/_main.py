"""The command line: `jax-cb-ckpt ls|show|verify DIRECTORY` (or `python -m jax_cb_ckpt`).

It only reads: nothing here writes, locks or deletes, so it is safe on a directory that
a training run is writing (a step being written shows as incomplete in `ls`). Exit
codes: 0 done (`verify`: every step's bytes match their checksums); 1 `verify` found a
corrupted, unreadable or damaged step; 2 the command could not run (no such directory,
no checkpoints in it, no such step, bad arguments); 3 `verify`: every step is readable
but some were written without checksums (an older version's, or plain Orbax steps), so
they could not be verified. `--json`
prints one JSON object for scripts instead of the table. What it prints from a
checkpoint (leaf names, paths, messages) is escaped: no control character or
terminal escape code reaches the terminal.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import warnings
from typing import Any, TextIO

from .._base._errors import (
    CheckpointError,
    ConfigError,
    DamagedStepWarning,
    NoCheckpointError,
    RestoreError,
    calling,
)
from .._layout import _extra, _format, _policy, _spec
from .._layout._keep_best import BestN
from .._layout._policy import AnyOf
from .._read import _plain
from .._storage import _places
from .._storage._protocol import Storage

_FAILED = 1
_UNUSABLE = 2
_UNCHECKED = 3
# One rule for every command (docs/cli.md has the same table; tests/test_cli.py checks).
_EXIT_CODES = """exit codes (every command):
  0  done; verify: every step's bytes match their checksums (a step removed while
     it was read, by a running writer's retention, is skipped)
  1  verify: a step is corrupted, unreadable or damaged
  2  the command could not run: no such directory, no checkpoints in it (a wrong
     path, or one step's folder), no such step, bad arguments
  3  verify: every step is readable, but some were written without checksums"""


def _safe(text: object) -> str:
    """`text` as printable characters only: control characters, terminal escape codes
    and lone surrogates (a name read from a damaged or hostile file) as Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _say(text: object = "", file: TextIO | None = None) -> None:
    print(_safe(text), file=file or sys.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        with calling(f"jax-cb-ckpt {args.command}"):
            storage = _places.at(_places.resolve(args.directory))
        if not storage.is_directory():
            raise FileNotFoundError(f"{args.directory!r} is not a directory")
        return args.run(storage, args)
    except BrokenPipeError:
        # The reader went away (`| head -1`): end quietly, as a pipeline expects, and
        # keep Python from failing again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (CheckpointError, OSError) as e:
        prefix = f"jax-cb-ckpt {args.command}: "
        text = str(e)
        _say(text if text.startswith(prefix) else prefix + text, file=sys.stderr)
        return _UNUSABLE
    except Exception as e:  # never a traceback: say what failed, as one line
        _say(f"jax-cb-ckpt {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return _UNUSABLE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jax-cb-ckpt",
        description="Look into jax_cb_ckpt checkpoint directories (read only).",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, run, text, has_step in (
        ("ls", _ls, "the steps in DIRECTORY: when saved, size on disk, complete or not", False),
        (
            "show",
            _show,
            "what a step holds: leaves, shapes, dtypes, shardings, vmap batch or "
            "per-device states, "
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
        command = commands.add_parser(
            name,
            help=text,
            description=text,
            epilog=_EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument("directory", metavar="DIRECTORY")
        if has_step:
            command.add_argument("--step", type=int, default=None)
        if name == "ls":
            _ranking_arguments(command)
        command.add_argument("--json", action="store_true", help="one JSON object")
        command.set_defaults(run=run)
    return parser


# -- ls ----------------------------------------------------------------------------------


def _ranking_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--best",
        metavar="NAME",
        default=None,
        help="only the complete steps that recorded metric NAME (not NaN), best first",
    )
    command.add_argument(
        "--mode",
        choices=("max", "min"),
        default=None,
        help="with --best: higher (max) or lower (min) is better; default: the mode the "
        "steps were kept by, when they were kept by NAME",
    )
    command.add_argument(
        "--member",
        type=int,
        default=None,
        help="with --best, for steps saved under vmap: rank by member K's value (its "
        "flat index); default: each step's best member",
    )
    command.add_argument(
        "--top", type=int, default=None, metavar="N", help="with --best: the best N only"
    )
    command.add_argument(
        "--ignore-recorded",
        action="store_true",
        help="with --best and --mode: rank by --mode even where the steps were kept by "
        "NAME with the other mode",
    )


def _ls(storage: Storage, args: argparse.Namespace) -> int:
    directory = storage.path
    metas: dict[int, _format.StepMeta] = {}
    rows = [_listed(storage, step, metas) for step in storage.list_steps()]
    rules = _kept_by(rows, metas)
    stuck = _undeletable(storage)
    for r in rows:
        if r is not None and str(r["step"]) in stuck:
            r["undeletable"] = stuck[str(r["step"])]
    rows = sorted(
        (r for r in rows + _not_listed(storage) if r is not None),
        key=lambda r: (r["step"], r["complete"]),
    )
    if not rows:  # a wrong path, by the exit codes' one rule (2)
        raise NoCheckpointError(f"no checkpoints in {directory}{_step_folder_hint(storage)}")
    if args.best is not None:
        rows = _ranked(rows, metas, None if rules is None else rules.find(BestN), args, directory)
    elif (args.mode, args.member, args.top) != (None, None, None) or args.ignore_recorded:
        raise ConfigError(
            "--mode, --member, --top and --ignore-recorded rank by a metric: pass --best NAME too."
        )
    if args.json:
        retention = None if rules is None else rules.to_json()
        _print_json({"directory": directory, "retention": retention, "steps": rows})
        return 0
    _ls_table(rows, metas, rules)
    return 0


def _not_listed(storage: Storage) -> list[dict[str, Any]]:
    """`ls`'s rows for what is not a listed step: unfinished steps, plain Orbax steps,
    damaged, unreadable or foreign folders, steps set aside."""
    rows: list[dict[str, Any]] = [
        {
            "step": step,
            "saved_at": None,
            "bytes": storage.entry_bytes(os.path.basename(path)),
            "complete": False,
        }
        for step, path in storage.unfinished_steps()
    ]
    examined = storage.examine_all()
    plain = _plain.steps(storage, examined)
    for step, found in sorted(examined.items()):
        if found.kind != "complete" and found != _format.UNFINISHED:  # (listed above)
            row = {"step": step, "saved_at": None, "bytes": storage.entry_bytes(str(step))}
            if step in plain and plain[step].problem is None:  # listed, read unverified
                saved_at = plain[step].saved_at or storage.entry_time(str(step))
                row |= {"saved_at": saved_at, "complete": True, "plain_orbax": "resumable"}
            elif step in plain:  # a restart names it
                row |= {"complete": False, "plain_orbax": plain[step].problem}
            else:
                row |= {"complete": False, found.kind: found.why}
            rows.append(row)
    for step, name, why in storage.set_aside_steps():
        rows.append(
            {"step": step, "saved_at": None, "bytes": storage.entry_bytes(name)}
            | {"complete": False, "set_aside": name, "why": why}
        )
    return rows


def _ls_table(
    rows: list[dict[str, Any]], metas: dict[int, _format.StepMeta], rules: AnyOf | None
) -> None:
    """`ls`'s table: a row per step, a column per recorded metric, what keeps it."""
    names = sorted({name for meta in metas.values() for name in meta.metrics})
    columns = [  # (a row that is not a complete step, such as a step set aside: none)
        (name, [_metric_text(metas, r["step"], name) if _ours(r) else "" for r in rows])
        for name in names
    ]
    if rules is not None:
        kept = [
            ", ".join(r.get("kept_by", ())) or ("-" if _ours(r) else "")  # (Orbax's: never)
            for r in rows
        ]
        columns.append(("kept by", kept))
        _say(f"retention: {rules.describe()} (the rules the newest step was saved with)")
    widths = [max(len(title), *(len(cell) for cell in cells)) for title, cells in columns]
    head = "".join(f"{title:>{w}}  " for (title, _), w in zip(columns, widths, strict=True))
    _say(f"{'step':>10}  {'saved at (UTC)':<23}  {'size':>9}  {head}state")
    for index, r in enumerate(rows):
        saved = (r["saved_at"] or "-").replace("T", " ").split("+")[0]
        cells = "".join(
            f"{cells[index]:>{w}}  " for (_, cells), w in zip(columns, widths, strict=True)
        )
        _say(f"{r['step']:>10}  {saved:<23}  {_size(r['bytes']):>9}  {cells}{_ls_state(r)}")


def _ls_state(r: dict[str, Any]) -> str:
    """`ls`'s last column: what a row is, and what a restart does with it."""
    if "damaged" in r and r.get("listed"):
        return f"damaged: {r['damaged']} (restore and verify refuse it; never deleted)"
    if "damaged" in r:
        return f"damaged: {r['damaged']} (not listed, not restored)"
    if r.get("plain_orbax") == "resumable":
        return (
            "a plain Orbax step: a restart resumes from it (unverified), as do "
            "restore and verify; Orbax keeps no checksums; never touched or deleted"
        )
    if "plain_orbax" in r:
        return f"a plain Orbax step a restart cannot resume from: {r['plain_orbax']}"
    if "unreadable" in r:
        return f"unreadable: {r['unreadable']} (not listed; a restart stops here)"
    if "set_aside" in r:
        return f"set aside by a restart as {r['set_aside']}: {r['why']} (not a step; never deleted)"
    if "foreign" in r:
        return f"not a jax_cb_ckpt checkpoint ({r['foreign']}): ignored"
    if r["complete"] and "undeletable" in r:
        return f"complete; retention cannot delete it: {r['undeletable']}"
    if r["complete"]:
        return "complete"
    return "incomplete (being written, or left by a crash)"


def _ours(row: dict[str, Any]) -> bool:
    """The row is a complete step of ours (not a plain Orbax step, listed too)."""
    return row["complete"] and "plain_orbax" not in row


def _ranked(
    rows: list[dict[str, Any]],
    metas: dict[int, _format.StepMeta],
    rule: BestN | None,
    args: argparse.Namespace,
    directory: str,
) -> list[dict[str, Any]]:
    """`ls --best NAME`: the complete steps with a value of NAME (NaN, a missing value
    and a member's value at a step it did not ask for never count, as in `best_step`),
    best first; on a tie the step saved first (as retention keeps it). Under vmap a
    step's value is its best member's, or member `--member`'s (plain saves are then
    left out). The mode: `--mode`, else the one the steps were kept by for NAME; a
    `--mode` against it is refused unless `--ignore-recorded`."""
    import numpy as np  # (already imported by _format: no start-up cost)

    name, mode = args.best, _ranking_mode(args, rule)
    if args.top is not None and args.top <= 0:
        raise ConfigError(f"--top {args.top}: pass a positive number of steps.")
    ranked, batched = [], False
    for r in rows:
        meta = metas.get(r["step"]) if r["complete"] else None
        if meta is None or (value := meta.metrics.get(name)) is None:
            continue
        values = np.asarray(value, dtype=np.float64).ravel()
        if meta.batch_shape:  # a member that did not ask has no state of its own there
            values = np.where(np.asarray(meta.members, bool).ravel(), values, np.nan)
        if args.member is not None:
            if np.ndim(value) == 0:
                continue  # a plain save: no members
            batched = True
            if not 0 <= args.member < values.size:
                raise ConfigError(
                    f"--member {args.member}: step {r['step']} holds {name!r} for a batch of "
                    f"shape {np.shape(value)} (flat indices 0..{values.size - 1}). Fix: a "
                    "flat index in that range."
                )
            values = values[args.member : args.member + 1]
        counted = values[~np.isnan(values)]
        if counted.size == 0:
            continue
        best = float(counted.max() if mode == "max" else counted.min())
        order = -best if mode == "max" else best
        # Ties: the step saved first (to the ms, then the order recorded within one).
        ranked.append((order, meta.saved_seconds or 0.0, meta.saved_ns or 0, r["step"], r))
    if args.member is not None and not batched:
        raise ConfigError(
            f"--member {args.member}: the steps that recorded {name!r} are plain saves (no "
            "members). Fix: leave --member out."
        )
    ranked.sort(key=lambda item: item[:4])
    if not ranked:
        raise NoCheckpointError(f"no complete step in {directory} recorded {name!r} (not NaN)")
    return [r for *_, r in ranked][: args.top]


def _ranking_mode(args: argparse.Namespace, rule: BestN | None) -> str:
    """`ls --best NAME`'s mode: `--mode`, else the one the steps were kept by for NAME;
    a `--mode` against it is refused unless `--ignore-recorded`."""
    name, mode = args.best, args.mode
    kept_by_it = rule is not None and rule.metric == name
    if mode is None:
        if rule is None or not kept_by_it:
            said = "no keep_best rule" if rule is None else f"keep_best by {rule.metric!r}"
            raise ConfigError(
                f"--best {name!r}: the steps record {said}, not whether a higher or a lower "
                f"{name!r} is better. Fix: add --mode max (higher is better) or --mode min."
            )
        mode = rule.mode
    elif kept_by_it and rule is not None and mode != rule.mode and not args.ignore_recorded:
        raise ConfigError(
            f"--best {name!r} --mode {mode}: the steps were kept by {name!r} with mode "
            f"{rule.mode}; --mode {mode} ranks them the other way (the worst would come "
            "first). Fix: leave --mode out, or add --ignore-recorded to rank by it anyway."
        )
    return mode


def _undeletable(storage: Storage) -> dict[str, str]:
    """{step: why} of the steps the writer's retention could not delete (its report,
    `_format.STUCK_NAME`, read within bounds; {} when there is none or it is torn)."""
    try:
        data = storage.read_file(_format.STUCK_NAME, _format.SMALL_FILE_MAX_BYTES)
        record = json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {str(k): str(v)[:300] for k, v in record.items() if isinstance(v, str)}


def _step_folder_hint(storage: Storage) -> str:
    """A hint when the directory given is one step's folder, not the directory of steps."""
    if _format.is_step_name(os.path.basename(storage.path)) and storage.exists(
        _format.ORBAX_STEP_FILE
    ):
        parent = os.path.dirname(storage.path)
        return f"; it looks like one step's folder: pass the directory that holds it, {parent}"
    return ""


def _kept_by(rows: list[dict[str, Any] | None], metas: dict[int, _format.StepMeta]) -> AnyOf | None:
    """The retention rules the newest step was saved with (None: none recorded), and in
    each complete step's row, which of them keep it (`kept_by`)."""
    rules, kept = _policy.kept_by_each(metas)
    for r in rows:
        if r is not None and r["step"] in kept:
            r["kept_by"] = list(kept[r["step"]])
    return rules


def _metric_text(metas: dict[int, _format.StepMeta], step: int, name: str) -> str:
    """One cell of a metric's column: the value, or under vmap the members' range."""
    import numpy as np  # (already imported by _format: no start-up cost)

    meta = metas.get(step)
    value = None if meta is None else meta.metrics.get(name)
    if value is None:
        return "-"
    if value.ndim == 0:
        return f"{value.item():.6g}" if value.dtype.kind == "f" else str(value.item())
    if value.size == 0:
        return "[]"
    counted = value[~np.isnan(value)] if value.dtype.kind == "f" else value
    if counted.size == 0:
        return f"nan (x{value.size})"
    nans = value.size - counted.size
    shown = f"{counted.min():.4g}..{counted.max():.4g} (x{value.size}"
    return shown + (f", {nans} nan)" if nans else ")")


def _meta(storage: Storage, step: int | None) -> tuple[dict[str, Any], _format.StepMeta]:
    """A step's `meta` item (default: the latest step), checked and parsed, read with
    the storage's own verbs (no JAX, no TensorStore: `ls` and `show` start at once)."""
    if step is None:
        steps = storage.list_steps()
        if not steps:
            raise NoCheckpointError(f"no checkpoints in {storage.path}")
        step = steps[-1]
    elif step not in storage.examine_all():
        raise NoCheckpointError(f"no step {step} in {storage.path}")
    return _step_meta(storage, step)


def _plain_shown(storage: Storage, step: int | None) -> _plain.PlainStep | None:
    """The plain Orbax step `show` shows (`--step`, or the latest step when it is
    one: `latest_step()`'s), or None for a step of ours."""
    examined = storage.examine_all()
    plain = _plain.listed(storage, examined)
    if step is None:
        ours = [s for s, f in examined.items() if f.kind == "complete"]
        step = max([*ours, *plain], default=None)
    return None if step is None else plain.get(step)


def _step_meta(storage: Storage, step: int) -> tuple[dict[str, Any], _format.StepMeta]:
    """`_meta` of a step known to be there (`ls` lists each step once)."""
    try:
        meta = storage.open_step(step).meta
        return meta, _format.StepMeta.parse(meta)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise RestoreError(f"step {step} of {storage.path} is damaged: {e}") from e


def _listed(
    storage: Storage, step: int, metas: dict[int, _format.StepMeta]
) -> dict[str, Any] | None:
    """The row of a complete step; its parsed meta goes into `metas`."""
    metrics = {}
    damaged = None
    try:
        meta = _step_meta(storage, step)[1]
        metas[step] = meta
        saved_at = meta.saved_at or storage.entry_time(str(step))
        metrics = {name: value.tolist() for name, value in meta.metrics.items()}
    except (CheckpointError, OSError) as e:
        if not storage.exists(str(step)):  # removed by retention meanwhile
            return None
        saved_at = storage.entry_time(str(step))
        if isinstance(e, RestoreError):  # (_step_meta: its description is not whole)
            damaged = str(e.__cause__ or e)
    bytes_ = storage.entry_bytes(str(step))
    row = {"step": step, "saved_at": saved_at, "bytes": bytes_, "complete": damaged is None}
    if damaged is not None:
        # Listed by its files alone (a bucket lists a step by its objects; a local step
        # damaged since it was listed), but its description is not what was written.
        return row | {"damaged": damaged, "listed": True}
    return row | {"metrics": metrics} if metrics else row


# -- show --------------------------------------------------------------------------------


def _show(storage: Storage, args: argparse.Namespace) -> int:
    directory = storage.path
    plain = _plain_shown(storage, args.step)
    if plain is not None:
        return _show_plain(storage, plain, args)
    if args.json:
        found = _meta(storage, args.step)[0]
        _print_json({"directory": directory, **found, **_extra_of(storage, found["step"])})
        return 0
    meta = _meta(storage, args.step)[1]
    _say(f"step {meta.step} of {directory}")
    _say(f"  saved at      {meta.saved_at or 'not recorded (older version)'}")
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
    _say(f"  written by    {written}")
    _say(f"  size on disk  {_size(storage.entry_bytes(str(meta.step)))}")
    if meta.batch_shape:
        axes = meta.device_axes
        if axes:
            _say(f"  device axis   {_per_device(meta, axes)}")
        else:
            _say(f"  vmap batch    {_batch(meta)}")
    checked = "yes" if meta.checksums else "no (written before checksums were kept)"
    _say(f"  checksums     {checked}")
    if meta.metrics:
        shown = ", ".join(
            f"{name}={_metric_text({meta.step: meta}, meta.step, name)}" for name in meta.metrics
        )
        _say(f"  metrics       {shown}")
    if meta.retention is not None:
        try:
            _say(f"  retention     {AnyOf.from_json(meta.retention).describe()}")
        except ValueError as e:
            _say(f"  retention     unreadable record ({e})")
    _show_extra(_extra_of(storage, meta.step))
    _say(f"  {len(meta.leaves)} leaves:")
    rows = [
        (
            _safe(leaf.path),
            f"key<{_safe(leaf.impl)}>" if leaf.kind == _spec.KEY else leaf.dtype,
            str(leaf.shape),
            _sharding(meta.shardings[leaf.path]) if leaf.path in meta.shardings else "",
        )
        for leaf in meta.leaves
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        _say(("    " + "  ".join([*cells, row[3]])).rstrip())
    return 0


def _extra_of(storage: Storage, step: int) -> dict[str, Any]:
    """{"extra": the JSON saved with `step` by `extra=`} (`_layout/_extra.read`: bounded
    and checked against its CRC-32 before it is parsed), {} for a step saved without,
    {"extra_damaged": what is wrong} when it is not what was written."""
    try:
        value = _extra.read(functools.partial(storage.step_file, step))
    except _format.DamagedStep as e:
        return {"extra_damaged": str(e)}
    return {} if value is None else {"extra": value}


_EXTRA_SHOWN = 300  # characters of a step's extra that `show` prints (--json: all)


def _show_extra(found: dict[str, Any]) -> None:
    """`show`'s line of a step's `extra` (`_extra_of`), if any."""
    if "extra_damaged" in found:
        _say(f"  extra         damaged: {found['extra_damaged']}")
    elif "extra" in found:
        text = json.dumps(found["extra"])
        if len(text) > _EXTRA_SHOWN:
            text = f"{text[:_EXTRA_SHOWN]}... ({len(text)} characters; --json shows all)"
        _say(f"  extra         {text}")


def _show_plain(storage: Storage, found: _plain.PlainStep, args: argparse.Namespace) -> int:
    """`show` of a plain Orbax step: what `metadata()` gives for it (`_plain.describe`)."""
    described = _plain.describe(storage, found)
    if args.json:
        _print_json({"directory": storage.path, **described})
        return 0
    _say(f"step {found.step} of {storage.path}")
    _say(f"  written by    Orbax's CheckpointManager (a plain Orbax step, item {found.item!r})")
    _say(f"  saved at      {described['saved_at'] or 'not recorded'}")
    _say(f"  size on disk  {_size(storage.entry_bytes(str(found.step)))}")
    _say("  checksums     none (Orbax keeps none): read with Orbax, unverified")
    _say("  a restart resumes from it; never written, set aside or deleted")
    if described["metrics"]:
        shown = ", ".join(f"{k}={v}" for k, v in described["metrics"].items())
        _say(f"  metrics       {shown}")
    names = described["leaf_names"]
    _say(f"  {len(names)} leaves (shapes and dtypes: Orbax's metadata):")
    for name in names:
        _say("    " + "/".join(name))
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
    if meta.left is not None:  # they had left their ckpt.while_loop: leftovers here
        which += f"; left their loop: {[tuple(int(i) for i in x) for x in np.argwhere(meta.left)]}"
    return f"shape {meta.batch_shape} (leading axes of every leaf); {which}"


def _per_device(meta: _format.StepMeta, axes: tuple[str, ...]) -> str:
    """What the device axis of a per-device save (`StepMeta.device_axes`) holds."""
    import numpy as np

    saved = meta.members
    over = ", ".join(repr(a) for a in axes)
    held = [int(i) for i in np.flatnonzero(saved)]
    if len(held) == saved.size:
        which = f"all {saved.size} devices saved"
    else:
        which = f"{len(held)} of {saved.size} devices saved: {held}"
    return (
        f"shape {meta.batch_shape} over pmap/shard_map axis {over} (the leading axis of "
        f"every leaf: one state per device, as pmap returns it); {which}"
    )


def _sharding(described: dict[str, Any]) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in described["mesh"].items())
    spec = ", ".join(
        "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
        for axes in described["spec"]
    )
    return f"saved per device: mesh({mesh}) P({spec})"


# -- verify ------------------------------------------------------------------------------


def _verify(storage: Storage, args: argparse.Namespace) -> int:
    directory = storage.path
    found = storage.examine_all()
    plain = _plain.listed(storage, found)  # read whole with Orbax: readable, unverified
    damaged = {step: f.why for step, f in found.items() if f.kind in ("damaged", "unreadable")}
    if args.step is None:
        steps = sorted(step for step, f in found.items() if f.kind != "foreign" or step in plain)
    else:
        steps = [args.step]
    if not steps:
        raise NoCheckpointError(
            f"no checkpoints in {directory} (nothing to verify: is it the run's own "
            f"directory?){_step_folder_hint(storage)}"
        )
    if args.step is not None and args.step not in found:
        raise NoCheckpointError(f"no step {args.step} in {directory}")
    results = [_verified(storage, args, step, found, plain, damaged) for step in steps]
    failed = [r for r in results if not r["ok"]]
    unchecked = [r for r in results if r["ok"] and not r["checksums"] and not r.get("removed")]
    if args.json:
        _print_json({"directory": directory, "ok": not failed, "steps": results})
    else:
        for r in results:
            _say(f"step {r['step']}: {_verify_line(r)}")
    return _FAILED if failed else _UNCHECKED if unchecked else 0


def _verified(
    storage: Storage,
    args: argparse.Namespace,
    step: int,
    found: dict[int, _format.Examined],
    plain: dict[int, _plain.PlainStep],
    damaged: dict[int, str],
) -> dict[str, Any]:
    """`verify`'s result for one step: read whole, every byte against its checksum."""
    from .._read._steps import gone, verify  # reading arrays needs TensorStore, not JAX

    result: dict[str, Any] = {"step": step, "checksums": False}
    try:
        if step in damaged:
            raise _format.DamagedStep(damaged[step])
        if step in plain:
            result["plain_orbax"] = True
        else:
            read = _step_meta if step in found else _meta  # (_meta says it is not there)
            result["checksums"] = bool(read(storage, step)[1].checksums)
        with warnings.catch_warnings():  # a damaged step is its own line here
            warnings.simplefilter("ignore", DamagedStepWarning)
            verify(storage.path, step=step)
        result["ok"] = True
    except _format.DamagedStep as e:
        result["ok"] = False
        result["error"] = f"DAMAGED: {e}; not listed, not restored"
    except (CheckpointError, OSError) as e:
        if step in found and found[step].kind == "complete" and gone(storage, step):
            # A run writing the directory removed it (retention): no damage.
            if args.step is not None:  # the one step asked for is not there (exit 2)
                raise NoCheckpointError(
                    f"step {step} of {storage.path} was removed while it was being read "
                    "(by the retention of a run writing here): nothing was verified"
                ) from e
            result.update(ok=True, removed=True)
        else:
            result["ok"] = False
            result["error"] = f"FAILED: {e}"
    return result


def _verify_line(r: dict[str, Any]) -> str:
    """`verify`'s line for one step's result (after "step N: ")."""
    if not r["ok"]:
        return r["error"]
    if r.get("removed"):
        return "removed while it was being read (the retention of a run writing here), skipped"
    if r["checksums"]:
        return "ok (every byte matches its checksum)"
    if r.get("plain_orbax"):
        return (
            "a plain Orbax step, read whole with Orbax: readable, NOT verified (Orbax keeps "
            "no checksums)"
        )
    return "readable, NOT verified: written without checksums (by an older version)"


# -- output ------------------------------------------------------------------------------


def _print_json(value: dict[str, Any]) -> None:
    """One strict JSON object: NaN and inf (a metric, or anything an edited file holds)
    as the strings "nan", "inf", "-inf" (`_strict`)."""
    json.dump(_strict(value), sys.stdout, indent=1, allow_nan=False)
    print()


def _strict(value: Any) -> Any:
    """`value` with every float that JSON cannot hold (NaN, inf) as its string."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


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
