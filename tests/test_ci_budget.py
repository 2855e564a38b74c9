"""The CI budget categories of tests/conftest.py's summary (unit, --quick smoke runs,
notebooks, multi-process): every test file lands in the category its contents belong to."""

import pathlib

from conftest import budget_category

TESTS = pathlib.Path(__file__).resolve().parent


def test_files_map_to_their_budget_category():
  assert budget_category("tests/test_notebooks.py::test_notebook_executes[mf]") == "notebooks"
  assert budget_category("tests/test_multiprocess.py::test_two_processes") == "multi-process"
  assert budget_category("tests/test_experiments_mf.py::test_mf_mlp_quick") == "--quick smoke runs"
  assert budget_category("tests/test_bench_quick.py::test_parse_option") == "--quick smoke runs"
  assert budget_category("tests/test_profile_step.py::test_profile_step_quick_cpu") == \
      "--quick smoke runs"
  assert budget_category("tests/test_mf.py::test_mf_sgd_matches_optax") == "unit"
  # the files named above exist (a rename would silently move their time to "unit")
  for name in ("test_notebooks.py", "test_multiprocess.py", "test_bench_quick.py"):
    assert (TESTS / name).is_file(), name
  assert list(TESTS.glob("test_experiments_*.py"))
