"""experiments/bench_tables.py: BENCHMARKS.md rows from benchmark JSON (issue 8)."""

import json
import os
import subprocess

import pytest

from experiments import _bench, bench_comm, bench_tables

RESULT = {
    "bench": "bench_update",
    "env": {"date_utc": "2026-11-23 06:27 UTC", "jax": "0.11.0", "backend": "gpu",
            "device_kind": "NVIDIA H100 80GB HBM3", "num_devices": 1, "commit": "abc1234"},
    "command": "python -m experiments.bench_update --only periodic",
    "quick": False,
    "figures": [{"note": "harness: donated, 3 warm-up calls"},
                {"name": "flat | mf_sgd / optax.sgd", "value": 1.0123, "unit": "x time",
                 "details": "a|b"}],
    "targets": [
        {"name": "update cost flat mf_sgd", "value": 1.0123, "op": "<=", "threshold": 1.03,
         "applies": True, "passed": True},
        {"name": "target 3 | flat", "value": 1.05, "op": "<=", "threshold": 1.01,
         "applies": True, "passed": False},
        {"name": "counter check", "value": 0.0, "op": ">=", "threshold": 1.0,
         "applies": False, "passed": None}],
    "passed": False,
}


def test_section_states_device_command_commit_and_every_verdict():
  text = bench_tables.section(RESULT, figures=True)
  assert text.startswith("#### bench_update on gpu (NVIDIA H100 80GB HBM3 x1), JAX 0.11.0, "
                         "2026-11-23 06:27 UTC\n")
  assert "Command: `python -m experiments.bench_update --only periodic`; commit abc1234." in text
  assert "* harness: donated, 3 warm-up calls" in text
  assert "| update cost flat mf_sgd | 1.0123 | <= 1.03 | **PASS** |" in text
  assert "| target 3 \\| flat | 1.0500 | <= 1.01 | **FAIL** |" in text  # pipe escaped
  assert "| counter check | 0.0000 | >= 1.0 | not judged |" in text
  assert "Result: 1/2 targets met." in text
  assert "| flat \\| mf_sgd / optax.sgd | 1.012 x time | a\\|b |" in text
  assert "--quick" not in text
  assert "| figure |" not in bench_tables.section(RESULT)


def test_quick_runs_are_labelled():
  text = bench_tables.section({**RESULT, "quick": True})
  assert "[--quick: CI sizes, timings meaningless]" in text.splitlines()[0]


def test_runs_cut_off_before_their_verdict_are_labelled():
  """A JSON written mid-run (complete: false) is labelled so; a finished one, or one from
  before the key existed, is not."""
  assert "[cut off: partial run, no final verdict]" in bench_tables.section(
      {**RESULT, "complete": False}).splitlines()[0]
  for result in (RESULT, {**RESULT, "complete": True}):
    assert "cut off" not in bench_tables.section(result)


def test_a_real_quick_run_round_trips(tmp_path):
  """bench_comm --quick writes JSON with its command and commit; the table lists its targets."""
  path = tmp_path / "bench_comm.json"
  result = bench_comm.main(["--quick", "--json", str(path)])
  assert result["command"] == f"python -m experiments.bench_comm --quick --json {path}"
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  if head.returncode == 0:  # a git checkout (CI clones one)
    assert result["env"]["commit"].split("+")[0] == head.stdout.strip()
  text = bench_tables.main([str(tmp_path)])
  assert json.loads(path.read_text())["bench"] == "bench_comm"
  for t in result["targets"]:
    assert f"| {bench_tables._cell(t['name'])} | {t['value']:.4f} |" in text
  assert f"Command: `{result['command']}`" in text


def test_commit_from_the_environment_where_there_is_no_repository(monkeypatch):
  monkeypatch.setenv("MFOPT_COMMIT", "feedbee")
  assert _bench.source_commit() == "feedbee"


def test_bad_paths_are_named(tmp_path):
  with pytest.raises(SystemExit, match="no such file or folder: '/nonexistent.json'"):
    bench_tables.main(["/nonexistent.json"])
  with pytest.raises(SystemExit, match="no JSON file"):
    bench_tables.main([str(tmp_path)])
  bad = tmp_path / "x.json"
  bad.write_text('{"figures": []}')
  with pytest.raises(SystemExit, match="not a benchmark result"):
    bench_tables.main([str(bad)])


def test_a_folders_files_come_in_call_order(tmp_path):
  """gpu_plan's call 10 sorted before call 2 as strings."""
  for name in ("10_abc_bench_update.json", "2_abc_bench_update.json", "1_abc_bench_x.json"):
    (tmp_path / name).write_text("{}")
  assert [os.path.basename(f) for f in bench_tables.json_files([str(tmp_path)])] == [
      "1_abc_bench_x.json", "2_abc_bench_update.json", "10_abc_bench_update.json"]
