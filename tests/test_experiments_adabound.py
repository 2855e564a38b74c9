"""--quick smoke runs of the seed 004 experiments, checking what their reports must contain."""

import json

import numpy as np
import pytest

from mfopt import runner

# Smaller than --quick where it keeps CI inside its budget; the content checked is the same.
TINY = ["num_train=512", "num_test=128", "features=(4,)", "num_workers=4", "epochs=1",
        "warmup_epochs=0.5"]


def _runs(workdir):
  return json.loads((workdir / "runs.json").read_text())


def test_hybrid_vs_baselines_quick(tmp_path):
  out = runner.run_experiment("hybrid_vs_baselines", quick=True, workdir=tmp_path,
                              overrides=TINY + ["algorithms=hybrid,warmup_sgd"])
  text = (tmp_path / "report.md").read_text()
  for needle in ("AdaBound warmup + LARS SGD (hybrid)", "gradual warmup + linear-scaling SGD",
                 "projected", "samples/s per device (measured, CPU; one worker timed alone",
                 "## Paper claims"):
    assert needle in text
  runs = _runs(tmp_path)
  for algo in ("hybrid", "warmup_sgd"):
    r = runs[algo][0]
    steps = r["summary"]["steps"]
    assert r["summary"]["all_reduces"] == steps  # synchronous: one all-reduce per step
    assert 0 < r["efficiency"]["scaling_efficiency"] < 1
    assert r["history"][-1]["epoch"] == pytest.approx(steps * 64 / 512)
    # compute = steps x one worker's step timed alone (the vmap-batched run's train_s / W
    # made one worker look about twice as fast as it is on 2 cores)
    assert r["efficiency"]["speed_source"].startswith("measured (one worker's step alone")
    assert r["efficiency"]["single_device_speed"] == pytest.approx(
        r["summary"]["per_worker_batch"] * steps / r["efficiency"]["compute_s"])
  assert len(out["verdicts"]) == 2 and (tmp_path / "accuracy.png").exists()


def test_hybrid_warmup_T_quick(tmp_path):
  # T given in descending order: the claims still compare the smallest T with the largest
  # (they compared warmup_values[0] with [-1], testing every claim the wrong way round)
  out = runner.run_experiment("hybrid_warmup_T", quick=True, workdir=tmp_path,
                              overrides=TINY[:4] + ["epochs=2", "warmup_values=(1,0.5)"])
  test = out["final_test_accuracy"]
  v = out["verdicts"]
  assert "T=0.5 vs T=1" in v[1]["claim"] and "T=1 vs T=0.5" in v[2]["claim"]
  assert v[1]["claim"].startswith("not a seed claim")  # (the seed: "T has little effect")
  assert v[1]["mean_diff"] == pytest.approx(test[0.5][0] - test[1.0][0])  # T=0.5 - T=1
  text = (tmp_path / "report.md").read_text()
  assert "| 0.5 |" in text and "| 1 |" in text
  runs = _runs(tmp_path)
  # Same seed, data, init and samples; T changes the bounds and the switch, hence the path.
  h1, h2 = runs["0.5"][0]["history"], runs["1"][0]["history"]
  assert [h["samples"] for h in h1] == [h["samples"] for h in h2] and len(h1) == 2
  assert h1[1]["train_loss"] != pytest.approx(h2[1]["train_loss"], rel=1e-6)


def test_precision_quick(tmp_path, monkeypatch):
  from experiments import _seed004_common as common
  built = []
  make_tx = common.make_tx

  def spy_tx(*a, **kw):
    built.append(kw["steps_per_epoch"])
    return make_tx(*a, **kw)

  monkeypatch.setattr(common, "make_tx", spy_tx)
  out = runner.run_experiment("precision", quick=True, workdir=tmp_path, overrides=TINY)
  # the throughput benchmark built both of the hybrid's phases for each (policy, batch)
  bench = [spe for spe in built if spe in (1, 10 ** 6)]
  assert sorted(set(bench)) == [1, 10 ** 6] and len(bench) == 2 * 2  # 2 policies, 1 batch
  text = (tmp_path / "report.md").read_text()
  assert "measured" in text and "CPU" in text and "fp16" in text
  rows = {r["policy"]: r for r in out["rows"]}
  # The fp16 gradient all-reduce exchanges exactly half the bytes of the fp32 one.
  assert rows["fp16"]["bytes"] * 2 == rows["fp32"]["bytes"] > 0
  runs = _runs(tmp_path)
  fp16 = runs["fp16@16"][0]["history"][-1]
  assert fp16["train_loss_scale"] > 0 and 0 <= fp16["train_overflow"] <= 1


def test_bn_strategies_counts_every_seed_that_did_not_diverge():
  """Row 1's all-reduces and samples differ by seed: the cell shows every seed's count unless
  all agree (whichever seed differs), and a diverged seed (nan counters) is left out."""
  from experiments import bn_strategies
  ok = lambda n: {"summary": {"all_reduces": n, "samples": 10 * n}}  # noqa: E731
  bad = {"summary": {"all_reduces": float("nan"), "samples": float("nan")}, "diverged": True}
  rs = [ok(5), bad, ok(6), ok(5)]
  assert bn_strategies._over_seeds(rs, "all_reduces") == [5, 6, 5]
  assert bn_strategies._over_seeds(rs, "samples") == [50, 60, 50]
  assert bn_strategies._counts([5, 6, 5]) == "5-6 (by seed: 5/6/5)"
  assert bn_strategies._over_seeds([bad], "samples") == []


def test_bn_strategies_quick(tmp_path, monkeypatch):
  """The report's content, equal samples, BN's all-reduces; and row 1's data stream. Row 1
  draws per-worker batches of B/2, B or 3B/2; it used to cut them from a 3B/2 batch,
  discarding the rest, so some examples went unseen in an epoch and others were seen twice
  where the fixed rows see each once. It now reads consecutive B/2 pieces of the epoch order."""
  import types

  from experiments import bn_strategies
  from mfopt import data as data_lib
  reads = []

  class Recording(data_lib.WorkerBatcher):  # (row 1's batcher only: fit's is not replaced)
    def batch(self, step, workers=None):
      reads.append((self.per_worker_batch, self.indices(step)))
      return super().batch(step, workers)

  monkeypatch.setattr(bn_strategies, "data_lib",
                      types.SimpleNamespace(**{**vars(data_lib), "WorkerBatcher": Recording}))
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
  assert (f"reaches the others' budget: {varying['summary']['samples']:,} vs "
          f"{fixed['summary']['samples']:,} samples)") in text
  # row 1's samples and all-reduces differ by seed (its batch draws): every seed is shown
  assert bn_strategies._counts([2048, 2048, 2176]) == "2,048-2,176 (by seed: 2,048/2,048/2,176)"
  assert bn_strategies._counts([57, 57]) == "57" and bn_strategies._counts([]) == "n/a (diverged)"
  assert varying["efficiency"]["scaling_efficiency"] < 1
  assert out["target"] > 0
  half = bn_strategies.get_config(quick=True).per_worker_batch // 2
  assert {b for b, _ in reads} == {half}
  trained = [idx.ravel() for _, idx in reads[2:]]  # (after the init and compile probes)
  assert sum(map(len, trained)) == varying["summary"]["samples"]
  per_epoch = 512 // (4 * half)  # B/2 pieces in an epoch (TINY: 512 examples, 4 workers)
  seen = np.concatenate(trained[:per_epoch])
  assert len(seen) == len(np.unique(seen)) == per_epoch * 4 * half  # each example once


def test_bn_strategies_varying_row_resumes_and_skips_when_finished(tmp_path, monkeypatch):
  """Row 1's own training loop checkpoints like train.fit: cut back to its first epoch it
  resumes to the uninterrupted result, and once finished it is not trained again (it used to
  be retrained from scratch on every resume)."""
  import shutil

  from mfopt import train
  over = TINY[:4] + ["epochs=2", "warmup_epochs=1"]
  kw = dict(quick=True, workdir=tmp_path, overrides=over, checkpoint_every=1, keep_checkpoints=3)
  runner.run_experiment("bn_strategies", **kw)
  first = _runs(tmp_path)["varying_sync_ma"][0]
  (varying,) = (tmp_path / "checkpoints").glob("varying-*")
  steps = sorted(int(p.name) for p in varying.iterdir() if p.name.isdigit())
  assert len(steps) == 2  # one per epoch
  shutil.rmtree(varying / str(steps[-1]))  # interrupted during the second epoch
  resumed = runner.run_experiment("bn_strategies", **kw)
  again = _runs(tmp_path)["varying_sync_ma"][0]
  strip = lambda r: {k: v for k, v in r["summary"].items() if k != "train_s"}  # noqa: E731
  assert strip(again) == strip(first) and again["history"] == first["history"]
  assert len(first["history"]) == 2

  real = train.make_train_step

  def no_training(*args, num_workers, **kwargs):
    if num_workers != 1:  # (W = 1: the projections' one-worker step timing, redone per attempt)
      raise AssertionError("a finished run was trained again")
    return real(*args, num_workers=num_workers, **kwargs)

  monkeypatch.setattr(train, "make_train_step", no_training)
  assert runner.run_experiment("bn_strategies", **kw)["target"] == resumed["target"]


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
  assert metrics.epochs_to_target(history, history[-1]["test_accuracy"]) == 3.0  # >=: reached
  summary = {"num_workers": 8, "train_s": 16.0, "samples": 8 * 1000, "all_reduces": 10,
             "all_reduce_bytes": 10 * 4_000_000}
  rep = metrics.efficiency_report(summary=summary, history=history, target=0.75,
                                  samples_per_epoch=1000, num_devices=1, net="10gbit")
  comm = 10 * (2 * 7 / 8 * 4_000_000 / (10e9 / 8) + 2 * 7 * 20e-6)  # ring all-reduce, SPEC.md
  assert rep["compute_s"] == 2.0 and rep["comm_s"] == pytest.approx(comm, rel=1e-9)
  assert rep["scaling_efficiency"] == pytest.approx(1 / (1 + comm / 2.0), rel=1e-9)
  assert rep["efficiency_source"].startswith("projected")
  assert rep["speed_source"].startswith("derived")
  # with one worker's step timed alone: compute = steps x its time (summary steps: 1000 / 8 / 1)
  timed = metrics.efficiency_report(summary={**summary, "steps": 125}, history=history,
                                    target=0.75, samples_per_epoch=1000, num_devices=1,
                                    net="10gbit", one_worker_step_s=0.004)
  assert timed["compute_s"] == pytest.approx(0.5) and timed["single_device_speed"] == 2000.0
  assert timed["scaling_efficiency"] == pytest.approx(1 / (1 + comm / 0.5), rel=1e-9)
  assert rep["actual_single_gpu_time_s"] == pytest.approx(3 * 1000 / (500.0 * rep["scaling_efficiency"]))
  # target never reached: convergence rate 1 / inf = 0 and infinite times (seed §1)
  never = metrics.efficiency_report(summary=summary, history=history, target=0.9,
                                    samples_per_epoch=1000, num_devices=1, net="10gbit")
  assert never["epochs_to_target"] is None and never["convergence_rate"] == 0.0
  assert never["actual_single_gpu_time_s"] == never["actual_training_time_s"] == float("inf")
  # met at epoch 0 (a hand-built history; fit logs from step 1): no time, an infinite rate
  # (it divided by zero)
  at_zero = metrics.efficiency_report(summary=summary, history=[{"epoch": 0.0,
                                                                 "test_accuracy": 0.5}],
                                      target=0.1, samples_per_epoch=1000, num_devices=1,
                                      net="10gbit")
  assert at_zero["epochs_to_target"] == 0.0 and at_zero["convergence_rate"] == float("inf")
  assert at_zero["actual_single_gpu_time_s"] == at_zero["actual_training_time_s"] == 0.0
  with pytest.raises(ValueError, match="compute_s"):
    metrics.scaling_efficiency(0.0, 1.0)


# Divergence is an outcome, not an abort (experiments/_seed004_common.py). base_lr=1000 per
# worker (x4 linear scaling) is a real blow-up at TINY scale, measured on CPU: gradual warmup +
# SGD reaches a non-finite update at step 7 of 8, and so does an fp16 forward (its logits
# overflow), while the hybrid in fp32 ends with a finite (huge) loss.
DIVERGE = ["base_lr=1000"]
NOT_REPRODUCED_1_OF_2 = "not reproduced at this scale (1 of 2 runs diverged)"


def test_hybrid_vs_baselines_diverged_quick(tmp_path):
  out = runner.run_experiment("hybrid_vs_baselines", quick=True, workdir=tmp_path,
                              overrides=TINY + DIVERGE + ["algorithms=hybrid,warmup_sgd"])
  runs = _runs(tmp_path)
  bad, good = runs["warmup_sgd"][0], runs["hybrid"][0]
  assert bad["diverged"] is True and bad["error"].startswith("non-finite ")
  assert 1 <= bad["diverged_at_step"] <= 8 and bad["history"] == []  # 8 steps in all
  assert bad["summary"]["test_accuracy"] == "nan"  # write_json spells nan as a string
  assert bad["efficiency"]["epochs_to_target"] is None  # never reached
  assert good["diverged"] is False and good["summary"]["test_accuracy"] > 0
  text = (tmp_path / "report.md").read_text()
  # Every cell of the diverged method says so; no number from it reaches the table.
  row = next(line for line in text.splitlines()
             if line.startswith("| gradual warmup + linear-scaling SGD |"))
  assert row.count("diverged (1/1)") == 7 and "n/a (diverged)" in row
  assert "## Diverged runs" in text and f"seed 0: {bad['error']}" in text
  assert [v["verdict"] for v in out["verdicts"]] == [NOT_REPRODUCED_1_OF_2] * 2
  assert text.count(f"**{NOT_REPRODUCED_1_OF_2}**") == 2
  assert out["target"] == pytest.approx(0.95 * good["summary"]["test_accuracy"], abs=1e-3)
  assert (tmp_path / "accuracy.png").exists()


def test_precision_diverged_quick(tmp_path):
  # (seed 0: fp16 diverges from base_lr 2000 on, fp32 from 7000, 6000 stays finite; measured
  # 2026-11-25 on 1 and 8 devices: 4000 sits between)
  out = runner.run_experiment("precision", quick=True, workdir=tmp_path,
                              overrides=TINY + ["base_lr=4000"])
  runs = _runs(tmp_path)
  assert runs["fp16@16"][0]["diverged"] and not runs["fp32@16"][0]["diverged"]
  assert runs["fp16@16"][0]["error"].startswith("non-finite loss")
  rows = {r["policy"]: r for r in out["rows"]}
  assert rows["fp16"]["final_test"] == "diverged (1/1)"
  assert rows["fp16"]["bytes"] == "n/a (diverged)"
  assert rows["fp32"]["final_test"][0].isdigit()
  # Not "consistent with the paper": a diverged fp16 run is no evidence of equal accuracy.
  assert [v["verdict"] for v in out["verdicts"]] == [NOT_REPRODUCED_1_OF_2]
  assert f"**{NOT_REPRODUCED_1_OF_2}**" in (tmp_path / "report.md").read_text()


def test_bn_strategies_diverged_quick(tmp_path):
  # Row 1 trains in its own loop (not train.fit): it must apply fit's non-finite guard too.
  # (both rows diverge, well past either's threshold (~6500-7000): a base_lr where only row 1
  # did was a knife edge)
  runner.run_experiment("bn_strategies", quick=True, workdir=tmp_path,
                        overrides=TINY + ["base_lr=20000"])
  runs = _runs(tmp_path)
  varying, fixed = runs["varying_sync_ma"][0], runs["independent_last"][0]
  # (the runner checkpoints it now: the message names its checkpoint directory, as fit's does)
  assert varying["diverged"] and "no checkpoint written in" in varying["error"]
  assert "varying-varying_sync_ma_seed0" in varying["error"]
  assert fixed["diverged"] and "varying" not in fixed["error"]  # (fit's own guard)
  text = (tmp_path / "report.md").read_text()
  assert "| × | × | × | diverged (1/1) |" in text and "varying_sync_ma, seed 0:" in text


def test_hybrid_warmup_T_all_diverged_quick(tmp_path):
  out = runner.run_experiment("hybrid_warmup_T", quick=True, workdir=tmp_path,
                              # (both T diverge from base_lr <= 3e4; the hybrid stays finite
                              # at DIVERGE's 1000 once it reaches LARS)
                              overrides=TINY[:4] + ["base_lr=1e5", "epochs=2",
                                                    "warmup_values=(0.5,1)"])
  runs = _runs(tmp_path)
  assert runs["0.5"][0]["diverged"] and runs["1"][0]["diverged"]
  assert out["target"] != out["target"]  # nan: no run to take 95 % of
  text = (tmp_path / "report.md").read_text()
  assert "target test accuracy n/a (every run diverged)" in text
  assert "| 0.5 | diverged (1/1) |" in text and "| 1 | diverged (1/1) |" in text
  assert [v["verdict"] for v in out["verdicts"]] == [
      "not reproduced at this scale (2 of 2 runs diverged)"] * 3


def _run(seed, diverged=False, test_accuracy=0.9, epochs_to_target=2.0, history=None):
  """A run record as experiments/_seed004_common.run_one returns it (no training)."""
  nan = float("nan")
  return {"seed": seed, "diverged": diverged, "error": "non-finite loss at step 3" if diverged
          else None, "diverged_at_step": 3 if diverged else None,
          "history": [] if diverged else (history or [{"epoch": 1.0, "test_accuracy": 0.5}]),
          "summary": {"test_accuracy": nan if diverged else test_accuracy, "diverged": diverged},
          "efficiency": {"epochs_to_target": None if diverged else epochs_to_target}}


def test_seed004_helpers_count_diverged_runs():
  """Partial divergence (1 of 3 seeds) in the helpers, without training."""
  from experiments import _seed004_common as common
  rs = [_run(0, test_accuracy=0.9), _run(1, diverged=True), _run(2, test_accuracy=0.8,
                                                                    epochs_to_target=None)]

  def acc(r):
    return r["summary"]["test_accuracy"]

  assert common.fmt_runs(rs, acc) == "0.85 ± 0.071 (1/3 diverged)"
  # value() never sees the diverged run (its history is empty: max() would raise).
  assert common.fmt_runs(rs, lambda r: max(h["test_accuracy"] for h in r["history"])).endswith(
      "(1/3 diverged)")
  assert common.fmt_runs(rs, lambda r: r["efficiency"]["epochs_to_target"], 3) == \
      "2 (1 seed; 1 of 3 never; 1/3 diverged)"
  assert common.fmt_runs(rs[1:2], acc) == "diverged (1/1)"
  assert common.fmt_ms([0.5, 0.7]) == "0.6 ± 0.14"  # unchanged without divergence
  assert common.fmt_ms([0.5]) == "0.5 (1 seed)"  # no spread to show (it read "0.5 ± 0")
  assert common.first_ok(rs) is rs[0] and common.first_ok(rs[1:2]) is None
  # A diverged run has no epochs-to-target bound; a run that never reached it: epochs + 1.
  assert common.censored_epochs(rs, 5)[0] == 2.0 and common.censored_epochs(rs, 5)[2] == 6.0
  assert common.censored_epochs(rs, 5)[1] != common.censored_epochs(rs, 5)[1]  # nan
  c = common.base_config(True)
  finals = {"a": [acc(r) for r in rs], "b": [float("nan")]}
  assert common.auto_target(c, finals) == 0.807  # floor(0.95 * mean(0.9, 0.8), 3 digits)
  assert common.auto_target(c, {"b": [float("nan")]}) != common.auto_target(c, {"b": [0.5]})
  # Verdict: a clear effect in the finite pairs is still not reproduced with a diverged seed.
  v = common.verdict([0.9, 0.9, 0.9, 0.9], [0.5, float("nan"), 0.51, 0.49], expect_greater=True,
                     what="x")
  assert v["verdict"] == "not reproduced at this scale (1 of 8 runs diverged)"
  assert v["seeds"] == 3 and v["diverged"] == 1 and v["mean_diff"] == pytest.approx(0.4)
  assert "over the 3 seed(s) where neither run diverged" in common.verdict_lines([v])[0]
  ok = common.verdict([0.9, 0.9, 0.9], [0.5, 0.51, 0.49], expect_greater=True, what="x")
  assert ok["verdict"] == "reproduced" and ok["diverged"] == 0
  rec = common.run_record(rs[1])
  assert rec["diverged"] and rec["error"] and rec["diverged_at_step"] == 3


def test_seed004_add_efficiency_of_a_diverged_run():
  from experiments import _seed004_common as common
  from mfopt import data as data_lib
  c = common.base_config(True)
  ds = data_lib.load("mnist1d", num_train=64, num_test=16)
  run = _run(0, diverged=True)
  del run["efficiency"]
  common.add_efficiency([run], 0.5, c, ds)
  eff = run["efficiency"]
  assert eff["epochs_to_target"] is None and eff["convergence_rate"] == 0.0
  assert eff["scaling_efficiency"] != eff["scaling_efficiency"]  # nan: n/a
  assert eff["efficiency_source"] == "n/a (run diverged)"


def test_bn_strategies_varying_row_trains_on_from_a_finished_shorter_run(tmp_path, monkeypatch):
  """More epochs with --allow-config-change: the finished one-epoch varying row is restored and
  trains only the second epoch's steps (counted at each dispatch), keeping its first row."""
  from mfopt import train
  base = TINY[:4] + ["warmup_epochs=0.5", "rows=('varying_sync_ma',)"]
  kw = dict(quick=True, workdir=tmp_path, checkpoint_every=1, keep_checkpoints=3)
  dispatched = []
  real = train.wait_for_old_steps
  monkeypatch.setattr(train, "wait_for_old_steps",
                      lambda window, limit=None: (dispatched.append(1), real(window, limit)))
  runner.run_experiment("bn_strategies", overrides=base + ["epochs=1"], **kw)
  one = _runs(tmp_path)["varying_sync_ma"][0]
  first_steps = len(dispatched)
  assert first_steps == one["summary"]["steps"] > 0
  runner.run_experiment("bn_strategies", overrides=base + ["epochs=2"],
                        allow_config_change=True, **kw)
  two = _runs(tmp_path)["varying_sync_ma"][0]
  assert len(dispatched) - first_steps == two["summary"]["steps"] - one["summary"]["steps"] > 0
  assert two["history"][0] == one["history"][0] and len(two["history"]) == 2
  assert two["history"][-1]["samples"] == two["summary"]["samples"] > one["summary"]["samples"]


def test_bn_strategies_varying_row_shortened_to_a_save_at_its_budget(tmp_path):
  """A two-epoch run killed after its epoch-1 save, which sits at exactly one epoch's samples
  (seed 1: 512), rerun with epochs=1 (--allow-config-change): the loop had nothing to train and
  returned None (TypeError in run; a diff review). Its result is the restored run's, whose
  last row is the epoch-1 evaluation."""
  import shutil
  base = TINY[:4] + ["warmup_epochs=0.5", "rows=('varying_sync_ma',)", "seeds=(1,)"]
  kw = dict(quick=True, workdir=tmp_path, checkpoint_every=1, keep_checkpoints=3)
  runner.run_experiment("bn_strategies", overrides=base + ["epochs=2"], **kw)
  full = _runs(tmp_path)["varying_sync_ma"][0]
  assert full["history"][0]["samples"] == 512  # (the case: a save at exactly the budget)
  (run_dir,) = list((tmp_path / "checkpoints").iterdir())
  saves = sorted(int(p.name) for p in run_dir.iterdir() if p.name.isdigit())
  shutil.rmtree(run_dir / str(saves[-1]))  # killed after the epoch-1 save
  runner.run_experiment("bn_strategies", overrides=base + ["epochs=1"],
                        allow_config_change=True, **kw)
  short = _runs(tmp_path)["varying_sync_ma"][0]
  assert short["history"] == full["history"][:1]
  assert short["summary"]["samples"] == 512
  assert short["summary"]["test_accuracy"] == full["history"][0]["test_accuracy"]


def test_hybrid_that_would_never_reach_sgd_is_refused_before_training(tmp_path):
  """T < epochs can still round up to the last step (T = 0.95 of one 8-step epoch: switch at
  step 8 of 8), and bn_strategies' row 1 draws its batches (seed 3: 7 steps, replayed by hand
  from its generator, default_rng(10_003)); refused before anything trains, naming T, the
  steps and the batch (it was refused per run, after earlier runs had trained, or not at all
  for row 1)."""
  with pytest.raises(runner.ConfigError, match=r"T = 0.95 epochs is 8 steps \(8 per epoch at "
                     r"per-worker batch 16\) of a run of 8 steps"):
    runner.run_experiment("hybrid_vs_baselines", quick=True, workdir=tmp_path / "a",
                          overrides=TINY[:5] + ["warmup_epochs=0.95"])
  with pytest.raises(runner.ConfigError, match=r"T = 0.875 epochs is 7 steps .* run of 7 steps "
                     r"\(the fewest a seed's row takes\)"):
    runner.run_experiment("bn_strategies", quick=True, workdir=tmp_path / "b",
                          overrides=TINY[:5] + ["warmup_epochs=0.875", "seeds=(0, 3)"])
  # row 1's steps per seed, as an independent replay of its generator's draws gave them
  from experiments import bn_strategies
  assert [bn_strategies._varying_steps(s, 8 * 4 * 16, 4, 16) for s in (0, 1, 2, 3)] == [
      9, 8, 10, 7]
  with pytest.raises(runner.ConfigError, match="'warmup_values' must hold T in \\(0, epochs=2\\)"):
    runner.prepare("hybrid_warmup_T", quick=True, overrides=["warmup_values=(2.0,)"])
  assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_precision_benchmark_takes_a_fractional_warmup():
  """Its SGD-phase build used steps_per_epoch = 1, and a fractional T (now a legal override)
  made the hybrid refuse S = floor(T) = 0, after the whole training grid had run."""
  from experiments import _seed004_common as common
  from experiments import precision
  _, c = runner.prepare("precision", quick=True, overrides=TINY + [
      "warmup_epochs=0.5", "policies=('fp32',)", "bench_repeats=1", "bench_steps=1"])
  out = precision.throughput(c, common.load_dataset(c))
  assert list(out) == [("fp32", 16)] and out[("fp32", 16)] > 0


def test_a_timing_shared_by_the_seeds_is_shown_once():
  """add_efficiency times each build once and copies it into every seed: fmt_runs showed that
  as a measured spread ('7.532e+04 ± 0'); fmt_shared says it is one timing. Values that do
  differ over seeds keep mean ± std."""
  from experiments import _seed004_common as common
  runs = [{"diverged": False, "v": v} for v in (75320.0, 75320.0, 75320.0)]
  assert common.fmt_shared(runs, lambda r: r["v"]) == "7.532e+04 (one timing, shared by 3 seeds)"
  four = runs + [{"diverged": True}]  # (the diverged run was left unsaid)
  assert common.fmt_shared(four, lambda r: r["v"]) == (
      "7.532e+04 (one timing, shared by 3 seeds; 1/4 diverged)")
  runs[1]["v"] = 80000.0
  assert common.fmt_shared(runs, lambda r: r["v"]) == common.fmt_runs(runs, lambda r: r["v"])
  assert "±" in common.fmt_shared(runs, lambda r: r["v"])


@pytest.mark.parametrize("a,b,expect_greater,want", [
    ([0.9, 0.91, 0.89], [0.5, 0.51, 0.49], True, "reproduced"),
    ([0.5, 0.51, 0.49], [0.9, 0.9, 0.9], True, "not reproduced at this scale"),  # wrong sign
    ([0.5, 0.51, 0.49], [0.9, 0.9, 0.9], False, "reproduced"),  # "a < b", as claimed
    ([0.9, 0.91, 0.89], [0.5, 0.51, 0.49], False, "not reproduced at this scale"),
    # differences 1, 1.5, 3: mean 1.83 < 2 x 1.04 (ddof=1); ddof=0 (0.85) would pass it
    ([2.0, 2.5, 4.0], [1.0, 1.0, 1.0], True, "not reproduced at this scale"),
])
def test_seed004_verdict_sign_and_threshold(a, b, expect_greater, want):
  """The claimed sign and SPEC's 2 sample std (ddof=1): neither was pinned (a claim 'a > b'
  with a clearly below b read 'reproduced' once the sign check went)."""
  from experiments import _seed004_common as common
  assert common.verdict(a, b, expect_greater=expect_greater, what="x")["verdict"] == want


def test_efficiency_report_on_several_devices():
  """num_devices enters the compute time derived from train_s (W workers timed on D devices:
  train_s x D / W per worker-step), and the projected training time is the single-GPU time
  over W; tests used one device only, where a dropped factor of D goes unseen."""
  from mfopt import metrics
  history = [{"epoch": 1.0, "test_accuracy": 0.3}, {"epoch": 2.0, "test_accuracy": 0.6}]
  summary = {"steps": 10, "train_s": 1.0, "num_workers": 8, "per_worker_batch": 4,
             "samples": 320, "all_reduces": 10, "all_reduce_bytes": 10 * 4000}
  rep = metrics.efficiency_report(summary=summary, history=history, target=0.5,
                                  samples_per_epoch=160, num_devices=4, net="10gbit",
                                  device="CPU")
  assert rep["compute_s"] == pytest.approx(1.0 * 4 / 8)
  assert rep["actual_training_time_s"] == pytest.approx(rep["actual_single_gpu_time_s"] / 8)


def test_efficiency_report_with_measured_communication():
  """A measured comm_s replaces the cost-model projection in 1 / (1 + comm/compute) (seed 004
  §3.2.2), no communication is efficiency 1 (not an error), and the convergence rate is
  1 / epochs-to-target (seed §1). W = 2 workers on 1 device: compute = 2 s x 1/2 = 1 s, one
  worker's speed = 200 samples / 1 s, target reached at epoch 4."""
  from mfopt import metrics
  history = [{"epoch": 1.0, "test_accuracy": 0.3}, {"epoch": 4.0, "test_accuracy": 0.6}]
  summary = {"steps": 10, "train_s": 2.0, "num_workers": 2, "samples": 400}
  assert metrics.scaling_efficiency(1.0, 0.0) == 1.0
  for comm, eff in ((0.25, 0.8), (0.0, 1.0)):
    rep = metrics.efficiency_report(summary=summary, history=history, target=0.5,
                                    samples_per_epoch=100, num_devices=1, comm_s=comm)
    assert rep["comm_s"] == comm and rep["efficiency_source"] == "measured"
    assert rep["scaling_efficiency"] == pytest.approx(eff, rel=1e-12)
    assert rep["convergence_rate"] == pytest.approx(1 / 4, rel=1e-12)
    # T_1 = epochs x samples/epoch / (speed x efficiency), T_N = T_1 / W
    assert rep["actual_single_gpu_time_s"] == pytest.approx(4 * 100 / (200 * eff), rel=1e-12)
    assert rep["actual_training_time_s"] == pytest.approx(4 * 100 / (200 * eff) / 2, rel=1e-12)


def test_setup_lines_give_each_batch_its_steps_and_samples():
  """precision's rows run at several per-worker batches; an epoch is floor(N / global batch)
  steps, so the samples differ across batches. Its report said "(equal samples)" from the
  config's one batch and "half the steps" at the larger one (an off-default review: 4 vs 16
  steps at batches 48 and 16). By hand, N = 1000, 8 workers, 2 epochs: batch 16 -> 7 steps an
  epoch, 14 x 128 = 1,792 samples; batch 48 -> 2 steps, 4 x 384 = 1,536."""
  import types
  from experiments import _seed004_common as common
  c = common.base_config(True)
  c.num_workers, c.epochs = 8, 2
  ds = types.SimpleNamespace(name="toy", train=range(1000), test=range(10))
  text = "\n".join(common.setup_lines(c, ds, batches=(16, 48), bn="BN per row"))
  assert "16: global batch 128, 14 steps, 1,792 samples" in text
  assert "48: global batch 384, 4 steps, 1,536 samples" in text
  assert "BN per row" in text and "BN strategy" not in text
  one = "\n".join(common.setup_lines(c, ds, batches=(16,)))
  assert "2 epochs = 14 steps (7 steps/epoch) for every algorithm (equal samples)" in one


def test_auto_target_is_95_percent_of_the_best_mean():
  """The target accuracy is 95 % of the best algorithm's mean final accuracy (every algorithm
  can be judged against it), floored to 3 digits: means 0.85 and 0.55 give 0.807, not 0.522."""
  from experiments import _seed004_common as common
  c = common.base_config(True)
  assert common.auto_target(c, {"weak": [0.5, 0.6], "strong": [0.9, 0.8]}) == 0.807
  c.target_accuracy = 0.5  # given: used as is
  assert common.auto_target(c, {"strong": [0.9, 0.8]}) == 0.5


def test_seed004_config_defaults_are_the_papers():
  """The seed's §3.1 hyperparameters (SPEC.md: lr 0.1 per worker, decay 0.9, momentum 0.9,
  weight decay 1e-4, LARS trust coefficient 1e-3 as in You et al., AdaBound alpha 1e-3) in
  both the --quick and the full configuration: a changed default silently changes every
  seed-004 run."""
  from experiments import _seed004_common as common
  for quick in (True, False):
    c = common.base_config(quick)
    assert (c.base_lr, c.decay, c.momentum, c.weight_decay, c.trust_coefficient, c.alpha) == (
        0.1, 0.9, 0.9, 1e-4, 1e-3, 1e-3), quick


def test_warmup_sgd_schedule_rises_linearly_then_decays_per_epoch():
  """Goyal et al.'s gradual warm-up: lr rises linearly from base_lr to base_lr N over
  ceil(T x steps/epoch) steps (the hybrid's warm-up length: the two are compared "over the
  same T epochs"), then decays by `decay` once per epoch counted from the end of the warm-up.
  By hand: base 0.1, N = 4 (peak 0.4), 10 steps/epoch, T = 0.25 (2.5: 3 steps; round() gave
  2), decay 0.9: 0.1, 0.2, 0.3, then 0.4 for steps 3..12, 0.36 from 13, 0.324 from 23."""
  import jax
  from experiments import _seed004_common as common
  from mfopt import hybrid_switch_step
  sched = common.warmup_sgd_schedule(base_lr=0.1, num_workers=4, steps_per_epoch=10,
                                     warmup_epochs=0.25, decay=0.9)
  assert hybrid_switch_step(0.25, 10) == 3
  steps = [0, 1, 2, 3, 12, 13, 22, 23]
  want = [0.1, 0.2, 0.3, 0.4, 0.4, 0.36, 0.36, 0.324]
  np.testing.assert_allclose(jax.jit(sched)(np.asarray(steps)), want, rtol=1e-6)


def _trajectory(tx, offsets, steps):
  """:func:`_steps.worker_grid_trajectory` of the first data row: ``(W, steps, D)``."""
  from _steps import worker_grid_trajectory  # tests/ is on sys.path
  return worker_grid_trajectory(tx, offsets, steps)[0]


def test_make_tx_passes_the_configs_hyperparameters_through():
  """Each algorithm on the workers' mean gradient with the config's hyperparameters (module
  docstring, SPEC.md): warmup_sgd by a NumPy re-derivation (weight decay added to the
  gradient, heavy-ball momentum, the schedule above with the T given to make_tx); adabound
  with final lr base_lr x N; the hybrid with every config field. Non-default values, so a
  dropped or defaulted argument shows."""
  import mfopt
  from experiments import _seed004_common as common
  c = common.base_config(True)  # warmup_epochs 1.0: the explicit T = 0.5 must win
  c.update(dict(base_lr=0.1, momentum=0.8, weight_decay=0.05, decay=0.5, alpha=1e-5,
                trust_coefficient=0.1))
  offs = np.array([[[0.5, -1.0, 2.0], [-0.1, 0.3, 0.0]]])  # 2 workers
  mean = offs.mean(axis=1)[0]
  n, spe, t, steps = 3, 4, 0.5, 8

  got = _trajectory(common.make_tx("warmup_sgd", c, num_workers=n, steps_per_epoch=spe,
                                   warmup_epochs=t), offs, steps)
  np.testing.assert_array_equal(got[0], got[1])
  w, v, want = np.linspace(-1.0, 1.0, 3), np.zeros(3), []
  for k in range(steps):  # warm = 2 steps; peak 0.3
    lr = 0.1 + 0.2 * k / 2 if k < 2 else 0.3 * 0.5 ** ((k - 2) // spe)
    v = (2 * w + mean + 0.05 * w) + 0.8 * v
    w = w - lr * v
    want.append(w)
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)

  refs = {"adabound": mfopt.adabound(1e-5, final_lr=0.1 * n),
          "hybrid": mfopt.hybrid_adabound_lars(
              num_workers=n, steps_per_epoch=spe, base_lr=0.1, alpha=1e-5, warmup_epochs=t,
              decay=0.5, momentum=0.8, weight_decay=0.05, trust_coefficient=0.1)}
  for algo, ref in refs.items():
    got = _trajectory(common.make_tx(algo, c, num_workers=n, steps_per_epoch=spe,
                                     warmup_epochs=t), offs, steps)
    np.testing.assert_allclose(got[0], _trajectory(ref, mean[None, None], steps)[0],
                               rtol=1e-5, atol=1e-7, err_msg=algo)


def test_diverged_run_record_keeps_the_plan_and_the_first_bad_step():
  """A diverged run's record (run_one's shape): diverged, the error's first line, the first
  non-finite step (plot legends and reports name it), no history, nan metrics, and the planned
  steps, batch (4 x 8 = 32) and steps per epoch."""
  from experiments import _seed004_common as common
  from mfopt import train
  err = train.NonFiniteError("non-finite loss at step 6\ndetail", step=6, workers=[1],
                             metric="loss", detected_at=8, checkpoint="none")
  r = common.diverged_run(err, seed=2, desc="", num_workers=4, per_worker_batch=8,
                          num_steps=24, steps_per_epoch=12, num_devices=4)
  assert common.is_diverged(r) and r["diverged_at_step"] == 6 and r["seed"] == 2
  assert r["error"] == "non-finite loss at step 6" and r["history"] == []
  assert (r["steps_per_epoch"], r["num_devices"], r["per_worker_batch"]) == (12, 4, 8)
  s = r["summary"]
  assert s["steps"] == 24 and s["global_batch"] == 32 and s["diverged_at_step"] == 6
  assert np.isnan(s["test_accuracy"])
  assert common.curve_label("hybrid", r) == "hybrid (diverged at step 6)"


def test_add_efficiency_times_each_build_once_and_projects_by_hand(monkeypatch):
  """One timing per build (algorithm, batch, ...), shared by its seeds, and the projection of
  seed 004 §1 from it: 10 steps x 0.01 s = 0.1 s of compute for 400 / 2 samples per worker
  (2,000 samples/s), no communication (efficiency 1), target at epoch 2 of a 100-example
  training set: single-GPU time 2 x 100 / 2,000 = 0.1 s, over W = 2 workers 0.05 s."""
  import types
  from experiments import _seed004_common as common
  calls = []

  def timing(c, dataset, **build):
    calls.append(build)
    return 0.01 * build["per_worker_batch"] / 16

  monkeypatch.setattr(common, "one_worker_step_s", timing)
  history = [{"epoch": 1.0, "test_accuracy": 0.3}, {"epoch": 2.0, "test_accuracy": 0.6}]
  summary = {"steps": 10, "train_s": 1.0, "num_workers": 2, "samples": 400, "all_reduces": 0,
             "all_reduce_bytes": 0}

  def run(seed, b):
    return {"seed": seed, "diverged": False, "history": history, "summary": summary,
            "num_devices": 1, "per_worker_batch": b, "build": {"algo": "hybrid"}}

  runs = [run(0, 16), run(1, 16), run(0, 32)]
  c = common.base_config(True)
  common.add_efficiency(runs, 0.5, c, types.SimpleNamespace(train=range(100)))
  assert calls == [{"algo": "hybrid", "per_worker_batch": 16},
                   {"algo": "hybrid", "per_worker_batch": 32}]
  eff = runs[1]["efficiency"]
  assert eff["compute_s"] == pytest.approx(0.1) and eff["epochs_to_target"] == 2.0
  assert eff["single_device_speed"] == pytest.approx(2000.0)
  assert eff["scaling_efficiency"] == pytest.approx(1.0)
  assert eff["actual_single_gpu_time_s"] == pytest.approx(0.1)
  assert eff["actual_training_time_s"] == pytest.approx(0.05)
  assert runs[2]["efficiency"]["compute_s"] == pytest.approx(0.2)


def test_seed004_builders_follow_the_config():
  """The run's model is the config's CNN width (features (4,), not the class default
  (32, 64)) with the dataset's classes; decay = 1 (no decay) is a legal setting, outside
  (0, 1] is refused."""
  import types
  from experiments import _seed004_common as common
  c = common.base_config(True)
  c.features = (4,)
  m = common.build_model(c, types.SimpleNamespace(num_classes=3))
  assert tuple(m.features) == (4,) and m.num_classes == 3
  assert common.model_text(c) == "model cnn (features (4,)), BN strategy last_batch"
  # the report names what is built: the MLP's own widths and no BN (it printed "features" and
  # a BN strategy for an MLP); a ResNet's standard widths
  c.model, c.bn = "mlp", "sync"
  mlp = common.build_model(c, types.SimpleNamespace(num_classes=3))
  assert common.model_text(c) == (f"model mlp (hidden widths {tuple(mlp.hidden)}, its default), "
                                  "no BatchNorm")
  assert set(common.unused_fields(c)) == {"features", "bn"}
  c.model = "resnet18"
  assert common.model_text(c) == "model resnet18 (its standard widths), BN strategy sync"
  assert set(common.unused_fields(c)) == {"features"}
  c.model = "cnn"
  c.decay = 1.0
  common.validate_common(c)
  for bad in (0.0, 1.5):
    c.decay = bad
    with pytest.raises(runner.ConfigError, match="'decay' must be in \\(0, 1\\]"):
      common.validate_common(c)


def test_a_timing_differing_over_seeds_is_not_called_shared():
  """Only values equal to rounding are one shared timing: runs 1e-4 apart (75,320 and
  75,328) were measured separately and keep their spread."""
  from experiments import _seed004_common as common
  runs = [{"diverged": False, "v": v} for v in (75320.0, 75328.0)]
  assert "one timing" not in common.fmt_shared(runs, lambda r: r["v"])


def test_make_tx_all_reduces_in_the_configs_comm_dtype():
  """comm_dtype (seed 004 §2.2.2: half-precision gradient all-reduce) reaches the exchange:
  10 float32 parameters are 40 bytes a step in fp32 and 20 in bfloat16 / float16, whichever
  algorithm follows; ignoring it leaves the precision experiment comparing fp32 to fp32."""
  import jax.numpy as jnp
  from experiments import _seed004_common as common
  from mfopt import comm
  c = common.base_config(True)
  for dtype, want in (("none", 40), ("bfloat16", 20), ("float16", 20)):
    c.comm_dtype = dtype
    for algo in common.ALGORITHMS:
      state = common.make_tx(algo, c, num_workers=4, steps_per_epoch=8).init(jnp.zeros(10))
      assert comm.payload_of(state[0].comm) == want, (dtype, algo)


def test_run_one_trains_whole_epochs_and_evaluates_each(monkeypatch):
  """A run is `epochs` whole epochs of floor(N / global batch) steps, logged and evaluated
  once an epoch (the curves' x axis is epochs): N = 512, 8 workers x 32 = 256 a step, 2
  steps an epoch, 2 epochs = 4 steps. A divergence is returned as a record, not raised."""
  import types
  from experiments import _seed004_common as common
  from mfopt import train
  calls = []

  def fit(**kw):
    calls.append(kw)
    raise train.NonFiniteError("non-finite loss at step 3", step=3, workers=[0], metric="loss",
                               detected_at=4, checkpoint="none")

  monkeypatch.setattr(train, "fit", fit)
  c = common.base_config(True)  # 8 workers, 2 epochs
  ds = types.SimpleNamespace(train=range(512), num_classes=10)
  r = common.run_one(c, ds, "warmup_sgd", 1, per_worker_batch=32)
  kw, = calls
  assert (kw["num_steps"], kw["per_worker_batch"], kw["num_workers"]) == (4, 32, 8)
  assert kw["log_every"] == kw["eval_every"] == 2 and kw["seed"] == 1
  assert r["diverged"] and r["diverged_at_step"] == 3 and r["steps_per_epoch"] == 2
  assert r["summary"]["steps"] == 4 and r["num_devices"] == 8


def _hand_run(seed, test_accuracy, train_accuracy, epochs_to_target, **extra):
  """A finished run record as _seed004_common.run_one returns it, with its efficiency."""
  return {"seed": seed, "diverged": False, "error": None, "diverged_at_step": None,
          "history": [{"epoch": 1.0, "test_accuracy": test_accuracy,
                       "train_accuracy": train_accuracy}],
          "summary": {"test_accuracy": test_accuracy, "final_train_accuracy": train_accuracy,
                      "diverged": False},
          "efficiency": {"epochs_to_target": epochs_to_target, "actual_single_gpu_time_s": 1.0},
          **extra}


def test_hybrid_warmup_T_claims_from_hand_built_runs(tmp_path, monkeypatch):
  """§3.2.1 on hand-built runs (no training), T given in descending order: the training-accuracy
  claim is train(T_min) - train(T_max) > 0 on the final *training* accuracy, the test claim the
  same on test accuracy, and "larger T converges in fewer epochs" is epochs(T_max) <
  epochs(T_min); the table's train column is the training accuracy. Numbers by hand."""
  from experiments import _seed004_common as common
  import types

  from experiments import hybrid_warmup_T
  from mfopt import report as report_lib
  train = {0.5: lambda s: 0.95 + 0.001 * s, 1.0: lambda s: 0.90 + 0.002 * s}
  test = {0.5: lambda s: 0.80, 1.0: lambda s: 0.85 + 0.01 * s}
  epochs = {0.5: lambda s: 1.5 + 0.01 * s, 1.0: lambda s: 1.0}

  def fake_run_one(c, dataset, algorithm, seed, *, warmup_epochs, **kw):
    t = warmup_epochs
    return _hand_run(seed, test[t](seed), train[t](seed), epochs[t](seed))

  monkeypatch.setattr(common, "run_one", fake_run_one)
  monkeypatch.setattr(common, "load_dataset", lambda c: types.SimpleNamespace(
      name="mnist1d", train=range(512), test=range(128)))
  monkeypatch.setattr(common, "add_efficiency", lambda rs, target, c, dataset: None)
  monkeypatch.setattr(report_lib, "plot_curves", lambda *a, **k: None)
  _, c = runner.prepare("hybrid_warmup_T", quick=True, overrides=TINY[:4] + [
      "epochs=2", "warmup_values=(1,0.5)", "seeds=(0, 1, 2)"])
  out = hybrid_warmup_T.run(c, tmp_path)
  v_train, v_test, v_epochs = out["verdicts"]
  assert v_train["mean_diff"] == pytest.approx(0.049)  # 0.05 - 0.001 s over s = 0, 1, 2
  assert v_train["verdict"] == "reproduced"  # std 0.001
  assert v_test["mean_diff"] == pytest.approx(-0.06)  # -0.05 - 0.01 s
  assert v_test["verdict"] == "not reproduced at this scale"
  assert v_epochs["mean_diff"] == pytest.approx(-0.51)  # 1 - (1.5 + 0.01 s)
  assert v_epochs["verdict"] == "reproduced"  # fewer epochs at T = 1, std 0.01
  rows = {r["T"]: r for r in out["rows"]}
  assert rows[0.5]["final_train"].startswith("0.951") and rows[0.5]["final_test"].startswith("0.8")
  assert out["target"] == pytest.approx(0.817)  # floor(0.95 x 0.86 x 1000) / 1000


def test_precision_throughput_weights_the_phases_and_keeps_the_fastest_repeat(monkeypatch):
  """Samples/s per device = W b / (step time x devices), the step time the warm-up's and the
  SGD phase's per-step times weighted by their shares of the run (T / epochs and the rest),
  each the fastest repeat over bench_steps steps. A fake clock advances per step by hand-set
  times (the last repeat slowed, as by other load); nothing is compiled."""
  import types

  import mfopt
  from experiments import _seed004_common as common
  from experiments import precision
  from mfopt import data as data_lib
  from mfopt import parallel, train
  clock = [0.0]
  dt = {("fp32", "warmup"): 0.010, ("fp32", "sgd"): 0.002,
        ("fp16", "warmup"): 0.005, ("fp16", "sgd"): 0.001}
  calls = {}

  def make_train_step(model, tx, **kw):
    (spe, pol) = tx
    phase = "warmup" if spe == 10 ** 6 else "sgd"
    warm = 1 if phase == "warmup" else 1 + 2  # the SGD build steps past its switch S = 1

    def fn(state, batch):
      n = calls[(pol, phase)] = calls.get((pol, phase), 0) + 1
      repeat = (n - warm - 1) // 2  # bench_steps = 2
      clock[0] += dt[(pol, phase)] * (5 if repeat == 2 else 1)  # the last of 3 repeats slow
      return state, {}
    return fn

  monkeypatch.setattr(precision, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  monkeypatch.setattr(common, "make_tx", lambda algo, cc, num_workers, steps_per_epoch:
                      steps_per_epoch)
  monkeypatch.setattr(mfopt.precision, "with_policy", lambda tx, pol: (tx, pol))
  monkeypatch.setattr(common, "build_model", lambda c, dataset, policy: None)
  monkeypatch.setattr(common, "mesh_for", lambda w: types.SimpleNamespace(
      shape={parallel.DATA_AXIS: 2}))
  monkeypatch.setattr(data_lib, "WorkerBatcher", lambda *a, **kw: types.SimpleNamespace(
      batch=lambda step: {"x": np.zeros((4, 16, 3))}))
  monkeypatch.setattr(parallel, "shard_workers", lambda batch, mesh: batch)
  monkeypatch.setattr(train, "init_train_state", lambda model, tx, x, **kw: 0)
  monkeypatch.setattr(train, "make_train_step", make_train_step)
  _, c = runner.prepare("precision", quick=True, overrides=TINY + [
      "epochs=2", "bench_repeats=3", "bench_steps=2"])
  out = precision.throughput(c, types.SimpleNamespace(train=range(512)))
  # T = 0.5 of 2 epochs: the warm-up's share 0.25; 4 workers x 16 on 2 devices
  for pol in ("fp32", "fp16"):
    step = 0.25 * dt[(pol, "warmup")] + 0.75 * dt[(pol, "sgd")]
    assert out[(pol, 16)] == pytest.approx(4 * 16 / (step * 2), rel=1e-9), pol
    # compiled with 1 step (warm-up), or stepped past the switch S = ceil(0.5) = 1 (S + 2 = 3
    # steps: the SGD phase), then 3 repeats x 2 steps
    assert calls[(pol, "warmup")] == 1 + 6 and calls[(pol, "sgd")] == 3 + 6


def test_precision_rows_and_verdicts_from_hand_built_runs(tmp_path, monkeypatch):
  """precision's table and verdicts on hand-built runs (no training): each policy all-reduces
  in its own dtype, the 'vs fp32' column is the policy's benchmark over fp32's, training speed
  is per device, and an accuracy difference within 2 std of the paired differences is no
  significant difference, beyond it a significant one. Numbers by hand."""
  import types

  from experiments import _seed004_common as common
  from experiments import precision
  from mfopt import report as report_lib
  comm = {}
  acc = {"fp32": lambda s: 0.80, "bf16": lambda s: 0.70 + 0.001 * s,
         "fp16": lambda s: (0.80, 0.83, 0.83)[s]}  # fp16 - fp32: 0, .03, .03: std .0173

  def fake_run_one(cc, dataset, algorithm, seed, *, policy, per_worker_batch, **kw):
    comm[policy] = cc.comm_dtype
    r = _hand_run(seed, acc[policy](seed), 0.9, 1.0, num_devices=4, steps_per_epoch=8)
    r["summary"].update(samples=1000, train_s=2.0, payload_bytes=100)
    r["history"] = [{"epoch": 1.0, "test_accuracy": 0.5, "train_overflow": 0.25},
                    {"epoch": 2.0, "test_accuracy": 0.5, "train_overflow": 0.5}]
    return r

  def fake_efficiency(rs, target, c, dataset):
    for r in rs:
      r["efficiency"].update(speed_device="cpu", scaling_efficiency=0.5)

  bench = {("fp32", 16): 100.0, ("bf16", 16): 150.0, ("fp16", 16): 200.0}
  monkeypatch.setattr(common, "run_one", fake_run_one)
  monkeypatch.setattr(common, "load_dataset", lambda c: types.SimpleNamespace(
      name="mnist1d", train=range(512), test=range(128)))
  monkeypatch.setattr(common, "add_efficiency", fake_efficiency)
  monkeypatch.setattr(precision, "throughput", lambda c, dataset: bench)
  monkeypatch.setattr(report_lib, "plot_curves", lambda *a, **k: None)
  _, c = runner.prepare("precision", quick=True, overrides=TINY + [
      "seeds=(0, 1, 2)", "policies=('fp32', 'bf16', 'fp16')"])
  out = precision.run(c, tmp_path)
  assert comm == {"fp32": "none", "bf16": "bfloat16", "fp16": "float16"}
  rows = {r["policy"]: r for r in out["rows"]}
  assert [rows[p]["speedup"] for p in ("fp32", "bf16", "fp16")] == ["1x", "1.5x", "2x"]
  assert rows["fp32"]["speed"].startswith("125 ")  # 1000 samples / 2 s / 4 devices
  assert rows["fp32"]["overflow_logs"].startswith("6 ")  # (0.25 + 0.5) x 8 steps per epoch
  v = {x["claim"].split(" ")[0]: x for x in out["verdicts"]}
  assert v["bf16"]["mean_diff"] == pytest.approx(-0.099)  # bf16 - fp32
  assert v["bf16"]["verdict"] == "differs significantly"
  assert v["fp16"]["mean_diff"] == pytest.approx(0.02)  # 0.0173 < 0.02 < 2 x 0.0173
  assert v["fp16"]["verdict"].startswith("no significant difference at 2 std")
  comm.clear()
  c.half_precision_allreduce = False
  c.seeds = (0,)
  v = {x["claim"].split(" ")[0]: x for x in precision.run(c, tmp_path)["verdicts"]}
  assert set(comm.values()) == {"none"}
  assert v["bf16"]["verdict"] == "not testable (1 seed: no spread)"
