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
"""

from __future__ import annotations

import collections

import pytest


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

  def pytest_handlecrashitem(self, crashitem, report, sched):
    self.crashes[crashitem] += 1
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

  @pytest.hookimpl(trylast=True)
  def pytest_sessionfinish(self, session):
    if self.awaiting and session.exitstatus == pytest.ExitCode.OK:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED

  def pytest_terminal_summary(self, terminalreporter):
    if not self.crashes:
      return
    terminalreporter.section("tests that crashed their worker (native crash; output above)")
    for nodeid, n in sorted(self.crashes.items()):
      if nodeid in self.awaiting:
        verdict = "FAILED: rescheduled, but never ran again (no worker restart left?)"
      elif n <= self.max_reruns:
        verdict = "rerun (its result is reported with the others)"
      else:
        verdict = "failed (no rerun left)"
      terminalreporter.write_line(f"{nodeid}: crashed {n} time(s), {verdict}")


def register(config, max_reruns: int = 1) -> None:
  """Registers :class:`CrashRerun` from a ``pytest_configure``: on the xdist controller only
  (workers carry ``workerinput``), and only where pytest-xdist is installed."""
  if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist"):
    config.pluginmanager.register(CrashRerun(max_reruns=max_reruns), "mfopt-crash-rerun")
