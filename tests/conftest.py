"""Test setup: 8 fake CPU devices and a persistent compilation cache, before JAX initialises.

Multi-device code is tested on fake CPU devices (ARCHITECTURE.md). The device
count must be set before any JAX backend starts, and XLA_FLAGS is never
overwritten after import, so it is done here, at collection time.
"""

import os
import pathlib
import tempfile

import jax
import pytest

NUM_DEVICES = 8
os.environ.pop("MFOPT_LOWERING", None)  # tests pick their lowering explicitly (fit default: vmap)
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
jax.config.update("jax_platforms", "cpu")

from mfopt.runner import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE")
                         or pathlib.Path(__file__).resolve().parents[1] / ".jax_cache")


@pytest.fixture(autouse=True, scope="session")
def _tempfiles_under_basetemp(tmp_path_factory):
  """TFDS's ``DatasetInfo.initialize_from_bucket`` makes a ``tempfile.mkdtemp("tfds")``
  directory and never removes it, for every builder of a dataset that is not prepared: one
  run of test_data.py left 37 empty ``/tmp/tmp*tfds`` directories. In-process temporary files
  go under pytest's basetemp instead (which keeps the last three runs)."""
  old = tempfile.tempdir
  tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
  yield
  tempfile.tempdir = old


# The CI budgets (the project's rules, wall-clock on the 2-core CI machine) per category of
# test. The summary below sums each category's test time (setup + call + teardown) so a run
# shows where it stands; it fails nothing (timings on shared machines vary).
CI_BUDGETS_S = {"unit": 8 * 60, "--quick smoke runs": 6 * 60, "notebooks": 4 * 60,
                "multi-process": 2 * 60}


def budget_category(nodeid: str) -> str:
  """The CI budget category of a test id: by file, and ``quick`` in a test's name marks a
  ``--quick`` smoke run in a mixed file."""
  path, _, name = nodeid.partition("::")
  file = path.rsplit("/", 1)[-1]
  if file == "test_notebooks.py":
    return "notebooks"
  if file == "test_multiprocess.py":
    return "multi-process"
  if file.startswith("test_experiments_") or file == "test_bench_quick.py" or "quick" in name:
    return "--quick smoke runs"
  return "unit"


def pytest_configure(config):
  # a test whose xdist worker dies (a native crash) runs once more
  import _crash_rerun  # noqa: PLC0415 (tests/ is on sys.path: no __init__.py)
  _crash_rerun.register(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  import collections
  seconds, tests = collections.Counter(), collections.Counter()
  for reports in terminalreporter.stats.values():
    for r in reports:
      if getattr(r, "when", None) in ("setup", "call", "teardown") and hasattr(r, "duration"):
        seconds[budget_category(r.nodeid)] += r.duration
        tests[budget_category(r.nodeid)] += r.when == "call"
  if not tests:
    return
  try:
    workers = max(int(getattr(config.option, "numprocesses", None) or 1), 1)
  except (TypeError, ValueError):  # -n auto / logical
    workers = os.cpu_count() or 1
  terminalreporter.section("test time per CI budget category")
  for name, budget in CI_BUDGETS_S.items():
    terminalreporter.write_line(
        f"{name}: {tests[name]} tests, {seconds[name]:.0f} s of test time, "
        f"~{seconds[name] / workers:.0f} s wall on {workers} worker(s) if spread evenly "
        f"(budget {budget // 60} min wall-clock)")
