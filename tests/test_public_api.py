import ast
import importlib
import inspect
import re
from pathlib import Path

import jax_cb_ckpt

PUBLIC = [
    "Checkpointer",
    "BestN",
    "EveryNSeconds",
    "EveryNSteps",
    "LatestN",
    "CheckpointError",
    "CheckpointerClosedError",
    "CheckpointWarning",
    "ConfigError",
    "ConstantStepWarning",
    "DamagedStepError",
    "DamagedStepWarning",
    "DirectoryLockedError",
    "DuplicateStepWarning",
    "ForeignStepWarning",
    "InvalidStateError",
    "MemberStateWarning",
    "NoCheckpointError",
    "RestoreError",
    "SaveError",
    "SaveFailedWarning",
    "Preempted",
    "SaveRecord",
    "SkippedSaveWarning",
    "Stats",
    "StepExistsError",
    "StepOrderWarning",
    "StructureMismatchError",
    "UnflushedSaveWarning",
    "all_steps",
    "best_step",
    "latest_step",
    "metadata",
    "metrics",
    "metrics_table",
    "restore",
    "restore_extra",
    "same_bits",
    "verify",
]


def test_every_public_name_imports():
    module = importlib.import_module("jax_cb_ckpt")
    for name in PUBLIC:
        assert getattr(module, name) is not None, name
    public = {n for n in dir(module) if not n.startswith("_")}
    assert public == set(PUBLIC), public ^ set(PUBLIC)


def test_version_is_set():
    assert jax_cb_ckpt.__version__ and jax_cb_ckpt.__version__ != "0+unknown"


def test_errors_have_useful_bases():
    assert issubclass(jax_cb_ckpt.InvalidStateError, TypeError)
    assert issubclass(jax_cb_ckpt.ConfigError, ValueError)
    assert issubclass(jax_cb_ckpt.StructureMismatchError, ValueError)
    assert issubclass(jax_cb_ckpt.NoCheckpointError, FileNotFoundError)
    for name in ["SaveError", "RestoreError", "InvalidStateError", "ConfigError"]:
        assert issubclass(getattr(jax_cb_ckpt, name), jax_cb_ckpt.CheckpointError)


def test_exceptions_and_warnings_are_named_where_users_import_them():
    """Issue 44 item 3: tracebacks printed `jax_cb_ckpt._base._errors.StepExistsError`."""
    import traceback

    for name in PUBLIC:
        value = getattr(jax_cb_ckpt, name)
        if isinstance(value, type) and issubclass(value, BaseException | Warning):
            assert value.__module__ == "jax_cb_ckpt", name
    try:
        raise jax_cb_ckpt.StepExistsError("saving step 3: ...")
    except jax_cb_ckpt.StepExistsError as e:
        shown = "".join(traceback.format_exception(e))
    assert shown.rstrip().endswith("jax_cb_ckpt.StepExistsError: saving step 3: ...")


README = Path(__file__).resolve().parent.parent / "README.md"


def _api_block():
    """The README's API block, comments removed."""
    text = README.read_text()
    block = text.split("## API\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return "\n".join(line.split("#", 1)[0] for line in block.splitlines())


def _calls(block):
    """{(owner, name): [parameter texts]} of each `ckpt.X(...)` / `jax_cb_ckpt.X(...)`
    in the block (refused when one is shown twice)."""
    calls = {}
    for match in re.finditer(r"\b(ckpt|jax_cb_ckpt)\.(\w+)\(", block):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(block[end], 0)
            end += 1
        inside, parts, depth, start = block[match.end() : end - 1], [], 0, 0
        for i, c in enumerate(inside + ","):
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(c, 0)
            if c == "," and depth == 0:
                parts.append(inside[start:i].strip())
                start = i + 1
        key = match.groups()
        assert key not in calls, f"{key} is shown twice in the README's API block"
        calls[key] = [p for p in parts if p]
    return calls


def _shown(parameter):
    """A parameter as the README writes it: `name`, `name=default`, `*args`, `*`."""
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
        return f"*{parameter.name}"
    if parameter.default is inspect.Parameter.empty:
        return parameter.name
    return f"{parameter.name}={parameter.default!r}".replace("'", '"')


def test_the_readme_api_block_is_every_public_signature():
    """Issue 44 item 5: the README's API block left out run's progress= and metrics=
    (and more). It shows every public callable once, with every parameter and its
    default as the code has them (keyword-only ones in any order, after the `*`)."""
    from jax_cb_ckpt import Checkpointer

    calls = _calls(_api_block())
    public = {
        ("jax_cb_ckpt", name)
        for name in PUBLIC
        if callable(getattr(jax_cb_ckpt, name))
        and (name == "Checkpointer" or not isinstance(getattr(jax_cb_ckpt, name), type))
    }
    public |= {
        ("ckpt", name)
        for name, value in vars(Checkpointer).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }
    assert set(calls) == public, set(calls) ^ public
    for (owner, name), written in calls.items():
        target = getattr(Checkpointer if owner == "ckpt" else jax_cb_ckpt, name)
        parameters = list(inspect.signature(target).parameters.values())
        if owner == "ckpt":
            parameters = parameters[1:]  # self
        keyword = [p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
        leading = [_shown(p) for p in parameters if p not in keyword]
        if keyword and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
            leading.append("*")
        where = f"README API block: {owner}.{name}"
        assert written[: len(leading)] == leading, (where, written, leading)
        assert sorted(written[len(leading) :]) == sorted(map(_shown, keyword)), (where, written)
        for text in written:  # each default is the value itself, not a description
            if "=" in text:
                value = text.split("=", 1)[1]
                assert repr(ast.literal_eval(value)).replace("'", '"') == value, (where, text)
    for attribute in re.findall(r"\bckpt\.(\w+)\b(?!\()", _api_block()):
        assert hasattr(Checkpointer, attribute), attribute
