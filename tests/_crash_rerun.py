"""Reruns a test once when it kills its pytest-xdist worker (a native crash), and says so.

CI on 2026-11-24 (commit 31e5d21) lost a whole run to one crash: the worker running
``tests/test_readme.py`` died inside XLA's CPU executable call (``Compiled.__call__`` in
``train.fit``, a fatal signal caught by faulthandler) after 823 other tests had passed. The
same test passed 30 times in a row here (15 with a fresh compilation cache, 15 warm, two at a
time) and in every earlier CI run; the crash's cause was not found (CI showed only the tail of
the worker's output).

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


class CrashRerun:
  """A pytest plugin (register it on the xdist controller): see the module docstring."""

  def __init__(self, max_reruns: int = 1):
    self.max_reruns = max_reruns
    self.crashes: collections.Counter[str] = collections.Counter()

  def pytest_handlecrashitem(self, crashitem, report, sched):
    self.crashes[crashitem] += 1
    if self.crashes[crashitem] <= self.max_reruns:
      sched.mark_test_pending(crashitem)
      report.outcome = "rerun"

  def pytest_terminal_summary(self, terminalreporter):
    if not self.crashes:
      return
    terminalreporter.section("tests that crashed their worker (native crash; output above)")
    for nodeid, n in sorted(self.crashes.items()):
      verdict = "rerun" if n <= self.max_reruns else "failed (no rerun left)"
      terminalreporter.write_line(f"{nodeid}: crashed {n} time(s), {verdict}")
