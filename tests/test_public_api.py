import importlib

import jax_cb_ckpt

PUBLIC = [
    "Checkpointer",
    "CheckpointError",
    "CheckpointerClosedError",
    "CheckpointWarning",
    "ConfigError",
    "DamagedStepError",
    "DamagedStepWarning",
    "DirectoryLockedError",
    "DuplicateStepWarning",
    "ForeignStepWarning",
    "InvalidStateError",
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
    """Issue 44 item 3: tracebacks printed `jax_cb_ckpt._errors.StepExistsError`."""
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
