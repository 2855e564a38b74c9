"""Reruns a test once when it kills its pytest-xdist worker (a native crash), and says so.

CI on 2026-11-24 (commit 31e5d21) lost a whole run to one crash: the worker running
``tests/test_readme.py`` aborted inside ``Compiled.__call__`` in ``train.fit`` after 823 other
tests had passed. Its likely cause was found and fixed (XLA:CPU deadlocks past ~32 queued
steps with an in-process all-reduce and aborts after 40 s; see
``mfopt.train.MAX_STEPS_IN_FLIGHT``), but a native crash in a dependency can come back in
another form, and one costs the whole CI run.

A crash is not an assertion: this plugin reschedules only tests whose *worker process died*,
at most ``max_reruns`` times each, and lists every rerun in the terminal summary with the crash
text xdist printed above it. A test that crashes again, or that fails normally, still fails the
run.

This uses pytest-xdist's own ``pytest_handlecrashitem`` hook (its documented recipe:
``sched.mark_test_pending`` and outcome ``"rerun"``) rather than pytest-rerunfailures, whose
``--reruns`` would also retry ordinary failures.

A test that pytest-timeout's ``thread`` method stopped (it dumps the stacks and exits the
worker, the only way out of a hang inside XLA) also kills its worker, but it would hang again:
the workers mark such tests in a directory the controller names in ``$MFOPT_TIMED_OUT_DIR``,
and those are not rerun.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import traceback

import pytest

TIMED_OUT_DIR = "MFOPT_TIMED_OUT_DIR"


def _marker(nodeid: str) -> pathlib.Path | None:
  folder = os.environ.get(TIMED_OUT_DIR)
  if not folder:
    return None
  return pathlib.Path(folder) / hashlib.sha1(nodeid.encode()).hexdigest()


class TimeoutMarker:
  """On a worker: pytest-timeout's thread-method timer, marking the test before it exits."""

  @pytest.hookimpl(tryfirst=True)
  def pytest_timeout_set_timer(self, item, settings):
    if settings.method != "thread":
      return None  # pytest-timeout's own
    import pytest_timeout  # noqa: PLC0415

    def fire():
      marker = _marker(item.nodeid)
      if marker is not None:  # the stacks, for the controller (a worker's own output is lost)
        me = threading.get_ident()
        marker.write_text("".join(
            f"--- thread {ident} ---\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items() if ident != me))
      pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, os._exit(1)

    timer = threading.Timer(settings.timeout, fire)
    timer.daemon = True

    def cancel():
      timer.cancel()
      timer.join()

    item.cancel_timeout = cancel
    timer.start()
    return True


class CrashRerun:
  """A pytest plugin (register it on the xdist controller): see the module docstring.

  A rescheduled test that never reports again (xdist out of worker restarts, or a session
  stopped early) fails the session at its end, so a crash can never turn into a pass. With a
  scheduler that cannot reschedule (``--dist loadfile``, ``loadscope``, ``each``) the crash
  stays the failure xdist reported.
  """

  def __init__(self, max_reruns: int = 1):
    self.max_reruns = max_reruns
    self.crashes: collections.Counter[str] = collections.Counter()
    self.awaiting: set[str] = set()  # rescheduled, no report since
    self.timed_out: dict[str, str] = {}  # node id -> the worker's stacks at the timeout

  def pytest_handlecrashitem(self, crashitem, report, sched):
    self.crashes[crashitem] += 1
    marker = _marker(crashitem)
    if marker is not None and marker.exists():  # a hang, not a crash: it would hang again
      self.timed_out[crashitem] = marker.read_text()
      return
    if self.crashes[crashitem] > self.max_reruns:
      return
    try:
      sched.mark_test_pending(crashitem)
    except NotImplementedError:  # this --dist mode cannot reschedule: the crash fails the test
      return
    report.outcome = "rerun"
    self.awaiting.add(crashitem)

  def pytest_runtest_logreport(self, report):
    if report.outcome != "rerun":
      self.awaiting.discard(report.nodeid)

  def pytest_unconfigure(self, config):
    shutil.rmtree(os.environ.pop(TIMED_OUT_DIR, ""), ignore_errors=True)

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session):
    if self.awaiting and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter):
    if not self.crashes:
      return
    terminalreporter.section("tests that crashed their worker (native crash; output above)")
    for nodeid, n in sorted(self.crashes.items()):
      if nodeid in self.timed_out:
        verdict = "failed: stopped by pytest-timeout (stacks below), not rerun"
      elif nodeid in self.awaiting:
        verdict = "FAILED: rescheduled, but never ran again (no worker restart left?)"
      elif n <= self.max_reruns:
        verdict = "rerun (its result is reported with the others)"
      else:
        verdict = "failed (no rerun left)"
      terminalreporter.write_line(f"{nodeid}: crashed {n} time(s), {verdict}")
    for nodeid, stacks in sorted(self.timed_out.items()):
      terminalreporter.section(f"stacks of {nodeid} at its timeout", sep="-")
      terminalreporter.write(stacks)


def register(config, max_reruns: int = 1) -> None:
  """Registers :class:`CrashRerun` from a ``pytest_configure``: on the xdist controller only
  (workers carry ``workerinput``), and only where pytest-xdist is installed; on the workers,
  :class:`TimeoutMarker` where pytest-timeout is installed."""
  if hasattr(config, "workerinput"):
    if config.pluginmanager.hasplugin("timeout"):
      config.pluginmanager.register(TimeoutMarker(), "mfopt-timeout-marker")
  elif config.pluginmanager.hasplugin("xdist"):
    # (the workers start after pytest_configure, with this environment)
    os.environ[TIMED_OUT_DIR] = tempfile.mkdtemp(prefix="mfopt-timed-out-")
    config.pluginmanager.register(CrashRerun(max_reruns=max_reruns), "mfopt-crash-rerun")
