"""The options of `Checkpointer(...)` (`_user/_options.py`): five frozen groups that
check themselves, the flat keywords mapped onto them in one place, and the same
checked values as the flat `Options` they replaced (issue 46, item 3)."""

import dataclasses
import inspect
import json
import math
import re

import pytest

from jax_cb_ckpt import BestN, Checkpointer, ConfigError, EveryNSeconds, EveryNSteps, LatestN
from jax_cb_ckpt._layout import _format
from jax_cb_ckpt._layout._policy import AnyOf
from jax_cb_ckpt._user import _options
from jax_cb_ckpt._user._options import Failures, Keep, Options, Queue, When, Where

NON_DEFAULT = dict(
    every=5,
    max_to_keep=3,
    queue_size=4,
    on_full="newest",
    compression=True,
    on_error="continue",
    on_existing="replace",
    crossing="callback",
    peer_timeout=7,
    every_seconds=2,
    check_every=10,
    initial_save=True,
    keep_every=20,
    keep_every_seconds=30,
    keep_best=2,
    best="return",
    mode="min",
    on_damaged="raise",
)

# What the flat `Options` of commit 0119b53 held (printed from that commit) for
# `Checkpointer(d)` and `Checkpointer(d, **NON_DEFAULT)`, `directory` aside.
BEFORE_DEFAULTS = dict(
    every=None,
    max_to_keep=None,
    queue_size=2,
    on_full="block",
    compression=False,
    on_error="raise",
    on_existing="raise",
    crossing="auto",
    peer_timeout=60.0,
    every_seconds=None,
    check_every=100,
    initial_save=False,
    on_damaged="fall_back",
    rules=None,
)
BEFORE_NON_DEFAULT = dict(
    every=5,
    max_to_keep=3,
    queue_size=4,
    on_full="newest",
    compression=True,
    on_error="continue",
    on_existing="replace",
    crossing="callback",
    peer_timeout=7.0,
    every_seconds=2.0,
    check_every=10,
    initial_save=True,
    on_damaged="raise",
    rules=AnyOf.short(
        dict(
            max_to_keep=3,
            keep_every=20,
            keep_every_seconds=30.0,
            keep_best=2,
            best="return",
            mode="min",
        )
    ),
)


def flat(options):
    """`options` in the flat `Options`' field names (the values the stages read)."""
    where, when, keep, queue, failures = (
        options.where,
        options.when,
        options.keep,
        options.queue,
        options.failures,
    )
    return dict(
        every=when.every,
        max_to_keep=keep.max_to_keep,
        queue_size=queue.queue_size,
        on_full=queue.on_full,
        compression=where.compression,
        on_error=failures.on_error,
        on_existing=failures.on_existing,
        crossing=where.crossing,
        peer_timeout=failures.peer_timeout,
        every_seconds=when.every_seconds,
        check_every=when.check,
        initial_save=when.initial_save,
        on_damaged=failures.on_damaged,
        rules=keep.rules,
    )


@pytest.mark.parametrize(
    "given, before",
    [({}, BEFORE_DEFAULTS), (NON_DEFAULT, BEFORE_NON_DEFAULT)],
    ids=["defaults", "non-default"],
)
def test_the_checkpointer_builds_the_options_it_built_before(tmp_path, given, before):
    with Checkpointer(tmp_path / "run", **given) as ckpt:
        options = ckpt._options
        assert isinstance(options, Options)
        assert options.where.directory == str(tmp_path / "run") == ckpt.directory
        got = flat(options)
        assert got == before
        for name, value in before.items():  # 60 and 60.0 are equal: the types too
            assert type(got[name]) is type(value), name
        if options.keep.rules is not None:
            assert type(options.keep.rules.find(EveryNSeconds).seconds) is float
        assert options == _options.checked(tmp_path / "run", **given)  # the same mapping


def test_each_keyword_belongs_to_one_group_with_the_signature_s_default():
    """The signature of `Checkpointer(...)` is the public spelling; the groups' fields
    are the one list it maps onto, so neither can gain or lose an option alone."""
    parameters = inspect.signature(Checkpointer).parameters
    owners = {}
    for name, group in _options.GROUPS.items():
        assert [f.name for f in dataclasses.fields(Options)].count(name) == 1
        for keyword in _options.keywords(group):
            assert keyword not in owners, f"{keyword} is in {owners[keyword]} and {name}"
            owners[keyword] = name
    assert set(owners) == set(parameters)
    for group in _options.GROUPS.values():
        for field in dataclasses.fields(group):
            if field.init and field.name != "directory" and group is not Keep:
                assert parameters[field.name].default == field.default, field.name
    for keyword, default in Keep.KEYWORDS.items():  # keep= and the rules' short form
        assert parameters[keyword].default == default, keyword
    assert parameters["directory"].default is inspect.Parameter.empty
    assert [f.name for f in dataclasses.fields(Options)] == list(_options.GROUPS)


def test_an_unknown_option_is_a_bug_of_ours(tmp_path):
    with pytest.raises(TypeError, match="no option"):
        _options.checked(tmp_path, every_step=3)


# (group, {its fields}, the argument named in the message, what the message says)
BAD = [
    (Where, {"directory": 123}, "directory", "must be a str or os.PathLike"),
    (Where, {"directory": ""}, "directory", "directory is empty"),
    (Where, {"directory": "s3:/bucket/run"}, "directory", "slash missing"),
    (Where, {"directory": ".", "crossing": "fast"}, "crossing", "crossing must be one of"),
    (When, {"every": 0}, "every", "every must be a positive int or None"),
    (When, {"every": True}, "every", "every must be a positive int or None"),
    (When, {"every_seconds": -1}, "every_seconds", "positive number of seconds"),
    (When, {"every_seconds": math.nan}, "every_seconds", "positive number of seconds"),
    (When, {"every_seconds": 1, "check_every": 0}, "check_every", "positive int"),
    (When, {"check_every": 10}, "check_every", "there is no every_seconds"),
    (When, {"initial_save": "yes"}, "initial_save", "initial_save must be True or False"),
    (Keep, {"max_to_keep": -1}, "max_to_keep", "max_to_keep must be a positive int"),
    (Keep, {"keep_every": 1.5}, "keep_every", "keep_every must be a positive int"),
    (Keep, {"keep_every_seconds": 0}, "keep_every_seconds", "positive number of seconds"),
    (Keep, {"keep_best": 0, "best": "r"}, "keep_best", "keep_best must be a positive int"),
    (Keep, {"keep_best": 2}, "keep_best", "keep_best and best go together"),
    (Keep, {"best": "r"}, "keep_best", "keep_best and best go together"),
    (Keep, {"keep_best": 1, "best": ""}, "best", "best must name a metric"),
    (Keep, {"keep_best": 1, "best": 7}, "best", "best must name a metric"),
    (
        Keep,
        {"keep_best": 1, "best": "x" * (_format.MAX_METRIC_NAME + 1)},
        "best",
        "best must name a metric",
    ),
    (Keep, {"mode": "up"}, "mode", "mode must be one of"),
    (Queue, {"queue_size": None}, "queue_size", "queue_size must be a positive int ("),
    (Queue, {"queue_size": 0}, "queue_size", "queue_size must be a positive int ("),
    (Queue, {"on_full": "drop"}, "on_full", "on_full must be one of"),
    (Failures, {"on_error": "ignore"}, "on_error", "on_error must be one of"),
    (Failures, {"on_existing": "overwrite"}, "on_existing", "on_existing must be one of"),
    (Failures, {"on_damaged": "skip"}, "on_damaged", "on_damaged must be one of"),
    (Failures, {"peer_timeout": True}, "peer_timeout", "peer_timeout must be a positive"),
    (Failures, {"peer_timeout": 0}, "peer_timeout", "peer_timeout must be a positive"),
    (Failures, {"peer_timeout": "9"}, "peer_timeout", "peer_timeout must be a positive"),
]


@pytest.mark.parametrize(
    "group, fields, named, says",
    BAD,
    ids=[f"{g.__name__}-{'-'.join(f'{k}={v!r}'[:30] for k, v in f.items())}" for g, f, _, _ in BAD],
)
def test_each_group_refuses_a_bad_value_naming_the_argument(
    tmp_path, monkeypatch, group, fields, named, says
):
    """A group made directly refuses the value with the message `Checkpointer(...)`
    gives for the same keyword: the check is the group's own."""
    monkeypatch.chdir(tmp_path)  # (a relative directory lands here)
    with pytest.raises(ConfigError, match=re.escape(says)) as direct:
        Keep.given(**fields) if group is Keep else group(**fields)
    assert f"Checkpointer({named}=" in str(direct.value)  # names the argument
    given = {k: v for k, v in fields.items() if k != "directory"}
    directory = fields.get("directory", str(tmp_path))
    with pytest.raises(ConfigError) as through:
        Checkpointer(directory, **given)
    assert str(through.value) == str(direct.value)
    assert not (tmp_path / "s3:").exists()


def test_a_file_where_the_directory_should_be_is_refused_by_where(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(ConfigError, match=r"Checkpointer\(directory=.*is an existing file"):
        Where(str(tmp_path / "f"))


@pytest.mark.parametrize(
    "made",
    [
        Where("."),
        When(every=3, every_seconds=2, check_every=7, initial_save=True),
        Keep.given(max_to_keep=2, keep_best=1, best="r"),
        Queue(queue_size=3, on_full="skip"),
        Failures(on_error="continue", peer_timeout=5),
        Options(Where("."), When(), Keep(), Queue(), Failures()),
    ],
    ids=lambda g: type(g).__name__,
)
def test_the_groups_are_frozen_and_check_again_when_copied(made):
    for field in dataclasses.fields(made):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, field.name, getattr(made, field.name))
    assert dataclasses.replace(made) == made  # what a group keeps passes its own checks


def test_the_groups_keep_their_values_in_one_form():
    assert Where(".").directory not in (".", "")  # absolute
    assert Where(".", compression=1).compression is True
    assert When(every_seconds=3).every_seconds == 3.0
    assert type(When(every_seconds=3).every_seconds) is float
    assert When().check == _options.DEFAULT_CHECK_EVERY
    assert When(every_seconds=1, check_every=7).check == 7
    assert Keep().rules is None  # no rule: every step is kept
    assert Keep.given(keep_every=10).rules == AnyOf.short({"keep_every": 10})
    made = Keep.given(keep_best=1, best="r", mode="min").rules
    assert made == AnyOf.short({"keep_best": 1, "best": "r", "mode": "min"})
    assert type(Failures(peer_timeout=5).peer_timeout) is float
    assert (Queue().slots, Queue(on_full="newest").slots, Queue(3, "skip").slots) == (2, 3, 3)


def test_only_what_users_read_is_a_property():
    """Issue 46: the options are not passed through one by one; users read the
    directory, the counters and the stop request (the README's API block)."""
    properties = {n for n, v in vars(Checkpointer).items() if isinstance(v, property)}
    assert properties == {"directory", "stats", "stop_requested"}


def test_keep_takes_the_rules_as_objects_the_keywords_short_form(tmp_path):
    """`keep=[...]` and the keywords build the same rules, recorded in the same bytes
    whatever the list's order (P-usage-300)."""
    short = _options.checked(
        tmp_path, max_to_keep=3, keep_every_seconds=60, keep_best=2, best="loss", mode="min"
    )
    rules = [BestN("loss", 2, "min"), EveryNSeconds(60), LatestN(3)]
    long = _options.checked(tmp_path, keep=rules)
    assert long.keep.rules == short.keep.rules
    assert json.dumps(long.keep.rules.to_json()) == json.dumps(short.keep.rules.to_json())
    assert long.keep.best == "loss" and long.keep.mode == "min" and long.keep.max_to_keep == 3
    assert _options.checked(tmp_path, keep=[]).keep.rules is None  # no rule: keep all


KEEP_BAD = [
    (dict(keep=[LatestN(3)], max_to_keep=2), r"Checkpointer\(keep=\[...\], max_to_keep=...\): "),
    (
        dict(keep=[LatestN(3)], mode="min"),
        r"Checkpointer\(keep=\[...\], mode=...\): keep= and mode both say",
    ),
    (dict(keep=LatestN(3)), r"Checkpointer\(keep=LatestN\(n=3\)\): keep must be a list"),
    (dict(keep="max_to_keep=3"), r"keep must be a list of retention rules, got a str"),
    (dict(keep=[3]), r"Checkpointer\(keep=\[...\]\): keep\[0\] is 3 \(int\), not a retention"),
    (dict(keep=[LatestN]), r"keep\[0\] is <class .*LatestN'> \(the class itself\)"),
    (dict(keep=[LatestN(2), LatestN(3)]), r"Checkpointer\(keep=\[...\]\): LatestN is given 2"),
]


@pytest.mark.parametrize("given, says", KEEP_BAD, ids=[says[:40] for _, says in KEEP_BAD])
def test_keep_given_wrongly_is_refused_naming_it(tmp_path, given, says):
    with pytest.raises(ConfigError, match=says):
        Checkpointer(tmp_path / "run", **given)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda: LatestN(0), r"^LatestN\(n=...\): n must be a positive int \(how many"),
        (lambda: LatestN(True), r"^LatestN\(n=...\): .*got True of type bool"),
        (lambda: EveryNSteps(2.5), r"^EveryNSteps\(n=...\): n must be a positive int"),
        (lambda: EveryNSeconds(-1), r"^EveryNSeconds\(seconds=...\): .*positive number of sec"),
        (lambda: BestN("loss", 0), r"^BestN\(n=...\): n must be a positive int"),
        (lambda: BestN("loss", 2, "median"), r"^BestN\(mode='median'\): mode must be one of"),
        (lambda: BestN("", 2), r"^BestN\(metric=''\): metric must name a metric"),
        (lambda: BestN(None, 2), r"^BestN\(n=2, metric=None\): n and metric go together"),
    ],
)
def test_a_misconfigured_rule_object_is_refused_naming_its_argument(make, says):
    with pytest.raises(ConfigError, match=says):
        make()
