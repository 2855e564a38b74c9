"""--quick smoke runs of the seed 004 experiments, checking what their reports must contain."""

import json

import pytest

from mfopt import runner

# Smaller than --quick where it keeps CI inside its budget; the content checked is the same.
TINY = ["num_train=512", "num_test=128", "features=(4,)", "num_workers=4", "epochs=1",
        "warmup_epochs=1"]


def _runs(workdir):
  return json.loads((workdir / "runs.json").read_text())


def test_hybrid_vs_baselines_quick(tmp_path):
  out = runner.run_experiment("hybrid_vs_baselines", quick=True, workdir=tmp_path,
                              overrides=TINY + ["algorithms=hybrid,warmup_sgd"])
  text = (tmp_path / "report.md").read_text()
  for needle in ("AdaBound warmup + LARS SGD (hybrid)", "gradual warmup + linear-scaling SGD",
                 "projected", "samples/s/worker (measured, CPU)", "## Paper claims"):
    assert needle in text
  runs = _runs(tmp_path)
  for algo in ("hybrid", "warmup_sgd"):
    r = runs[algo][0]
    steps = r["summary"]["steps"]
    assert r["summary"]["all_reduces"] == steps  # synchronous: one all-reduce per step
    assert 0 < r["efficiency"]["scaling_efficiency"] < 1
    assert r["history"][-1]["epoch"] == pytest.approx(steps * 64 / 512)
  assert len(out["verdicts"]) == 2 and (tmp_path / "accuracy.png").exists()


def test_hybrid_warmup_T_quick(tmp_path):
  runner.run_experiment("hybrid_warmup_T", quick=True, workdir=tmp_path,
                        overrides=TINY[:4] + ["epochs=2", "warmup_values=(1,2)"])
  text = (tmp_path / "report.md").read_text()
  assert "| 1 |" in text and "| 2 |" in text
  runs = _runs(tmp_path)
  # Same seed, data, init and samples; T changes the bounds and the switch, hence the path.
  h1, h2 = runs["1"][0]["history"], runs["2"][0]["history"]
  assert [h["samples"] for h in h1] == [h["samples"] for h in h2] and len(h1) == 2
  assert h1[1]["train_loss"] != pytest.approx(h2[1]["train_loss"], rel=1e-6)


def test_precision_quick(tmp_path):
  out = runner.run_experiment("precision", quick=True, workdir=tmp_path, overrides=TINY)
  text = (tmp_path / "report.md").read_text()
  assert "measured" in text and "CPU" in text and "fp16" in text
  rows = {r["policy"]: r for r in out["rows"]}
  # The fp16 gradient all-reduce exchanges exactly half the bytes of the fp32 one.
  assert rows["fp16"]["bytes"] * 2 == rows["fp32"]["bytes"] > 0
  runs = _runs(tmp_path)
  fp16 = runs["fp16@16"][0]["history"][-1]
  assert fp16["train_loss_scale"] > 0 and 0 <= fp16["train_overflow"] <= 1


def test_bn_strategies_quick(tmp_path):
  out = runner.run_experiment("bn_strategies", quick=True, workdir=tmp_path, overrides=TINY)
  text = (tmp_path / "report.md").read_text()
  assert "without moving average" in text and "✓" in text and "×" in text
  runs = _runs(tmp_path)
  fixed, varying = runs["independent_last"][0], runs["varying_sync_ma"][0]
  # Equal samples (the varying row runs until it has seen as many examples).
  assert varying["summary"]["samples"] >= fixed["summary"]["samples"]
  # Synchronised BN: its all-reduces (fwd + bwd per BN layer per step) are in the projection.
  steps = varying["summary"]["steps"]
  assert varying["summary"]["all_reduces"] == steps + 2 * steps * 1
  assert varying["efficiency"]["scaling_efficiency"] < 1
  assert out["target"] > 0


def test_seed004_metrics_closed_forms():
  """mfopt.metrics against the seed's own arithmetic (§1, §3.2.2, Table 3.8)."""
  from mfopt import metrics
  # §3.2.2: 24 V100s, actual/ideal speed = 36082/37008 = 97.5 %; as 1/(1+comm/compute):
  eff = metrics.scaling_efficiency(compute_s=1.0, comm_s=37008 / 36082 - 1)
  assert eff == pytest.approx(36082 / 37008, rel=1e-12)
  # Actual average single-GPU time = epochs * samples/epoch / (speed * efficiency); 24 GPUs share it.
  t1 = metrics.actual_single_gpu_time(32, 1_281_167, 1542.0, 0.975)
  assert t1 == pytest.approx(32 * 1_281_167 / (1542.0 * 0.975), rel=1e-12)
  assert metrics.actual_single_gpu_time(None, 100, 1.0, 1.0) == float("inf")
  history = [{"epoch": 1.0, "test_accuracy": 0.5}, {"epoch": 2.0}, {"epoch": 3.0, "test_accuracy": 0.8}]
  assert metrics.epochs_to_target(history, 0.75) == 3.0
  assert metrics.epochs_to_target(history, 0.9) is None
  summary = {"num_workers": 8, "train_s": 16.0, "samples": 8 * 1000, "all_reduces": 10,
             "all_reduce_bytes": 10 * 4_000_000}
  rep = metrics.efficiency_report(summary=summary, history=history, target=0.75,
                                  samples_per_epoch=1000, num_devices=1, net="10gbit")
  comm = 10 * (2 * 7 / 8 * 4_000_000 / (10e9 / 8) + 2 * 7 * 20e-6)  # ring all-reduce, SPEC.md
  assert rep["compute_s"] == 2.0 and rep["comm_s"] == pytest.approx(comm, rel=1e-9)
  assert rep["scaling_efficiency"] == pytest.approx(1 / (1 + comm / 2.0), rel=1e-9)
  assert rep["efficiency_source"].startswith("projected")
  assert rep["actual_single_gpu_time_s"] == pytest.approx(3 * 1000 / (500.0 * rep["scaling_efficiency"]))
  with pytest.raises(ValueError, match="compute_s"):
    metrics.scaling_efficiency(0.0, 1.0)
