"""One --quick smoke run per seed 001/003 experiment; each asserts the table's content."""

import json

import numpy as np

from mfopt import runner


def _run(name, tmp_path):
  summary = runner.run_experiment(name, quick=True, workdir=tmp_path)
  report = (tmp_path / "report.md").read_text()
  return summary, report


def test_adpsgd_variance_quick(tmp_path):
  summary, report = _run("adpsgd_variance", tmp_path)
  algos = [r["algorithm"] for r in summary["rows"]]
  assert algos == ["CPSGD p=2", "CPSGD p=4", "CPSGD p=5", "CPSGD p=8", "ADPSGD"]
  syncs = {r["algorithm"]: float(r["syncs"].split(" ")[0]) for r in summary["rows"]}
  assert [syncs[f"CPSGD p={p}"] for p in (2, 4, 5, 8)] == [12, 6, 4, 3]  # floor(24 / p)
  trace = json.loads((tmp_path / "trace_CPSGD_p8_seed0.json").read_text())
  assert trace["step"] == [8, 16, 24] and trace["period"] == [8, 8, 8]
  assert all(v > 0 for v in trace["mean_variance"])
  for fig in ("fig1_cpsgd_vt.png", "fig2_adpsgd_vt.png", "fig3_adpsgd_period.png"):
    assert (tmp_path / fig).stat().st_size > 1000
  assert "eq. (9)" in report and "not reproduced at this scale" in report  # one seed


def test_adpsgd_table_quick(tmp_path):
  summary, report = _run("adpsgd_table", tmp_path)
  names = [r["algorithm"].replace(" (best)", "") for r in summary["rows"]]
  assert names == ["SMALL_BATCH lr=0.1", "ADPSGD", "CPSGD p=8", "FULLSGD lr=0.1", "DECREASING 4->2",
                   "QSGD-8bit"]
  runs = json.loads((tmp_path / "runs.json").read_text())
  full, q, small = runs["FULLSGD lr=0.1"][0], runs["QSGD-8bit"][0], runs["SMALL_BATCH lr=0.1"][0]
  assert full["collectives"] == 16 and q["collectives"] == 16 and small["collectives"] == 0
  assert small["steps"] == 16 * 8
  assert 0.25 < q["payload_bytes"] / full["payload_bytes"] < 0.27
  assert runs["CPSGD p=8"][0]["param_syncs"] == 2
  assert runs["DECREASING 4->2"][0]["param_syncs"] == 8 // 4 + 8 // 2
  ratios = [float(r["ratio"]) for r in summary["crossover"]]
  assert ratios[0] < 1 < ratios[-1] and ratios == sorted(ratios)
  assert "projected" in report and "Table I" in report


def test_block_momentum_table_quick(tmp_path):
  summary, report = _run("block_momentum_table", tmp_path)
  assert [r["model"] for r in summary["rows"]] == ["digits/mlp", "mnist1d/mlp"]
  runs = json.loads((tmp_path / "runs.json").read_text())
  for pair in runs.values():
    k, m = pair["test_accuracy"]["K-AVG"][0], pair["test_accuracy"]["M-AVG"][0]
    assert 0 < k <= 1 and 0 < m <= 1 and k != m  # momentum changed the trajectory
  assert "KAVG acc %" in report


def test_block_momentum_mu_vs_p_quick(tmp_path):
  summary, report = _run("block_momentum_mu_vs_p", tmp_path)
  assert [r["P"] for r in summary["rows"]] == [6, 12]
  assert [r["steps"] for r in summary["rows"]] == [16, 8]  # equal samples S / (P B)
  acc = json.loads((tmp_path / "accuracy.json").read_text())
  assert set(acc) == {"P=6,mu=0.0", "P=6,mu=0.9", "P=12,mu=0.0", "P=12,mu=0.9"}
  assert summary["constants"]["L"] > 0 and summary["constants"]["sigma2"] > 0
  assert np.isfinite(float(summary["best"][0]["theory_valid"]))
