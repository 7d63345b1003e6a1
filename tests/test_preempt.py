"""`_user/_preempt.py`: the stop request. `StopFlag` records the first request and its
signal, `take` consumes it, Ctrl-C without `sigint=True` is an interrupt to raise later;
`signals()` turns SIGTERM (and SIGINT when asked) into a request only while its block
runs and restores the handlers after; traced code reads the flag (`traced`) and
records the step it read at; `Preempted` exits with 128 + the signal."""

import os
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cb_ckpt._user._preempt import Preempted, StopFlag


def test_the_first_request_and_its_signal_are_kept_until_taken():
    flag = StopFlag()
    assert flag.take() == (False, None)
    flag.request(signal.SIGTERM)
    flag.request(signal.SIGINT)
    assert flag.requested and flag.signum == signal.SIGTERM
    assert flag.take() == (True, signal.SIGTERM)
    assert flag.take() == (False, None)
    flag.request()
    assert flag.take() == (True, None)


def test_an_interrupt_requests_a_stop_and_keeps_the_first_error():
    flag = StopFlag()
    first, second = KeyboardInterrupt("a"), KeyboardInterrupt("b")
    flag.interrupt(first)
    flag.interrupt(second)
    assert flag.interrupted and flag.deferred is first
    assert (flag.requested, flag.signum) == (True, signal.SIGINT)
    flag.clear()
    assert not flag.interrupted and flag.deferred is None and not flag.requested


def test_sigterm_is_a_request_only_inside_the_block():
    flag = StopFlag()
    before = signal.getsignal(signal.SIGTERM)
    with flag.signals(sigint=False):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes
            if flag.requested:
                break
    assert flag.take() == (True, signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_without_sigint_is_an_interrupt_and_with_sigint_a_request():
    flag = StopFlag()
    # Python's own handler, as an interactive run has it (a test runner started in the
    # background inherits SIGINT ignored): what the flag must restore.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with flag.signals(sigint=False):
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here
        assert flag.interrupted and flag.requested
        flag.clear()
        with flag.signals(sigint=True):
            signal.raise_signal(signal.SIGINT)
        assert not flag.interrupted and flag.take() == (True, signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_users_sigint_handler_runs_and_what_it_raises_is_deferred():
    flag, ran = StopFlag(), []

    def mine(signum, frame):
        ran.append(signum)
        raise RuntimeError("user's handler")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with flag.signals(sigint=False):
            signal.raise_signal(signal.SIGINT)
        assert ran == [signal.SIGINT]
        assert isinstance(flag.deferred, RuntimeError) and flag.interrupted
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_no_handler_is_installed():
    flag, seen = StopFlag(), []

    def other():
        with flag.signals(sigint=True):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [before]


def test_traced_code_reads_the_flag_and_records_the_step():
    flag = StopFlag()
    read = jax.jit(flag.traced)
    assert not bool(read(jnp.int32(3)))
    assert flag.reached == 3
    flag.request()
    assert bool(read(jnp.int32(4)))
    out = jax.vmap(flag.traced)(jnp.arange(3))
    np.testing.assert_array_equal(out, [True, True, True])
    assert flag.reached == 2


def test_preempted_exits_with_128_plus_the_signal():
    by_signal = Preempted(40, signal.SIGTERM)
    assert isinstance(by_signal, SystemExit) and by_signal.code == 128 + signal.SIGTERM
    assert str(by_signal) == "jax_cb_ckpt: stopped at step 40 after SIGTERM; checkpoint saved"
    by_call = Preempted(7, None)
    assert by_call.code == 1 and "after request_stop()" in str(by_call)
