"""A worker's stop signals (`worker.runtime.install_stop_signals`): a signal handled while the main
thread holds a lock must not block. A Python handler runs in the main thread between two of its
bytecodes; a worker whose handler called ``Event.set`` while its main thread sat inside that
event's ``wait`` (holding the event's condition lock) hung for good and ignored every later
SIGTERM. Each case runs in a process of its own (signal handlers are per process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

# The worst moment: the signals arrive while the main thread holds an Event's condition lock, as
# it does inside Event.wait (signal.raise_signal runs the handler before it returns).
HELD = textwrap.dedent("""
    import signal, threading
    event = threading.Event()
    {install}
    with event._cond:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    print("returned", {report})
""")


def _run(install: str, report: str, timeout_s: float) -> str | None:
    """stdout of the case, or None when it did not finish within ``timeout_s``."""
    try:
        done = subprocess.run([sys.executable, "-c", HELD.format(install=install, report=report)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_stop_signals_handled_while_the_main_thread_holds_a_lock_are_recorded_and_do_not_block():
    out = _run("from worker.runtime import install_stop_signals\nreceived = install_stop_signals()",
               "received == [signal.SIGTERM, signal.SIGINT]", timeout_s=120)
    assert out == "returned True"


def test_the_handler_it_replaced_blocks_at_that_moment():
    """What the test above guards against: ``Event.set`` as the handler never returns there."""
    assert _run("signal.signal(signal.SIGTERM, lambda *_: event.set())", "event.is_set()", timeout_s=5) is None
