"""One ``--quick`` smoke test per seed 000 experiment, each checking the content of its table."""

import json
import math
import re

import numpy as np
import pytest

import mfopt
from mfopt import runner


def _run(name, tmp_path, *overrides):
  summary = runner.run_experiment(name, quick=True, workdir=tmp_path, overrides=list(overrides))
  for f in ("config.json", "summary.json", "report.md"):
    assert (tmp_path / f).stat().st_size > 0, f
  return summary, (tmp_path / "report.md").read_text()


def test_mf_batch_workers_quick(tmp_path, monkeypatch):
  # workers=128 > batch 64: that cell must be skipped and reported, not run.
  from mfopt import train
  real, evaluated = train.evaluate, []

  def recording(eval_fn, params, model_state, source, *args, **kwargs):
    out = real(eval_fn, params, model_state, source, *args, **kwargs)
    evaluated.append((len(source), out["test_loss"]))
    return out

  monkeypatch.setattr(train, "evaluate", recording)
  summary, text = _run("mf_batch_workers", tmp_path, "workers=(1, 8, 128)")
  cells = summary["cells"]
  assert {(c["optimizer"], c["global_batch"], c["workers"]) for c in cells} == {
      (o, 64, w) for o in ("sgd", "adam") for w in (1, 8)}
  assert summary["skipped"] == [{"global_batch": 64, "workers": 128, "why": "per-worker batch < 1"}]
  assert "batch 64 x 128 workers (per-worker batch < 1)" in text
  # Table layout: one table per optimizer, lr of Table 1 (0.025 at batch 64) in the row.
  assert text.count("| batch | 1 worker(s) | 8 worker(s) | 128 worker(s) | lr |") == 2
  rows = re.findall(r"^\| 64 \| ([0-9.]+) \| ([0-9.]+) \| skipped \| 0.025 \|$", text, re.M)
  assert len(rows) == 2
  for c in cells:
    assert 0.0 <= c["test_accuracy_mean"] <= 1.0 and c["diverged"] == 0
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert {r["steps"] for r in runs} == {16}  # 1,000 samples / 64 for every cell (equal samples)
  assert {r["learning_rate"] for r in runs} == {0.025}
  # table.json's loss is the final model's over the whole training set, the same examples in
  # every cell (fit's last-window minibatch loss spanned 1 % to 100 % of a run by batch size)
  from experiments import mf_batch_workers
  train_size = mf_batch_workers.get_config(quick=True).num_train
  on_train = [loss for n, loss in evaluated if n == train_size]
  assert sorted(r["train_set_loss"] for r in runs) == sorted(on_train) and len(on_train) == 4
  table = json.loads((tmp_path / "table.json").read_text())
  assert all(c["train_set_loss_mean"] == c["train_set_loss_values"][0] for c in table)
  assert "W=1: 1 of 8 device(s)" in text and "W=8: 8 device(s)" in text
  assert any("acc(W=1) - acc(W=8) at batch 64" in k for k in summary["claims"])
  assert (tmp_path / "accuracy_vs_workers.png").stat().st_size > 0


def test_mf_sweep_quick(tmp_path):
  summary, text = _run("mf_sweep", tmp_path)
  cells = summary["cells"]
  assert {(c["optimizer"], c["mf"], c["workers"]) for c in cells} == {
      (o, m, 8) for o in ("sgd", "nag", "adam") for m in (0.9, 0.99)}
  assert summary["learning_rates"] == {"sgd": 0.05, "nag": 0.05, "adam": 0.05}  # Table 1 @ 128
  assert summary["steps"] == 8
  assert "MF 0.9: 0.5, MF 0.99: 5" in text  # effective step lr/(1-MF)
  for opt in ("SGD", "NAG", "Adam"):
    assert re.search(rf"## {opt} .*\n\n\| MF \| 8 worker\(s\) \|\n\|---\|---\|\n\| 0.9 \| [0-9.]+ \|"
                     r"\n\| 0.99 \| [0-9.]+ \|", text), opt
  # NAG differs from SGD: the two runs of the same MF are not the same training.
  runs = json.loads((tmp_path / "runs.json").read_text())
  loss = {(r["optimizer"], r["mf"]): r["final_train_loss"] for r in runs}
  assert loss[("sgd", 0.99)] != loss[("nag", 0.99)]


def test_mf_sweep_records_diverged_runs(tmp_path):
  """At base_lr=1000 SGD diverges (effective step 1e4) and Adam does not: the grid finishes,
  the diverged rows have a finished row's keys, and the report lists them with their errors."""
  summary, text = _run("mf_sweep", tmp_path, "base_lr=1000", "optimizers=('sgd', 'adam')")
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert {(r["optimizer"], r["diverged"]) for r in runs} == {("sgd", True), ("adam", False)}
  assert len({frozenset(r) for r in runs}) == 1  # one set of keys for every row
  for r in runs:
    if r["diverged"]:
      assert r["error"].startswith("non-finite ") and 1 <= r["diverged_at_step"] <= 8
      assert math.isnan(float(r["test_accuracy"])) and r["train_s"] == "nan"  # strict JSON
    else:
      assert r["error"] is None and 0.0 <= r["test_accuracy"] <= 1.0
  sgd = [c for c in summary["cells"] if c["optimizer"] == "sgd"]
  assert all(c["diverged"] == 1 and math.isnan(c["test_accuracy_mean"]) for c in sgd)
  assert text.count("| diverged (1/1) |") == 2
  assert "## Diverged runs" in text and "2 of 4 runs stopped on a non-finite" in text
  assert "- sgd MF 0.99, 8 worker(s) x batch 16, seed 0: non-finite " in text
  assert "adam MF" not in text.split("## Diverged runs")[1].split("## Paper claims")[0]
  assert "sgd: acc(MF 0.99) - acc(MF 0.9) at W=8 > 0 (higher MF helps many workers): " \
         "**not testable (no finite pair)**" in text


def test_mf_mlp_quick(tmp_path):
  summary, text = _run("mf_mlp", tmp_path)
  by_mf = {c["mf"]: c for c in summary["cells"]}
  assert sorted(by_mf) == [0.9, 0.975] and summary["steps"] == 31
  # the MLP learned something in 31 steps (chance is 0.1)
  assert by_mf[0.9]["test_accuracy_mean"] > 0.15
  assert "| 0.9 | " in text and "| 0.975 | " in text and "| 0.5 |" in text and "| 2 |" in text
  assert "Workers: 8 (virtual); global batch 64, per-worker 8" in text
  # the samples processed, not the nominal 2,000 (31 x 64 = 1,984)
  assert "31 per run x global batch 64 = 1,984 samples processed" in text
  # only Fig. 8's own statements, where their MF values ran (a claim 'acc(0.99) > acc(0.9)',
  # which the paper never makes, was tested when 0.975 was missing)
  assert list(summary["claims"]) == ["acc(MF 0.975) - acc(MF 0.9) > 0 (accuracy rises with MF)"]
  assert (tmp_path / "train_loss.png").stat().st_size > 0


def test_mf_mlp_takes_mf_0_and_says_which_mfs_its_claims_need(tmp_path):
  """MF = 0 (plain SGD, the natural baseline) was refused as 'must be positive' by a check that
  ran before the script's own [0, 1); with no claim testable the report said "(needs two MF
  values)" under a run of two MF values."""
  summary, text = _run("mf_mlp", tmp_path, "mfs=(0.0,0.5)", "epochs=0.2")
  assert sorted(c["mf"] for c in summary["cells"]) == [0.0, 0.5] and summary["claims"] == {}
  assert ("- no claim testable: Fig. 8's claims compare MF 0.975 with a lower MF, and MF 0.99 "
          "with 0.975 or 0.95; this run has mfs=(0.0, 0.5)") in text


def test_mf_lstm_quick(tmp_path):
  summary, text = _run("mf_lstm", tmp_path)
  runs = json.loads((tmp_path / "runs.json").read_text())
  assert sorted(r["mf"] for r in runs) == [0.9, 0.99]
  vocab = int(re.search(r"vocabulary (\d+)", text).group(1))
  for r in runs:
    assert r["validation_perplexity"] == pytest.approx(math.exp(r["test_loss"]))
    assert r["train_perplexity"] == pytest.approx(math.exp(r["final_train_loss"]))
    # better than a uniform guess over the vocabulary
    assert 1.0 < r["validation_perplexity"] < vocab
  assert "| MF value | train perplexity | validation perplexity |" in text
  # the train perplexity's window is stated (the last log_every window, here all 15 steps)
  assert re.search(r"over the last logging window, its last \d+ step\(s\) x 64 sequences", text)
  # The step count follows the corpus, built from this Python's stdlib docstrings (15 steps on
  # CPython 3.11; Python 3.12's docstrings give another count): equal sequences for every MF.
  c = runner.prepare("mf_lstm", quick=True)[1]
  from experiments import _mf_common
  dataset = mfopt.data.load(c.dataset, seq_len=c.seq_len)
  steps = _mf_common.steps_for(int(round(c.epochs * len(dataset.train))), c.global_batch)
  assert f"{steps} per run x global batch 64 = {steps * 64:,} sequences processed" in text


def test_mf_lstm_claims_take_their_direction_from_table_4():
  """mfs=(0.95, 0.99): Table 4 has train ppl 17.84 at 0.99 > 17.04 at 0.95, but the claim
  expected the larger MF lower, so rows equal to the paper's were 'not reproduced'."""
  import ml_collections
  from experiments import mf_lstm
  rows = [{"mf": mf, "seed": s, "train_perplexity": t + 0.01 * s, "validation_perplexity": v}
          for mf, (t, v) in mf_lstm.PAPER_TABLE4.items() for s in range(3)]
  for mfs in [(0.95, 0.99), (0.9, 0.95, 0.975, 0.99), (0.9, 0.99)]:
    claims = mf_lstm._claims(ml_collections.ConfigDict({"mfs": mfs}), rows)
    assert claims and all(v.startswith("reproduced") for v in claims.values()), (mfs, claims)
  assert "train ppl(MF 0.99) - train ppl(MF 0.95) > 0 (paper 17.84 vs 17.04)" in \
      mf_lstm._claims(ml_collections.ConfigDict({"mfs": (0.95, 0.99)}), rows)
  # an MF outside Table 4 makes no claim
  assert mf_lstm._claims(ml_collections.ConfigDict({"mfs": (0.9, 0.999)}), rows) == {}


def test_mf_batch_workers_claims_compare_cells_that_ran():
  """Workers (2, 3), batches (6, 9): W = 2 cannot run batch 9 (skipped). The claims compared
  W=2 with W=3 at batch 9 and batch 6 with 9 at W=2, both against the skipped cell, and said
  "not testable (no finite pair)" (an off-default review); they use the cells that ran."""
  import ml_collections
  from experiments import mf_batch_workers
  c = ml_collections.ConfigDict({"workers": (2, 3), "batches": (6, 9), "optimizers": ("nag",)})
  keys = list(mf_batch_workers._claims(c, []))
  assert len(keys) == 2, keys
  assert keys[0].startswith("nag: acc(W=2) - acc(W=3) at batch 6 > 0")
  assert keys[1].startswith("nag: acc(batch 6) - acc(batch 9) at W=3 > 0")


def test_mf_batch_workers_claim_where_the_paper_ties_is_not_testable():
  """Table 2 ties at batch 32 (0.917 at 4 and 16 GPUs): that cell was tested as "more workers
  help" (the sign of a tie fell to -1)."""
  import ml_collections
  from experiments import mf_batch_workers
  c = ml_collections.ConfigDict({"workers": (4, 16), "batches": (32,), "optimizers": ("sgd",)})
  claims = mf_batch_workers._claims(c, [])
  assert claims == {"sgd: acc(W=4) vs acc(W=16) at batch 32 (paper 0.917 vs 0.917)":
                    "not testable (the paper's table ties: no direction to test)"}
  c.workers = (1, 16)  # 0.928 vs 0.917: more workers hurt
  key, = mf_batch_workers._claims(c, [])
  assert "acc(W=1) - acc(W=16) at batch 32 > 0 (more workers hurt; paper 0.928 vs 0.917)" in key


def test_bn_variance_quick(tmp_path):
  summary, text = _run("bn_variance", tmp_path, "seeds=(0, 1)")  # two: the pooled SE divides
  assert summary["verdict"]["supports"] == "correct"
  assert "support the correct expectation" in text
  M = 32
  acts = summary["activations"]
  for r in acts + summary["gaussian"]:
    assert abs(r["S_t"] - (M - 1)) < 5 * r["S_t_se"]
    if r["P"] > 1:
      assert abs(r["S_t"] - r["printed_e2"]) > 10 * r["S_t_se"]
  # the report prints eq. 8 beside the measurement: 47 = 31 + 32*1/2 at P = 2
  assert re.search(r"\| conv0 \| 2 \| 16 \| 3[01]\.\d\d ± 0\.\d\d \| 31 \| 47 \|", text)
  # z in the table is of the mean over seeds with its pooled SE, sqrt(sum SE_i^2) / n (a mean of
  # the per-seed z would understate |z| by about sqrt(n)): re-derived from the per-seed rows
  rs = [r for r in acts if r["layer"] == "conv0" and r["P"] == 2]
  mean = np.mean([r["S_t"] for r in rs])
  se = np.sqrt(np.sum([r["S_t_se"] ** 2 for r in rs])) / len(rs)
  cells = re.search(r"\| conv0 \| 2 \| 16 \|[^|]*\| 31 \| 47 \| ([-0-9.e]+) \| ([-0-9.e]+) \|",
                    text).groups()
  np.testing.assert_allclose([float(c) for c in cells], [(mean - 31) / se, (mean - 47) / se],
                             rtol=1e-3, atol=1e-3)
  noise = {r["P"]: r for r in summary["bn_noise"] if r["layer"] == "conv0"}
  ratio = noise[8]["mean_noise"] / noise[1]["mean_noise"]
  assert 4 < ratio < 16  # ~ P at fixed M (1/K)
  for r in noise.values():
    assert abs(r["mean_noise"] - r["predicted_mean_noise"]) < 5 * r["mean_noise_se"]


def test_mf_sweep_claims_only_where_the_paper_makes_them():
  """Fed the paper's own values they are reproduced: (0.9, 0.95) on 1 GPU rises (0.927 ->
  0.930), which a fixed 'higher MF hurts 1 worker' called not reproduced; W = 1 alone makes no
  'many workers' claim, and MFs outside the paper's grid make none."""
  import ml_collections
  from experiments import mf_sweep
  sgd = {(0.9, 1): 0.927, (0.95, 1): 0.930, (0.99, 1): 0.904,
         (0.9, 32): 0.876, (0.95, 32): 0.892, (0.99, 32): 0.907}
  rows = [{"optimizer": "sgd", "mf": mf, "workers": w, "seed": s, "test_accuracy": v + 1e-4 * s,
           "diverged": False} for (mf, w), v in sgd.items() for s in range(3)]

  def claims(mfs, workers):
    return mf_sweep._claims(ml_collections.ConfigDict(
        {"mfs": mfs, "workers": workers, "optimizers": ("sgd",)}), rows)

  for mfs in [(0.9, 0.95), (0.9, 0.99), (0.95, 0.99)]:
    got = claims(mfs, (1, 32))
    assert len(got) == 2 and all(v.startswith("reproduced") for v in got.values()), (mfs, got)
  assert list(claims((0.9, 0.95), (1,))) == [
      "sgd: acc(MF 0.95) - acc(MF 0.9) at W=1 > 0 (paper 0.93 vs 0.927 on 1 GPU)"]
  assert claims((0.0, 0.5), (1, 32)) == {}


def test_mf_batch_workers_batch_claim_takes_the_tables_sign():
  """SGD at W=1: batch 128 0.923 < batch 1024 0.927 in Table 2, yet 'larger batch hurts' was
  claimed; batch 32 vs 64 ties; Adam batch 96 is in no table: not testable."""
  import ml_collections
  from experiments import mf_batch_workers
  c = ml_collections.ConfigDict({"workers": (1,), "batches": (128, 1024), "optimizers": ("sgd",)})
  t = mf_batch_workers.PAPER_TABLES["sgd"]
  rows = [{"optimizer": "sgd", "global_batch": b, "workers": 1, "seed": s,
           "test_accuracy": t[b][0] + 1e-4 * s, "diverged": False}
          for b in (128, 1024) for s in range(3)]
  (key, verdict), = mf_batch_workers._claims(c, rows).items()
  assert key == ("sgd: acc(batch 128) - acc(batch 1024) at W=1 < 0 (larger batch helps; "
                 "paper 0.923 vs 0.927)") and verdict.startswith("reproduced")
  c.batches = (32, 64)
  assert list(mf_batch_workers._claims(c, []).values()) == [
      "not testable (the paper's table ties: no direction to test)"]
  c.optimizers, c.batches, c.workers = ("adam",), (96,), (1, 8)
  assert list(mf_batch_workers._claims(c, []).values()) == [
      "not testable (a cell outside the paper's table)"]


def test_a_diverged_seed_voids_a_seed000_claim_as_in_the_other_families():
  from experiments import _mf_common
  rows = [{"mf": mf, "seed": s, "test_accuracy": acc}
          for s, (a, b) in enumerate([(0.9, 0.8), (0.91, 0.8), (float("nan"), 0.8)])
          for mf, acc in ((0.99, a), (0.9, b))]
  d = _mf_common.paired_difference(rows, "test_accuracy", {"mf": 0.99}, {"mf": 0.9})
  assert d["n"] == 2 and d["excluded"] == 1
  assert _mf_common.claim_verdict(d, +1).startswith(
      "not reproduced at this scale (1 seed(s) diverged)")


def test_aggregate_means_the_finite_seeds_and_counts_the_diverged():
  """A cell's mean and sample std (ddof=1) are over its seeds that did not diverge, and the
  diverged one is counted: accuracies 0.5, nan (diverged), 0.7 give 0.6 ± 0.1414 (1/3)."""
  from experiments import _mf_common
  rows = [{"mf": 0.9, "seed": s, "test_accuracy": a, "diverged": d}
          for s, (a, d) in enumerate([(0.5, False), (float("nan"), True), (0.7, False)])]
  rows.append({"mf": 0.99, "seed": 0, "test_accuracy": 0.4, "diverged": False})
  agg = {a["mf"]: a for a in _mf_common.aggregate(rows, ["mf"], ["test_accuracy"])}
  a = agg[0.9]
  assert a["seeds"] == 3 and a["diverged"] == 1
  assert a["test_accuracy_mean"] == pytest.approx(0.6)
  assert a["test_accuracy_std"] == pytest.approx(math.sqrt(0.02))  # (0.1^2 + 0.1^2) / (2 - 1)
  assert _mf_common.cell_text(a, "test_accuracy") == "0.600 ± 0.141 (1/3 diverged)"
  # one seed: its value, with no spread shown (not "± 0.000")
  assert _mf_common.cell_text(agg[0.99], "test_accuracy") == "0.400"
  assert _mf_common.cell_text(None, "test_accuracy") == "skipped"


def test_seed000_claim_needs_the_papers_sign_and_two_sample_stds():
  """claim_verdict on paired differences: a clear difference of the wrong sign is not
  reproduced, nor are differences 1, 1.5, 3 (mean 1.83 > 1 sample std 1.04 but < 2)."""
  from experiments import _mf_common

  def diff(values_a, values_b):
    rows = [{"mf": mf, "seed": s, "test_accuracy": v}
            for mf, vals in ((0.99, values_a), (0.9, values_b)) for s, v in enumerate(vals)]
    return _mf_common.paired_difference(rows, "test_accuracy", {"mf": 0.99}, {"mf": 0.9})

  clear = diff([0.9, 0.91, 0.92], [0.5, 0.5, 0.5])
  assert clear["mean"] == pytest.approx(0.41) and clear["significant"]
  assert _mf_common.claim_verdict(clear, +1).startswith("reproduced: +0.4100 ± 0.0100 over 3")
  assert _mf_common.claim_verdict(clear, -1).startswith("not reproduced at this scale: +0.41")
  loose = diff([2.0, 2.5, 4.0], [1.0, 1.0, 1.0])
  assert not loose["significant"]
  assert _mf_common.claim_verdict(loose, +1).startswith("not reproduced at this scale")


def test_steps_for_rounds_to_the_nearest_whole_step():
  """Equal samples: the step count whose samples are nearest the budget (1,000 at batch 64:
  16 steps = 1,024 samples, nearer than 15 = 960), and at least one step."""
  from experiments import _mf_common
  assert _mf_common.steps_for(1000, 64) == 16
  assert _mf_common.steps_for(2000, 64) == 31  # 1,984 is nearer than 2,048
  assert _mf_common.steps_for(10, 64) == 1


def test_make_optimizer_is_the_named_algorithm_on_the_mean_gradient():
  """Each worker applies the seed's optimizer (SGD/NAG Alg. 1, Adam Alg. 2 with mf2) with the
  given lr and MF to the mean of the workers' gradients (SPEC: synchronous, same update
  everywhere); Adam's second factor defaults to 0.999 (SPEC). A dropped all-reduce, a
  swapped MF or a wrong default still trains, only to different numbers."""
  from _steps import worker_grid_trajectory  # tests/ is on sys.path
  from experiments import _mf_common
  offs = np.array([[[0.5, -1.0, 2.0], [-0.1, 0.3, 0.0]]])  # 2 workers; mean (0.2, -0.35, 1.0)
  mean = offs.mean(axis=1, keepdims=True)
  cases = [(("sgd", 0.1, 0.95), mfopt.mf_sgd(0.1, mf=0.95)),
           (("nag", 0.1, 0.95), mfopt.mf_nesterov(0.1, mf=0.95)),
           (("adam", 0.05, 0.8, 0.9), mfopt.mf_adam(0.05, mf1=0.8, mf2=0.9)),
           (("adam", 0.05, 0.8), mfopt.mf_adam(0.05, mf1=0.8, mf2=0.999))]
  for args, ref in cases:
    got = worker_grid_trajectory(_mf_common.make_optimizer(*args), offs)
    np.testing.assert_allclose(got[0, 0], got[0, 1], rtol=0, atol=0, err_msg=str(args))
    np.testing.assert_allclose(got[0, 0], worker_grid_trajectory(ref, mean)[0, 0], rtol=1e-5,
                               atol=1e-6, err_msg=str(args))


def test_run_cell_hands_fit_its_settings_and_records_a_divergence(monkeypatch):
  """A cell trains the optimizer it names with its lr, MF and Adam's second factor (mf2 0.9
  here, not the 0.999 default), logs at least once (log_every capped at a 10-step run's
  length), and a NonFiniteError becomes a diverged row with the planned global batch (4 x 8)
  and the cell's keys, so the grid goes on."""
  import types
  from experiments import _mf_common
  from mfopt import train
  calls = []

  def fit(**kw):
    calls.append(kw)
    raise train.NonFiniteError("non-finite loss at step 4\n...", step=4, workers=[0],
                               metric="loss", detected_at=5, checkpoint="none")

  monkeypatch.setattr(train, "fit", fit)
  row = _mf_common.run_cell(model=None, dataset=types.SimpleNamespace(), optimizer="adam",
                            learning_rate=0.01, mf=0.8, mf2=0.9, num_workers=4,
                            per_worker_batch=8, num_steps=10, seed=2, log_every=50,
                            progress=False, desc="x", train_set_loss=True)
  kw, = calls
  assert kw["log_every"] == 10 and kw["num_steps"] == 10 and kw["mesh"].devices.size == 4
  hyper = kw["tx"].init(np.zeros(2, np.float32))[1].hyperparams
  assert (float(hyper["learning_rate"]), float(hyper["mf1"]), float(hyper["mf2"])) == \
      pytest.approx((0.01, 0.8, 0.9))
  assert kw["run_info"] == {"optimizer": "adam", "learning_rate": 0.01, "mf": 0.8, "mf2": 0.9}
  assert row["diverged"] and row["diverged_at_step"] == 4
  assert row["error"] == "non-finite loss at step 4" and row["global_batch"] == 32
  assert math.isnan(row["test_accuracy"]) and math.isnan(row["train_set_loss"])
  assert (row["optimizer"], row["learning_rate"], row["mf"], row["seed"]) == ("adam", 0.01, 0.8, 2)
  assert row["mesh"] == "4 of 8 device(s) (W not a multiple of 8)"


def test_sweep_mf_splits_the_global_batch_and_curves_mean_the_seeds(tmp_path, monkeypatch):
  """sweep_mf runs every (MF, seed) at per-worker batch global / workers (64 / 4 = 16: equal
  global batch whatever W), logging each run's rows with its MF and seed; curves_by_mf then
  gives, per MF, the mean over seeds at each step: the seeds' losses 6 and 8 at step 1 give
  7, not the first seed's 6."""
  from experiments import _mf_common
  calls = []

  def cell(**kw):
    calls.append(kw)
    for step in (1, 2):
      kw["on_log"]({"step": step, "train_loss": kw["mf"] * 10 + step * (1 + 2 * kw["seed"])})
    return {"test_loss": 0.0, "test_accuracy": 0.5, "diverged": False}

  monkeypatch.setattr(_mf_common, "run_cell", cell)
  rows = _mf_common.sweep_mf(model=None, dataset=None, mfs=(0.5, 0.9), seeds=(0, 1),
                             learning_rate=0.1, num_workers=4, global_batch=64, num_steps=5,
                             log_every=1, progress=False, workdir=tmp_path)
  assert len(rows) == 4 and {kw["per_worker_batch"] for kw in calls} == {16}
  assert [(kw["mf"], kw["seed"]) for kw in calls] == [(0.5, 0), (0.5, 1), (0.9, 0), (0.9, 1)]
  curves = _mf_common.curves_by_mf(tmp_path)
  # MF 0.5: seed 0 -> 6, 7; seed 1 -> 8, 11 (step x 3): means 7, 9
  assert curves["MF 0.5"] == ([1, 2], [pytest.approx(7.0), pytest.approx(9.0)])
  assert curves["MF 0.9"][1] == [pytest.approx(11.0), pytest.approx(13.0)]


def test_bn_variance_verdict_names_the_formula_within_5_se():
  """A formula is supported when every |z| against it is < 5 (the printed eq. 8 judged at P > 1
  only, where it differs from M-1); both or neither within 5 SE is inconclusive, and the
  closest printed-formula agreement reported is over P > 1 (at P = 1 both formulas agree)."""
  from experiments import bn_variance

  def rows(zc, zp):
    return [{"P": p, "z_correct": a, "z_printed": b} for p, a, b in zip((1, 2, 4), zc, zp)]

  v = bn_variance._verdict(rows((0.5, -1.0, 4.0), (0.5, -12.0, -20.0)))
  assert v["supports"] == "correct" and "reject the printed eq. 8" in v["text"]
  assert v["min_abs_z_printed_P_gt_1"] == 12.0 and v["max_abs_z_correct"] == 4.0
  assert bn_variance._verdict(rows((0.5, 1.0, 2.0), (0.5, 1.0, 3.0)))["supports"] == "both"
  assert bn_variance._verdict(rows((0.5, 6.0, 2.0), (0.5, 9.0, 3.0)))["supports"] == "neither"
  assert bn_variance._verdict(rows((0.5, 6.0, 2.0), (0.5, 1.0, 3.0)))["supports"] == "printed"
  assert bn_variance._verdict(rows((0.5, 5.0, 2.0), (0.5, 9.0, 9.0)))["supports"] == "neither"


def test_bn_variance_pooled_se_and_noise_ratio_in_the_report(tmp_path):
  """The pooled SE of a mean over n seeds is sqrt(sum SE_i^2) / n, and the noise ratio column
  divides each P's noise by that at the smallest P (P = 1), whatever order the P are listed in:
  hand-built rows, noise 0.01 x P, so the ratio is P."""
  import types

  from experiments import bn_variance
  rs = [{"x": 1.0, "x_se": 0.3}, {"x": 3.0, "x_se": 0.4}]
  assert bn_variance._mean_se(rs, "x") == pytest.approx((2.0, 0.5 / 2))
  c = bn_variance.get_config(quick=True)
  c.workers = (2, 1, 4, 8)
  M = c.global_batch
  act = [{"seed": 0, "layer": "conv0", "P": p, "S_t": M - 1.0, "S_t_se": 0.1, "S_e": M - p,
          "S_e_se": 0.1, "S_a": p - 1.0, "S_a_se": 0.1, "delta2_B": (M - 1) / M}
         for p in c.workers]
  noise = [{"seed": 0, "layer": "conv0", "P": p, "mean_noise": 0.01 * p, "mean_noise_se": 1e-4,
            "var_noise": 0.1, "var_noise_se": 1e-3, "predicted_mean_noise": 0.01 * p}
           for p in c.workers]
  ds = types.SimpleNamespace(name="mnist1d", train=range(4000))
  verdict = {"text": "x"}
  bn_variance._write_report(c, tmp_path, ds, act, [dict(r, layer="gaussian") for r in act],
                            noise, verdict, 1.0)
  text = (tmp_path / "report.md").read_text()
  assert "mean noise / P=1" in text
  # S_e and S_a beside their expectations M - P and P - 1 (P = 2: 30 and 1)
  assert "| 30.00 (exp. 30) | 1.00 (exp. 1) |" in text
  ratios = {int(m[0]): float(m[1]) for m in re.findall(
      r"\| conv0 \| (\d+) \| \d+ \| [^|]+\| [^|]+\| ([0-9.]+) \|",
      text.split("What per-worker BN changes")[1])}
  assert ratios == {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}


def test_mf_lstm_full_grid_makes_table_4s_three_claims():
  """On the paper's MF grid the claims are: train ppl at 0.975 below the smallest MF, validation
  ppl at the largest MF above 0.95, and train ppl at the largest above 0.975; a grid without
  0.975 takes the largest MF for the first. A claim on the wrong metric or MF pair would be
  judged against another line of Table 4."""
  import ml_collections
  from experiments import mf_lstm
  rows = [{"mf": mf, "seed": s, "train_perplexity": t + 0.01 * s, "validation_perplexity": v}
          for mf, (t, v) in mf_lstm.PAPER_TABLE4.items() for s in range(3)]
  claims = mf_lstm._claims(ml_collections.ConfigDict({"mfs": (0.99, 0.9, 0.975, 0.95)}), rows)
  assert list(claims) == [
      "train ppl(MF 0.975) - train ppl(MF 0.9) < 0 (paper 13.4 vs 29.93)",
      "val ppl(MF 0.99) - val ppl(MF 0.95) > 0 (paper 173.88 vs 155.31)",
      "train ppl(MF 0.99) - train ppl(MF 0.975) > 0 (paper 17.84 vs 13.4)"]
  assert all(v.startswith("reproduced") for v in claims.values())
  # the same rows with the validation column reversed: only the validation claim fails
  flipped = [dict(r, validation_perplexity=-r["validation_perplexity"]) for r in rows]
  claims = mf_lstm._claims(ml_collections.ConfigDict({"mfs": (0.9, 0.95, 0.975, 0.99)}), flipped)
  assert [v.startswith("reproduced") for v in claims.values()] == [True, False, True]
  assert list(mf_lstm._claims(ml_collections.ConfigDict({"mfs": (0.9, 0.95, 0.99)}), rows)) == [
      "train ppl(MF 0.99) - train ppl(MF 0.9) < 0 (paper 17.84 vs 29.93)",
      "val ppl(MF 0.99) - val ppl(MF 0.95) > 0 (paper 173.88 vs 155.31)"]


def test_mf_lstm_report_states_the_train_perplexity_window(tmp_path, monkeypatch):
  """The train perplexity is of the last logging window: with 10 steps logged every 5, its last
  5 steps (a window of steps % log_every would be 0 steps); perplexities are exp of the losses.
  Hand-built rows, no training."""
  import types

  from experiments import _mf_common
  from experiments import mf_lstm
  from mfopt import data as data_lib
  from mfopt import report as report_lib
  ds = types.SimpleNamespace(name="textcorpus", num_classes=20, train=range(640), test=range(64),
                             meta={})
  seen = {}

  def fake_sweep(*, mfs, seeds, num_steps, log_every, **kw):
    seen.update(num_steps=num_steps, log_every=log_every)
    return [{"mf": mf, "seed": s, "final_train_loss": 1.0 + mf, "test_loss": 2.0,
             "diverged": False, "error": None, "optimizer": "sgd", "num_workers": 8,
             "per_worker_batch": 8} for mf in mfs for s in seeds]

  monkeypatch.setattr(data_lib, "load", lambda name, **kw: ds)
  monkeypatch.setattr(_mf_common, "sweep_mf", fake_sweep)
  monkeypatch.setattr(_mf_common, "curves_by_mf", lambda workdir: {})
  monkeypatch.setattr(report_lib, "plot_curves", lambda *a, **k: None)
  _, c = runner.prepare("mf_lstm", quick=True, overrides=["epochs=1.0", "log_every=5"])
  out = mf_lstm.run(c, tmp_path)
  assert seen == {"num_steps": 10, "log_every": 5} and out["steps"] == 10  # 640 / 64
  text = (tmp_path / "report.md").read_text()
  assert "its last 5 step(s) x 64 sequences (log_every=5)" in text
  cell = {a["mf"]: a for a in out["cells"]}
  assert cell[0.9]["train_perplexity_mean"] == pytest.approx(math.exp(1.9))
  assert cell[0.99]["validation_perplexity_mean"] == pytest.approx(math.exp(2.0))
  # MFs off Table 4's grid: no claim, and the report names the grid and this run's MFs
  _, c = runner.prepare("mf_lstm", quick=True, overrides=["mfs=(0.5,0.3)"])
  assert mf_lstm.run(c, tmp_path)["claims"] == {}
  assert (f"- no claim testable: Table 4's claims compare two different MFs of its grid "
          f"{tuple(mf_lstm.PAPER_TABLE4)}; this run has mfs=(0.3, 0.5)"
          in (tmp_path / "report.md").read_text())


def test_mf_sweep_one_gpu_claim_is_sgds_and_both_mfs_must_be_the_papers():
  """Fig. 5's 1-GPU statement is about SGD only (NAG gets the many-workers claim alone), and
  an MF pair with either value outside the paper's grid makes no claim (not only both)."""
  import ml_collections
  from experiments import mf_sweep
  rows = [{"optimizer": o, "mf": mf, "workers": w, "seed": s, "test_accuracy": 0.9,
           "diverged": False} for o in ("sgd", "nag") for mf in (0.5, 0.9, 0.99)
          for w in (1, 8) for s in range(2)]

  def claims(mfs):
    return mf_sweep._claims(ml_collections.ConfigDict(
        {"mfs": mfs, "workers": (1, 8), "optimizers": ("sgd", "nag")}), rows)

  assert [k.split(" (")[0] for k in claims((0.9, 0.99))] == [
      "sgd: acc(MF 0.99) - acc(MF 0.9) at W=8 > 0", "sgd: acc(MF 0.99) - acc(MF 0.9) at W=1 < 0",
      "nag: acc(MF 0.99) - acc(MF 0.9) at W=8 > 0"]
  assert claims((0.5, 0.99)) == {} and claims((0.9, 0.5)) == {}


def test_mf_sweep_adam_lr_overrides_adams_lr_only(tmp_path, monkeypatch):
  """adam_lr > 0 sets Adam's lr; SGD and NAG keep the linear-scaling lr 0.05 x 128 / 128 (an
  override applied to every optimizer would change the SGD runs the paper's claims are on).
  Hand-built cells, no training."""
  import types

  from experiments import _mf_common
  from experiments import mf_sweep
  from mfopt import data as data_lib
  from mfopt import report as report_lib
  lrs = {}

  def fake_cell(*, optimizer, learning_rate, mf, num_workers, per_worker_batch, seed, **kw):
    lrs[optimizer] = learning_rate
    return {"optimizer": optimizer, "mf": mf, "seed": seed, "test_accuracy": 0.5,
            "final_train_loss": 1.0, "diverged": False, "error": None,
            "num_workers": num_workers, "per_worker_batch": per_worker_batch}

  monkeypatch.setattr(data_lib, "load_sized", lambda name, n, m: types.SimpleNamespace(
      name=name, num_classes=10, train=range(n), test=range(m)))
  monkeypatch.setattr(_mf_common, "run_cell", fake_cell)
  monkeypatch.setattr(report_lib, "plot_curves", lambda *a, **k: None)
  _, c = runner.prepare("mf_sweep", quick=True, overrides=["adam_lr=0.003"])
  out = mf_sweep.run(c, tmp_path)
  assert lrs == {"sgd": 0.05, "nag": 0.05, "adam": 0.003} == out["learning_rates"]
  # MFs off the paper's grid: no claim, and the report says what the claims need
  _, c = runner.prepare("mf_sweep", quick=True, overrides=["mfs=(0.5,0.6)"])
  assert mf_sweep.run(c, tmp_path)["claims"] == {}
  text = (tmp_path / "report.md").read_text()
  assert "- no claim testable: §4.3.1's claims compare the lowest and highest MF run" in text
  assert f"(Fig. 5's one-GPU values); this run has mfs=(0.5, 0.6), workers={tuple(c.workers)}" \
      in text
