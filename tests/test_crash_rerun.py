"""The CI's crash rerun (tests/_crash_rerun.py): a test that kills its xdist worker once runs
again and passes; one that kills it every time, or fails an assertion, still fails the run."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import _crash_rerun

def pytest_configure(config):
  _crash_rerun.register(config)
"""

TESTS_PY = """
import os, pathlib

def test_crashes_once(tmp_path_factory):
  marker = pathlib.Path(os.environ["MARK_DIR"]) / "crashed_once"
  if not marker.exists():
    marker.touch()
    os.abort()

def test_crashes_always():
  if os.environ.get("ALWAYS") == "1":
    os.abort()

def test_fails_normally():
  assert os.environ.get("FAIL") != "1"
"""


def _run(tmp_path, *args, **env):
  (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
  (tmp_path / "test_inner.py").write_text(textwrap.dedent(TESTS_PY))
  mark = tmp_path / "marks"
  mark.mkdir(exist_ok=True)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-q", "-rA",
       *args, "test_inner.py"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      env={"PATH": "/usr/bin:/bin", "MARK_DIR": str(mark), **env})
  return proc.returncode, proc.stdout + proc.stderr


def test_a_test_that_crashes_its_worker_once_reruns_and_passes(tmp_path):
  rc, out = _run(tmp_path)
  assert rc == 0, out
  assert "3 passed" in out and "1 rerun" in out, out
  assert "test_inner.py::test_crashes_once: crashed 1 time(s), rerun" in out, out


def test_a_test_that_crashes_twice_or_fails_still_fails_the_run(tmp_path):
  rc, out = _run(tmp_path, ALWAYS="1", FAIL="1")
  assert rc == 1, out
  assert "FAILED test_inner.py::test_crashes_always" in out, out
  assert "FAILED test_inner.py::test_fails_normally" in out, out
  assert "test_inner.py::test_crashes_always: crashed 2 time(s), failed (no rerun left)" in out, out


def test_a_rescheduled_test_that_never_runs_again_fails_the_run(tmp_path):
  """With no worker restart left, xdist stops before the rescheduled test runs: the crash
  must not pass as a "rerun" (the reviewer's case: exit code 0 before this check)."""
  rc, out = _run(tmp_path, "--max-worker-restart=0")
  assert rc == 1, out
  assert ("test_inner.py::test_crashes_once: crashed 1 time(s), FAILED: rescheduled, but never "
          "ran again") in out, out


@pytest.mark.parametrize("dist", ["loadfile", "loadscope"])
def test_a_scheduler_that_cannot_reschedule_keeps_the_crash_a_failure(tmp_path, dist):
  rc, out = _run(tmp_path, "--dist", dist)
  assert rc == 1 and "INTERNALERROR" not in out, out
  assert "FAILED test_inner.py::test_crashes_once" in out, out


def test_the_suites_conftest_registers_the_plugin_on_the_controller_only():
  """tests/conftest.py's pytest_configure wires _crash_rerun.register in: the plugin goes on
  the xdist controller, not on a worker (which has ``workerinput``), not without xdist."""
  import types

  import _crash_rerun
  import conftest

  def fake_config(worker: bool, xdist: bool):
    registered = []
    manager = types.SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist",
                                    register=lambda plugin, name: registered.append(plugin))
    config = types.SimpleNamespace(pluginmanager=manager)
    if worker:
      config.workerinput = {}
    return config, registered

  for worker, xdist, want in ((False, True, 1), (True, True, 0), (False, False, 0)):
    config, registered = fake_config(worker, xdist)
    conftest.pytest_configure(config)
    assert len(registered) == want and all(isinstance(p, _crash_rerun.CrashRerun)
                                           for p in registered)


HANGS_PY = """
import os, pathlib, time

def test_hangs():
  runs = pathlib.Path(os.environ["MARK_DIR"]) / "runs"
  runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
  time.sleep(60)

def test_passes():
  pass
"""


def test_a_test_stopped_by_the_timeout_fails_once_with_its_stack_and_is_not_rerun(tmp_path):
  """pytest-timeout's thread method (the one that also stops a hang inside XLA) exits the
  worker like a native crash; rerunning the test would hang again for another timeout, so the
  marked test fails at once, with the stack of the hung line and the reason in the summary."""
  (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
  (tmp_path / "test_hang.py").write_text(textwrap.dedent(HANGS_PY))
  mark = tmp_path / "marks"
  mark.mkdir()
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-q", "-rA",
       "-o", "timeout=2", "-o", "timeout_method=thread", "test_hang.py"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      env={"PATH": "/usr/bin:/bin", "MARK_DIR": str(mark)})
  out = proc.stdout + proc.stderr
  assert proc.returncode == 1, out
  assert (mark / "runs").read_text() == "x", out  # ran once
  assert "in test_hangs\n    time.sleep(60)" in out, out  # the hung line's stack
  assert ("test_hang.py::test_hangs: crashed 1 time(s), failed: stopped by pytest-timeout "
          "(stacks below), not rerun") in out, out
  assert "1 passed" in out, out
