"""Killed-and-resumed runs equal uninterrupted ones bit for bit; the NaN guard; runner resume.

The SIGKILL test runs training in a child process (this file, ``child_main``),
kills it at random steps (twice for SGD), resumes from the same checkpoint directory, and
compares the final worker-stacked state and every history row with an
uninterrupted in-process run. Adding an algorithm is one entry in
``ALGORITHMS``. The asynchronous simulator is checkpointed through
``mfopt.checkpoint.run_resumable`` and tested the same way.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import zlib

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import checkpoint, data, models, parallel, report, runner, train

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
NUM_WORKERS, PER_WORKER_BATCH, NUM_STEPS, LOG_EVERY = 8, 8, 60, 5
LR = 0.05


def _sync_sgd():
  return optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(LR, momentum=0.9))


def _adpsgd():
  from mfopt import averaging  # issue 4
  period = averaging.adpsgd_period(learning_rate=LR, sampling_steps=12, p_init=2)
  return averaging.periodic_averaging(optax.sgd(LR, momentum=0.9), mfopt.WORKER_AXES, period,
                                      trace_length=64)


def _adpsgd_metrics():
  from mfopt import averaging
  return {"period": lambda s: averaging.averaging_metrics(s.opt_state)["period"]}


# name -> (transform factory, extra_metrics factory, number of SIGKILLs before the final
# resume): every algorithm that trains through train.fit gets a row. The asynchronous simulator
# (issue 5, mfopt.sim) has its own event loop; its resume test is further down.
ALGORITHMS = {
    "sync_sgd": (_sync_sgd, dict, 2),
    "adpsgd": (_adpsgd, _adpsgd_metrics, 1),  # one kill keeps the suite within its time budget
}


def _setup(algo):
  dataset = data.load("digits")
  model = models.get_model("mlp", hidden=(16,), num_classes=dataset.num_classes)
  make_tx, make_metrics, _ = ALGORITHMS[algo]
  return dict(model=model, tx=make_tx(), dataset=dataset, num_workers=NUM_WORKERS,
              per_worker_batch=PER_WORKER_BATCH, num_steps=NUM_STEPS, log_every=LOG_EVERY,
              seed=1, progress=False, extra_metrics=make_metrics())


def child_main(algo, ckpt_dir, out, pause):
  """Runs in the child: fit with checkpoints, prints each logged step, saves the final state."""
  jax.config.update("jax_num_cpu_devices", 8)
  runner.enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE") or ROOT / ".jax_cache")

  def on_log(row):
    print(f"STEP {row['step']}", flush=True)
    time.sleep(pause)  # gives the parent time to kill near the step it chose

  result = train.fit(**_setup(algo), mesh=parallel.make_mesh(), checkpoint_dir=ckpt_dir,
                     keep_checkpoints=2, on_log=on_log)
  leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(result.state))]
  np.savez(out + ".npz", *leaves)
  pathlib.Path(out + ".json").write_text(json.dumps(result.history))


def _spawn(algo, ckpt_dir, out, pause=0.15):
  code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_resume; "
          f"test_resume.child_main({algo!r}, {str(ckpt_dir)!r}, {str(out)!r}, {pause})")
  return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _kill_at(proc, step):
  """Reads the child's STEP lines; SIGKILLs it once it reports ``step``. Returns the last seen."""
  seen = 0
  for line in proc.stdout:
    if line.startswith("STEP "):
      seen = int(line.split()[1])
      if seen >= step:
        proc.send_signal(signal.SIGKILL)
        break
  proc.wait(timeout=60)
  return seen


def _strip(history):
  return [{k: v for k, v in row.items() if k != "train_time_s"} for row in history]


@pytest.fixture(scope="module")
def reference():
  cache = {}

  def get(algo):
    if algo not in cache:
      cache[algo] = train.fit(**_setup(algo), mesh=parallel.make_mesh())
    return cache[algo]
  return get


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_sigkill_then_resume_is_bitwise_identical(algo, reference, tmp_path):
  rng = np.random.default_rng(zlib.crc32(algo.encode()))  # random steps, reproducible
  ckpt_dir = tmp_path / "ckpt"
  out = str(tmp_path / "final")
  num_kills = ALGORITHMS[algo][2]
  targets = sorted(rng.choice(np.arange(1, NUM_STEPS // LOG_EVERY - 1), num_kills, replace=False))
  kills = []
  for target in (int(t) * LOG_EVERY for t in targets):
    proc = _spawn(algo, ckpt_dir, out)
    seen = _kill_at(proc, target)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    kills.append(seen)
  assert not os.path.exists(out + ".npz")  # no killed run finished
  assert kills == sorted(kills) and kills[-1] < NUM_STEPS
  proc = _spawn(algo, ckpt_dir, out, pause=0.0)
  stdout, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  # It resumed rather than restarting (which would end equal too): the first step it logs
  # follows a checkpoint of the killed runs (saved at least at the step before the last kill).
  logged = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("STEP ")]
  assert kills[-1] > LOG_EVERY and logged and logged[0] >= kills[-1], (kills, logged)

  ref = reference(algo)
  got_history = json.loads(pathlib.Path(out + ".json").read_text())
  assert _strip(got_history) == _strip(ref.history)
  assert [r["step"] for r in got_history] == list(range(LOG_EVERY, NUM_STEPS + 1, LOG_EVERY))
  with np.load(out + ".npz") as z:
    got = [z[f"arr_{i}"] for i in range(len(z.files))]
  want = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(ref.state))]
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)  # bit for bit (NaN diagnostics compare equal too)
  # The params moved, so equality is not trivially about the initial state.
  assert ref.history[-1]["train_loss"] < ref.history[0]["train_loss"]
  if algo == "adpsgd":  # the period trace is part of the state and of the history
    from mfopt import averaging
    trace = averaging.sync_trace(ref.state.opt_state)
    assert len(trace["period"]) >= 5
    assert [r["period"] for r in got_history] == [r["period"] for r in ref.history]


# ---------------------------------------------------------------------------------------------
# NaN guard


def inject_nan(at_step, worker):
  """Test transform: turns worker ``worker``'s update into NaN at step ``at_step`` (0-based)."""
  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jax.numpy.zeros([], jax.numpy.int32))

  def update(updates, state, params=None):
    del params
    index = jax.lax.axis_index(mfopt.WORKER_AXES)
    poison = (state.count == at_step) & (index == worker)
    updates = jax.tree.map(lambda u: jax.numpy.where(poison, jax.numpy.nan, u), updates)
    return updates, optax.ScaleByScheduleState(count=state.count + 1)

  return optax.GradientTransformation(init, update)


def test_nan_gradient_on_one_worker_stops_run_and_keeps_checkpoint(tmp_path, capsys):
  dataset = data.load("digits")
  model = models.get_model("mlp", hidden=(16,), num_classes=dataset.num_classes)
  bad_step0, bad_worker, log_every = 23, 5, 10  # 0-based step 23 is step 24 counted from 1
  # The gradient all-reduce comes first, so the NaN stays on one worker (a local fault).
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), inject_nan(bad_step0, bad_worker),
                   optax.sgd(LR))
  ckpt_dir = tmp_path / "ckpt"
  with pytest.raises(train.NonFiniteError) as info:
    train.fit(model=model, tx=tx, dataset=dataset, num_workers=8, per_worker_batch=8,
              num_steps=100, log_every=log_every, progress=False, checkpoint_dir=ckpt_dir,
              keep_checkpoints=5)
  e = info.value
  assert e.step == bad_step0 + 1 and e.workers == [bad_worker] and e.metric == "update_norm"
  assert 0 <= e.detected_at - e.step < log_every  # within one logging interval
  assert e.detected_at == 30
  message = str(e)
  assert f"step {bad_step0 + 1}" in message and f"[{bad_worker}]" in message
  assert f"step 20 at {ckpt_dir.absolute() / '20'}" in message
  assert isinstance(e, FloatingPointError)
  # Only the checkpoints before the bad step exist, and the last one restores, finite and intact.
  ckpt = checkpoint.RunCheckpointer(ckpt_dir, keep=5, allow_mismatch=True)  # any fingerprint
  assert ckpt.steps() == [10, 20]
  mesh = parallel.make_mesh()
  abstract = train.init_train_state(model, tx, dataset.train.get(np.arange(8), None)["x"],
                                    num_workers=8, mesh=mesh)
  restored = ckpt.restore_latest(abstract)
  assert restored.step == 20 and len(restored.meta["history"]) == 2
  for leaf in jax.tree.leaves(jax.device_get(restored.state)):
    if np.asarray(leaf).dtype.kind == "f":
      assert np.isfinite(leaf).all()


def test_check_finite_names_first_step_and_workers():
  ok = {"loss": np.ones(4, np.float32), "update_norm": np.ones(4, np.float32)}
  bad = {"loss": np.array([1, np.inf, 1, np.nan], np.float32), "update_norm": np.ones(4)}
  train.check_finite([ok, ok], 11, detected_at=12)  # no error
  with pytest.raises(train.NonFiniteError, match=r"non-finite loss at step 13 on worker\(s\) "
                     r"\[1, 3\] \(detected at step 14\).*last good checkpoint: step 10 at /x"):
    train.check_finite([ok, ok, bad, bad], 11, detected_at=14, checkpoint="step 10 at /x")


def test_check_finite_sees_bfloat16_metrics():
  """bfloat16's NumPy kind is 'V', not 'f': a bf16 loss must still be checked."""
  import ml_dtypes
  bad = {"loss": np.array([1, np.nan], ml_dtypes.bfloat16), "step": np.array([3, 3], np.int32)}
  with pytest.raises(train.NonFiniteError, match=r"non-finite loss at step 5 on worker\(s\) \[1\]"):
    train.check_finite([bad], 5, detected_at=5)


def _small_fit(num_steps, **kw):
  dataset = data.load("digits")
  model = models.get_model("mlp", hidden=(8,), num_classes=dataset.num_classes)
  return train.fit(model=model, tx=_sync_sgd(), dataset=dataset, num_workers=8, per_worker_batch=4,
                   num_steps=num_steps, log_every=2, seed=2, progress=False,
                   mesh=parallel.make_mesh(), **kw)


def test_policy_interval_rounds_up_to_each_runs_logging_interval(tmp_path):
  """The runner's --checkpoint-every applies to sub-runs that log at other intervals: every=3
  with log_every=2 saves at steps 4 and 8 and at the end (it used to raise ValueError
  mid-experiment); an explicit fit(checkpoint_every=3) is still refused."""
  with checkpoint.auto_checkpoint(tmp_path, every=3, keep=10):
    _small_fit(9)
  (run,) = list(tmp_path.iterdir())
  assert sorted(int(p.name) for p in run.iterdir() if p.name.isdigit()) == [4, 8, 9]
  with pytest.raises(ValueError, match="checkpoint_every must be a positive multiple of "
                     "log_every=2, got 3"):
    _small_fit(9, checkpoint_dir=tmp_path / "explicit", checkpoint_every=3)


def test_fit_fingerprints_the_models_settings_and_reads_older_checkpoints(tmp_path):
  """A model setting that keeps the shapes (dtype) resumed another run's checkpoint silently:
  the fingerprint named only the class. It now holds the model's fields; a checkpoint written
  before that field existed still resumes (model_settings is not compared against it)."""
  import jax.numpy as jnp
  _small_fit(2, checkpoint_dir=tmp_path)
  dataset = data.load("digits")
  bf16 = models.get_model("mlp", hidden=(8,), num_classes=dataset.num_classes,
                          dtype=jnp.bfloat16)
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"model_settings\.dtype: \(absent\) -> 'bfloat16'"):
    train.fit(model=bf16, tx=_sync_sgd(), dataset=dataset, num_workers=8, per_worker_batch=4,
              num_steps=2, log_every=2, seed=2, progress=False, mesh=parallel.make_mesh(),
              checkpoint_dir=tmp_path)
  (step,) = checkpoint.RunCheckpointer(tmp_path).steps()
  now = checkpoint.RunCheckpointer(tmp_path).read_meta(step)["fingerprint"]
  assert now["model_settings"]["hidden"] == [8]
  ckpt = checkpoint.RunCheckpointer(tmp_path, fingerprint=now)
  old = {k: v for k, v in now.items() if k != "model_settings"}
  ckpt.check_fingerprint({"fingerprint": old}, step)  # no ConfigMismatchError
  with pytest.raises(checkpoint.ConfigMismatchError, match=r"seed: 1 -> 2"):
    ckpt.check_fingerprint({"fingerprint": {**old, "seed": 1}}, step)  # the others still are


def test_finished_run_extended_with_allow_mismatch_trains_on(tmp_path):
  """fit(num_steps=10, allow_mismatch=True) on a finished 6-step checkpoint continues to step 10
  (it returned the 6-step result unchanged) and equals an uninterrupted 10-step run; a
  num_steps below the checkpoint's step is refused. The timings resume from the checkpoint's:
  compile_s is the first run's (the resumed run compiles again, uncounted) and train_s adds the
  resumed steps' time to the saved one (here on a fake clock that ticks 1 s per step)."""
  first = _small_fit(6, checkpoint_dir=tmp_path)
  import types
  now = [0.0]
  real_wait = train.wait_for_old_steps

  def tick_per_step(window, limit=None):  # fit calls this once per dispatched step
    now[0] += 1.0
    return real_wait(window, limit)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    patch.setattr(train, "wait_for_old_steps", tick_per_step)
    longer = _small_fit(10, checkpoint_dir=tmp_path, allow_mismatch=True)
  assert longer.summary["compile_s"] == first.summary["compile_s"] > 0
  assert longer.summary["train_s"] == pytest.approx(first.summary["train_s"] + 4.0, abs=1e-9)
  straight = _small_fit(10)
  assert longer.summary["steps"] == 10 and longer.history[-1]["step"] == 10
  # the same rows, except that the 6-step run evaluated the test set at its last step, 6
  drop = lambda h: [{k: v for k, v in r.items() if not k.startswith("test_")} for r in h]  # noqa: E731
  assert drop(_strip(longer.history)) == drop(_strip(straight.history))
  assert longer.history[-1]["test_accuracy"] == straight.history[-1]["test_accuracy"]
  for a, b in zip(jax.tree.leaves(longer.state.params), jax.tree.leaves(straight.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"holds a run at step 10, past num_steps=4"):
    _small_fit(4, checkpoint_dir=tmp_path, allow_mismatch=True)


def test_interrupted_run_shortened_to_its_last_save_evaluates_it(tmp_path):
  """Killed after its step-4 save, rerun with num_steps=4 (allow_mismatch): nothing to train,
  but the summary read the final evaluation the step-4 row never had (KeyError 'test_loss',
  an off-default review). It evaluates the restored state: an uninterrupted 4-step run's
  result, without building a train step it would not run. An explicit keep_checkpoints beats
  the auto_checkpoint policy's keep (it was silently replaced by it), as an explicit
  checkpoint_every does."""

  class Stop(Exception):
    pass

  def stop_at(step):
    def on_log(row):
      if row["step"] == step:
        raise Stop
    return on_log

  with pytest.raises(Stop):
    _small_fit(10, checkpoint_dir=tmp_path / "a", checkpoint_every=4, on_log=stop_at(6))

  def no_step(*args, **kwargs):
    raise AssertionError("a resume with nothing to train built (and compiled) a train step")

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(train, "make_train_step", no_step)
    short = _small_fit(4, checkpoint_dir=tmp_path / "a", allow_mismatch=True)
  straight = _small_fit(4)
  assert short.summary["steps"] == 4 and short.history[-1]["step"] == 4
  assert short.summary["lowering"] == straight.summary["lowering"]
  assert short.summary["test_loss"] == straight.summary["test_loss"]
  assert short.history[-1]["test_accuracy"] == straight.history[-1]["test_accuracy"]
  with checkpoint.auto_checkpoint(tmp_path / "b", every=2, keep=2):
    _small_fit(8, keep_checkpoints=3)
  (run,) = list((tmp_path / "b").iterdir())
  assert sorted(int(p.name) for p in run.iterdir() if p.name.isdigit()) == [4, 6, 8]


def test_diverged_summary_has_a_finished_runs_keys():
  """The row experiments record for a diverged cell has exactly a finished fit's summary keys
  (plus the divergence), so tables and runs.json mix the two; no value comes from the bad run."""
  finished = _small_fit(2).summary
  dataset = data.load("digits")
  model = models.get_model("mlp", hidden=(8,), num_classes=dataset.num_classes)
  tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), inject_nan(2, 1), optax.sgd(LR))
  with pytest.raises(train.NonFiniteError) as info:
    train.fit(model=model, tx=tx, dataset=dataset, num_workers=8, per_worker_batch=4,
              num_steps=6, log_every=2, progress=False, mesh=parallel.make_mesh())
  s = train.diverged_summary(info.value, num_steps=6, num_workers=8, per_worker_batch=4)
  assert set(s) == set(finished) | {"diverged", "error", "diverged_at_step"}
  assert s["diverged"] is True and s["diverged_at_step"] == 3
  assert s["error"] == str(info.value).splitlines()[0] and "step 3" in s["error"]
  assert (s["steps"], s["num_workers"], s["per_worker_batch"], s["global_batch"]) == (6, 8, 4, 32)
  assert s["lowering"] is None  # not known from the error
  kept = {"steps", "num_workers", "per_worker_batch", "global_batch", "diverged", "error",
          "diverged_at_step", "lowering"}
  assert all(np.isnan(v) for k, v in s.items() if k not in kept), s


def test_eval_every_must_be_a_multiple_of_log_every():
  with pytest.raises(ValueError, match=r"eval_every must be a multiple of log_every=2.*got 3"):
    _small_fit(6, eval_every=3)


# ---------------------------------------------------------------------------------------------
# Runner: --workdir resume, finished runs skipped, a different config refused

QUICK = ["datasets=digits", "models=mlp", "num_steps=20", "log_every=5", "progress=false",
         "algorithms=('sync SGD m=0.9 (optax)', 'sync Adam (optax)')",
         "sim_runs=()"]  # train.fit runs only: the simulated rows resume via run_resumable


def test_runner_resumes_skips_finished_runs_and_refuses_other_config(tmp_path, capsys):
  workdir = tmp_path / "run"
  first = runner.run_experiment("quickstart", quick=True, workdir=workdir, overrides=QUICK,
                                checkpoint_every=5)
  assert first["resumed"] is False

  def metric_rows():
    rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "train_time_s"} for r in rows]

  rows_first = metric_rows()
  runs = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  assert runs == ["000-digits_sync_SGD_m=0.9_optax", "001-digits_sync_Adam_optax"]
  # Simulate a crash during the second run: drop its last two checkpoints.
  second = workdir / "checkpoints" / runs[1]
  for step in ("20", "15"):
    import shutil
    shutil.rmtree(second / step)
  again = runner.run_experiment("quickstart", quick=True, workdir=workdir,
                                overrides=QUICK + ["progress=true"], checkpoint_every=5)
  assert again["resumed"] is True
  # Both attempts' wall times are in the summary (it used to hold the last attempt's only).
  assert first["attempts"] == 1 and first["wall_time_all_attempts_s"] == first["wall_time_s"]
  assert again["attempts"] == 2 and not again["wall_time_all_attempts_is_lower_bound"]
  assert again["wall_time_all_attempts_s"] == pytest.approx(
      first["wall_time_s"] + again["wall_time_s"], rel=1e-12)
  # progress (display only) may change between the runs: QUICK sets it false, this run true.
  # The resumed steps were logged again; metrics.jsonl still holds each row once, as an
  # uninterrupted run's does (wall-clock times aside).
  assert metric_rows() == rows_first and len(rows_first) > 4
  for a, b in zip(first["rows"], again["rows"]):
    for key in ("test_accuracy", "test_loss", "final_train_loss", "all_reduces"):
      assert a[key] == b[key], key
  # The finished run was not trained again: its saved result, timings included, came back.
  assert first["rows"][0]["train_s"] == again["rows"][0]["train_s"]
  assert sorted(p.name for p in second.iterdir() if p.name.isdigit()) == ["15", "20"]
  with pytest.raises(runner.ConfigError, match=r"differing fields \(checkpoint -> now\): "
                     r"config.num_steps: 20 -> 25"):
    runner.run_experiment("quickstart", quick=True, workdir=workdir, overrides=QUICK + ["num_steps=25"])
  # The CLI says the same and exits 2 before training anything.
  code = runner.main(["quickstart", "--quick", "--workdir", str(workdir), *QUICK, "seed=3"])
  assert code == 2 and "config.seed: 0 -> 3" in capsys.readouterr().err
  # An attempt that died (no wall time recorded) counts up to its last write: here the
  # metrics log, touched 40 s after the attempt started.
  attempts = json.loads((workdir / runner.ATTEMPTS).read_text())
  killed = time.time() - 1000
  attempts.append({"started": killed, "wall_time_s": None})
  (workdir / runner.ATTEMPTS).write_text(json.dumps(attempts))
  for f in [workdir / "metrics.jsonl", *(workdir / "checkpoints").rglob("*")]:
    os.utime(f, (killed + 40, killed + 40))
  # --allow-config-change: the finished runs keep their (seed-0) results, the differing fields
  # are printed, and config.json records the allowed change (it used to be overwritten with
  # no trace of the old values).
  allowed = runner.run_experiment("quickstart", quick=True, workdir=workdir,
                                  overrides=QUICK + ["seed=3"], allow_config_change=True)
  assert "seed: 0 -> 3" in capsys.readouterr().err
  assert allowed["attempts"] == 4 and allowed["wall_time_all_attempts_is_lower_bound"]
  closed = json.loads((workdir / runner.ATTEMPTS).read_text())[2]
  assert closed["interrupted"] and closed["wall_time_at_least_s"] == pytest.approx(40, abs=1e-3)
  assert allowed["wall_time_all_attempts_s"] == pytest.approx(
      first["wall_time_s"] + again["wall_time_s"] + 40 + allowed["wall_time_s"], abs=1e-3)
  # An attempt that fails (here: the checkpoints are seed 0's) is recorded with its time.
  capsys.readouterr()
  cli = ["quickstart", "--quick", "--workdir", str(workdir), *QUICK, "seed=3"]
  assert runner.main(cli) == 2
  err = capsys.readouterr().err
  assert "seed: 0 -> 3" in err, err
  failed = json.loads((workdir / runner.ATTEMPTS).read_text())[4]
  assert "ConfigMismatchError" in failed["failed"] and failed["wall_time_s"] >= 0
  assert runner.main(cli + ["--allow-config-change"]) == 0
  assert re.search(r"quickstart: done in [0-9.]+ s \(6 attempts, at least [0-9.]+ s in all\)",
                   capsys.readouterr().out)
  assert allowed["rows"][0]["test_accuracy"] == first["rows"][0]["test_accuracy"]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["config"]["seed"] == 3
  assert [c["changes"] for c in saved[runner.ALLOWED_CHANGES]] == [["config.seed: 0 -> 3"]]
  # The summary and the report say so (the report showed seed 3 over seed-0 results, unlabelled).
  assert [c["changes"] for c in allowed[runner.ALLOWED_CHANGES]] == [["config.seed: 0 -> 3"]]
  text = (workdir / "report.md").read_text()
  assert "Config changed while this workdir's runs were under way" in text
  assert text.count("config.seed: 0 -> 3") == 1
  # No flag lets another experiment or preset write here.
  for other, quick in (("mf_mlp", True), ("quickstart", False)):
    with pytest.raises(runner.ConfigError, match=r"a workdir holds one experiment and preset"):
      runner.run_experiment(other, quick=quick, workdir=workdir, allow_config_change=True)
  # A later run that rewrites config.json (here: no checkpoints left, same config, no flag)
  # keeps that record.
  import shutil
  shutil.rmtree(workdir / "checkpoints")
  runner.run_experiment("quickstart", quick=True, workdir=workdir, overrides=QUICK + ["seed=3"])
  kept = json.loads((workdir / "config.json").read_text())
  assert [c["changes"] for c in kept[runner.ALLOWED_CHANGES]] == [["config.seed: 0 -> 3"]]


def test_metrics_rows_recomputed_under_an_allowed_config_change_replace_the_old_ones(tmp_path):
  """--allow-config-change after a kill: the rows the killed attempt logged past its last
  checkpoint belong to the old config's trajectory; the recomputed rows replace them (the file
  kept the old row at step 18, and its curve mixed the two trajectories)."""
  path = tmp_path / "metrics.jsonl"
  log = report.JsonlWriter(path)
  for step, loss in ((6, 2.3), (12, 2.1), (18, 1.94)):
    log({"algorithm": "a", "step": step, "loss": loss})
  report.JsonlWriter(path)({"algorithm": "a", "step": 18, "loss": 1.95})  # an ordinary resume
  assert [r["loss"] for r in report.read_jsonl(path)] == [2.3, 2.1, 1.94]  # keeps the first
  with report.recomputed_rows_replace():
    resumed = report.JsonlWriter(path)
    resumed({"algorithm": "a", "step": 18, "loss": 1.95})  # no restore point said: from 18 on
    resumed({"algorithm": "a", "step": 24, "loss": 1.9})
  assert report.read_jsonl(path) == [{"algorithm": "a", "step": s, "loss": v}
                                     for s, v in ((6, 2.3), (12, 2.1), (18, 1.95), (24, 1.9))]
  # The change shortened the logging interval (or the run): the old rows past the checkpoint
  # (12) go even where the new run logs nothing (18, 24), and the new rows follow in order.
  report.JsonlWriter(path)({"algorithm": "b", "step": 6, "loss": 3.0})
  with report.recomputed_rows_replace():
    resumed = report.JsonlWriter(path)
    report.note_run_start(12)  # what fit says after restoring step 12
    resumed({"algorithm": "a", "step": 15, "samples": 120, "loss": 1.97})
    resumed({"algorithm": "a", "step": 20, "samples": 160, "loss": 1.96})
  assert [(r["algorithm"], r["step"]) for r in report.read_jsonl(path)] == [
      ("a", 6), ("a", 12), ("b", 6), ("a", 15), ("a", 20)]  # b's rows are another run's
  # fit's rows carry samples; fit's restore point does not: the row at the checkpoint's own
  # step stays (it was dropped as "(12, 96) past (12, -1)"). The simulator's does.
  path.write_text("".join(json.dumps({"run": "f", "step": s, "samples": 8 * s}) + "\n"
                          for s in (6, 12, 18)))
  with report.recomputed_rows_replace():
    report.note_run_start(12)
    report.JsonlWriter(path)({"run": "f", "step": 18, "samples": 144, "loss": 1.0})
  assert [r["step"] for r in report.read_jsonl(path)] == [6, 12, 18]
  path.write_text("".join(json.dumps({"run": "s", "server_step": 4, "samples": n}) + "\n"
                          for n in (30, 60, 90)))
  with report.recomputed_rows_replace():
    report.note_run_start(4, 60)  # restored after the 60th sample of server step 4
    report.JsonlWriter(path)({"run": "s", "server_step": 5, "samples": 100})
  assert [r["samples"] for r in report.read_jsonl(path)] == [30, 60, 100]


def test_metrics_log_resumes_after_a_torn_last_line(tmp_path, capsys):
  """A kill (or a full disk) in the middle of an append leaves half a row: readers skip it,
  and the resumed writer cuts it off before appending (it used to raise JSONDecodeError on
  every later resume)."""
  path = tmp_path / "metrics.jsonl"
  log = report.JsonlWriter(path)
  log({"step": 1, "loss": 0.5})
  log({"step": 2, "loss": 0.4})
  with path.open("a") as f:
    f.write('{"step": 3, "lo')
  assert report.read_jsonl(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4}]
  resumed = report.JsonlWriter(path)
  resumed({"step": 2, "loss": 0.4})  # logged again after the resume: not written twice
  resumed({"step": 3, "loss": 0.3})
  assert report.read_jsonl(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4},
                                     {"step": 3, "loss": 0.3}]
  assert "dropping an unfinished last line" in capsys.readouterr().err
  path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # damage in the middle is an error
  with pytest.raises(json.JSONDecodeError):
    report.read_jsonl(path)
  path.write_text('{"step": 1}\n{"step": 2}')  # a whole last row without its newline is kept
  report.JsonlWriter(path)({"step": 3})
  assert [r["step"] for r in report.read_jsonl(path)] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# The asynchronous simulator (issue 5): checkpointed in chunks of events via its state_dict

SIM_SAMPLES, SIM_CHUNK = 8 * 40, 8


def _simulator():
  from mfopt import sim  # issue 5
  dataset = data.load("synthetic", num_train=256, num_test=64, input_shape=(10,), num_classes=4)
  model = models.get_model("mlp", hidden=(8,), num_classes=4)
  return sim.Simulator(sim.ksync_preset("faithful", alpha0=0.05), model=model, dataset=dataset,
                       num_workers=4, per_worker_batch=8, seed=3, network="1gbit",
                       eval_every_samples=80,
                       compute=sim.ComputeModel(0.01, speed_spread=0.4, jitter_sigma=0.3,
                                                straggler_prob=0.1, straggler_slowdown=3.0))


def _sim_trace(engine):
  r = engine.result()
  return (engine.theta.tobytes(), r.k_trace, r.staleness, r.lr_traces, r.history,
          r.server_lr_trace, r.summary)


def sim_child_main(ckpt_dir, out, pause):
  jax.config.update("jax_num_cpu_devices", 8)
  runner.enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE") or ROOT / ".jax_cache")

  def on_checkpoint(chunk):
    print(f"CHUNK {chunk}", flush=True)
    time.sleep(pause)

  engine = checkpoint.run_resumable(_simulator(), ckpt_dir, chunk_events=SIM_CHUNK,
                                    on_checkpoint=on_checkpoint, max_samples=SIM_SAMPLES)
  import pickle
  pathlib.Path(out).write_bytes(pickle.dumps(_sim_trace(engine)))


@pytest.mark.slow  # child processes
def test_simulator_sigkill_then_resume_is_bitwise_identical(tmp_path):
  import pickle
  ckpt_dir, out = tmp_path / "ckpt", tmp_path / "trace.pkl"

  def spawn(pause):
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_resume; "
            f"test_resume.sim_child_main({str(ckpt_dir)!r}, {str(out)!r}, {pause})")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

  target = int(np.random.default_rng(7).integers(2, 6))
  proc = spawn(0.2)
  killed_after = 0
  for line in proc.stdout:
    if line.startswith("CHUNK ") and int(line.split()[1]) >= target:
      killed_after = int(line.split()[1])
      proc.send_signal(signal.SIGKILL)
      break
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
  assert not out.exists()
  proc = spawn(0.0)
  stdout, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  # it resumed after a chunk saved before the kill (a restart would also end equal); the
  # kill may land after the next chunk's save on a loaded machine (0.2 s pause), so >=
  chunks = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("CHUNK ")]
  assert killed_after >= 2 and chunks and chunks[0] >= killed_after + 1, (killed_after, chunks)

  reference = _simulator()
  reference.run(max_samples=SIM_SAMPLES)  # one uninterrupted run, no checkpoints
  got, want = pickle.loads(out.read_bytes()), _sim_trace(reference)
  assert got[0] == want[0]  # final parameters, bit for bit
  assert got[1:] == want[1:]  # k trace, staleness, lr traces, history, summary
  assert len(want[1]) > 2 and reference.samples >= SIM_SAMPLES


def test_simulator_resumes_with_another_chunk_size(tmp_path):
  """The chunk size (--checkpoint-every) says how often to save, not what is computed: a run
  resumed with another one was refused as 'written by a different run'."""

  class Crash(Exception):
    pass

  def crash_after_third(chunk):
    if chunk == 3:
      raise Crash

  with pytest.raises(Crash):
    checkpoint.run_resumable(_simulator(), tmp_path, chunk_events=SIM_CHUNK,
                             on_checkpoint=crash_after_third, max_samples=SIM_SAMPLES)
  chunks = []
  engine = checkpoint.run_resumable(_simulator(), tmp_path, chunk_events=5 * SIM_CHUNK,
                                    on_checkpoint=chunks.append, max_samples=SIM_SAMPLES)
  assert chunks[0] == 4  # resumed after the third chunk (a restart would also end equal)
  reference = _simulator()
  reference.run(max_samples=SIM_SAMPLES)
  assert _sim_trace(engine) == _sim_trace(reference)


def test_plain_codec_round_trips_types_exactly():
  state = {"a": np.arange(3.0), 3: (1, np.float32(2.5), [None, np.zeros((0, 2), np.int8)]),
           "__x": {"k": np.int64(7)}, (1, 2): "tuple key", "nan": float("nan")}
  arrays = {}
  back = checkpoint.decode_plain(json.loads(json.dumps(checkpoint.encode_plain(state, arrays))),
                                 arrays)
  assert back.keys() == state.keys() and back[(1, 2)] == "tuple key"
  assert type(back[3]) is tuple and type(back[3][1]) is np.float32 and back[3][1] == 2.5
  assert back[3][2][1].shape == (0, 2) and back[3][2][1].dtype == np.int8
  assert type(back["__x"]["k"]) is np.int64 and np.isnan(back["nan"])
  np.testing.assert_array_equal(back["a"], state["a"])


# ---------------------------------------------------------------------------------------------
# More transforms on main, resumed in-process (checkpoints after the resume point deleted):
# stochastic rounding keys (QSGD), epoch-based schedules (hybrid AdaBound->LARS), fp16 loss scale.


def _in_process_transforms():
  from mfopt import precision
  return {
      "qsgd": lambda: optax.chain(mfopt.qsgd(mfopt.WORKER_AXES), optax.sgd(LR)),
      "hybrid_adabound_lars": lambda: optax.chain(
          mfopt.sync_gradients(mfopt.WORKER_AXES),
          mfopt.hybrid_adabound_lars(num_workers=8, steps_per_epoch=4, warmup_epochs=2)),
      "fp16_loss_scale": lambda: precision.dynamic_loss_scale(
          optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(LR)), init_scale=2.0 ** 20),
  }


@pytest.mark.parametrize("name", ["qsgd", "fp16_loss_scale"])  # hybrid: kept out for time
def test_resume_in_process_equals_uninterrupted(name, tmp_path):
  import shutil
  dataset = data.load("synthetic", num_train=256, num_test=64, input_shape=(10,), num_classes=4)
  kw = dict(model=models.get_model("mlp", hidden=(8,), num_classes=4), dataset=dataset,
            num_workers=8, per_worker_batch=4, num_steps=20, log_every=5, progress=False,
            checkpoint_dir=tmp_path, keep_checkpoints=4)
  make = _in_process_transforms()[name]
  full = train.fit(tx=make(), **kw)
  for step in ("20", "15"):  # as if the run had died after step 10's checkpoint
    shutil.rmtree(tmp_path / step)
  logged = []
  resumed = train.fit(tx=make(), on_log=logged.append, **kw)
  # it resumed after step 10 (a fit that ignored the checkpoint would log from step 5)
  assert [row["step"] for row in logged] == [15, 20]
  assert _strip(resumed.history) == _strip(full.history)
  for a, b in zip(jax.tree.leaves(jax.device_get(full.state)),
                  jax.tree.leaves(jax.device_get(resumed.state))):
    np.testing.assert_array_equal(a, b)


def test_a_recomputed_row_that_differs_in_its_last_bit_is_not_written_twice(tmp_path, capsys):
  """Resumed on another device count, a recomputed row differed from the logged one in its last
  bit and was appended again (precision --quick: 5 rows for 4 data points). A row is now
  identified by its labels and its step; the first one logged stays, and the difference is
  reported once."""
  path = tmp_path / "metrics.jsonl"
  log = report.JsonlWriter(path)
  log({"policy": "fp16", "seed": 0, "step": 8, "train_loss": 0.061498526, "train_time_s": 1.0})
  resumed = report.JsonlWriter(path)
  resumed({"policy": "fp16", "seed": 0, "step": 8, "train_loss": 0.061498530, "train_time_s": 2.0})
  resumed({"policy": "fp16", "seed": 0, "step": 16, "train_loss": 0.05, "train_time_s": 3.0})
  resumed({"policy": "fp16", "seed": 1, "step": 8, "train_loss": 0.07, "train_time_s": 4.0})
  resumed({"policy": "fp32", "seed": 0, "step": 8, "train_loss": 0.06, "train_time_s": 5.0})
  rows = report.read_jsonl(path)
  assert [(r["policy"], r["seed"], r["step"]) for r in rows] == [
      ("fp16", 0, 8), ("fp16", 0, 16), ("fp16", 1, 8), ("fp32", 0, 8)]
  assert rows[0]["train_loss"] == 0.061498526
  assert capsys.readouterr().err.count("a row differs from one already logged") == 1
  # a simulator row is positioned by server_step; a row without a position by its content
  resumed({"strategy": "ASP", "server_step": 5, "samples": 64, "sim_time": 1.0})
  resumed({"strategy": "ASP", "server_step": 5, "samples": 64, "sim_time": 1.0 + 1e-12})
  # BSP evaluating more often than the server updates: two evaluations of one server version
  resumed({"strategy": "BSP", "server_step": 5, "samples": 32, "sim_time": 1.0})
  resumed({"strategy": "BSP", "server_step": 5, "samples": 64, "sim_time": 1.5})
  resumed({"note": 1, "train_time_s": 1.0})
  resumed({"note": 1, "train_time_s": 2.0})
  resumed({"note": 2})
  assert len(report.read_jsonl(path)) == 9


def test_torn_line_after_crlf_rows_is_cut_at_the_right_byte(tmp_path):
  """Rows ending in \\r\\n (a file written in text mode on Windows): the cut is at a byte offset
  (a character offset left part of the last whole row's newline out, gluing the next row on)."""
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"a": 1}\r\n{"b": 2}\r\n{"c": 3}\r\n{"d')
  report.JsonlWriter(path)({"e": 5})
  assert report.read_jsonl(path) == [{"a": 1}, {"b": 2}, {"c": 3}, {"e": 5}]


def test_json_files_are_strict_json_with_nonfinite_numpy_values(tmp_path):
  """NumPy's nan/inf (np.float64 is a float subclass) came out as bare NaN / Infinity, which a
  strict JSON parser rejects; every non-finite value is now the string Python's own gives."""
  def strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

  row = {"a": float("nan"), "b": np.float32("nan"), "c": np.float64("inf"),
         "d": np.array([1.0, -np.inf]), "e": [np.float16(2.0)]}
  want = {"a": "nan", "b": "nan", "c": "inf", "d": [1.0, "-inf"], "e": [2.0]}
  report.write_json(tmp_path / "s.json", row)
  assert strict((tmp_path / "s.json").read_text()) == want
  log = report.JsonlWriter(tmp_path / "m.jsonl")
  log(row)
  log(dict(row))  # the same row again: not written twice
  lines = (tmp_path / "m.jsonl").read_text().splitlines()
  assert len(lines) == 1 and strict(lines[0]) == want
  # a log written before the fix holds bare NaN: a resumed run's equal row is not added again
  (tmp_path / "old.jsonl").write_text('{"step": 1, "loss": NaN}\n')
  report.JsonlWriter(tmp_path / "old.jsonl")({"step": 1, "loss": np.float32("nan")})
  assert len((tmp_path / "old.jsonl").read_text().splitlines()) == 1


def test_a_failed_json_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
  """summary.json, config.json and attempts.json are replaced atomically: a write that fails
  half-way (disk full, or a kill) leaves the previous version readable, not a torn file."""
  path = tmp_path / "summary.json"
  report.write_json(path, {"attempts": 1})

  def half_then_full(self, text, *args, **kwargs):
    with open(self, "w") as f:
      f.write(text[:len(text) // 2])
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(pathlib.Path, "write_text", half_then_full)
  with pytest.raises(OSError, match="No space left"):
    report.write_json(path, {"attempts": 2, "wall_time_s": 1.5})
  monkeypatch.undo()
  assert json.loads(path.read_text()) == {"attempts": 1}


def test_a_log_holding_an_old_duplicate_keeps_comparing_with_its_first_row(tmp_path, capsys):
  """A log written before rows were deduplicated may hold a data point twice; the writer keeps
  the first as the logged value, so a recomputed row equal to it is neither added nor reported
  as differing."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 5, "loss": 1.0}\n{"step": 5, "loss": 1.5}\n')
  report.JsonlWriter(path)({"step": 5, "loss": 1.0})
  assert len(report.read_jsonl(path)) == 2 and "differs" not in capsys.readouterr().err


def test_mean_std_is_the_sample_standard_deviation_over_seeds():
  """SPEC's spread over seeds is the sample standard deviation (ddof=1): for 1, 2, 3, 4 it is
  sqrt(5/3), not the population value sqrt(5/4) that makes a 2-std claim easier to pass; one
  seed has no spread (0)."""
  mean, std = report.mean_std([1.0, 2.0, 3.0, 4.0])
  assert mean == pytest.approx(2.5, rel=1e-15)
  assert std == pytest.approx(np.sqrt(5 / 3), rel=1e-12)
  assert report.mean_std([0.75]) == (0.75, 0.0)


def test_markdown_table_reads_cells_by_column_and_shows_booleans_as_words():
  """Headers only label the columns (the cells are read by column key), and a bool cell reads
  True/False rather than the 1/0 it would print as an int."""
  rows = [{"lr": 0.1, "acc": 0.912345, "diverged": False, "steps": 12000},
          {"lr": 1.0, "acc": None, "diverged": True, "steps": 300}]
  assert report.markdown_table(rows, ["lr", "acc", "diverged", "steps"],
                               headers=["LR", "Accuracy", "Diverged", "Steps"]) == (
      "| LR | Accuracy | Diverged | Steps |\n|---|---|---|---|\n"
      "| 0.1 | 0.9123 | False | 12,000 |\n| 1 | – | True | 300 |\n")


def test_environment_header_puts_each_fact_under_its_label():
  """Every report's header: the device count, kind and backend, the processes and the host's
  CPU cores each in their own place (by hand), and environment() reads them from JAX and os."""
  env = {"date": "2026-01-02 03:04 UTC", "backend": "gpu", "device_kind": "NVIDIA H100",
         "device_count": 8, "local_device_count": 4, "process_count": 2, "cpu_count": 16,
         "python": "3.11.7", "jax": "0.10.2", "flax": "0.12.0", "optax": "0.2.5"}
  assert report.environment_markdown(env) == (
      "- Date: 2026-01-02 03:04 UTC\n"
      "- Device: 8 x NVIDIA H100 (gpu), 2 process(es), 16 host CPU cores\n"
      "- Software: Python 3.11.7, JAX 0.10.2, Flax 0.12.0, Optax 0.2.5\n")
  real = report.environment()
  assert (real["backend"], real["device_count"], real["local_device_count"],
          real["process_count"], real["cpu_count"], real["jax"]) == (
      jax.default_backend(), jax.device_count(), jax.local_device_count(), jax.process_count(),
      os.cpu_count(), jax.__version__)


def test_an_attempt_killed_before_its_first_checkpoint_is_counted(tmp_path):
  """Its run starts over (resumed=False) but its time was spent: it stays in attempts.json,
  closed at its last write (here its metrics rows, 25 s after it started)."""
  started = time.time() - 100
  (tmp_path / runner.ATTEMPTS).write_text(json.dumps([{"started": started, "wall_time_s": None}]))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  os.utime(tmp_path / "metrics.jsonl", (started + 25, started + 25))
  attempts = runner.begin_attempt(tmp_path, tmp_path, resumed=False)
  assert len(attempts) == 2 and attempts[0]["interrupted"]
  assert attempts[0]["wall_time_at_least_s"] == pytest.approx(25, abs=1e-3)
  totals = runner.end_attempt(tmp_path, attempts, 3.0)
  assert totals == {"attempts": 2, "wall_time_all_attempts_s": pytest.approx(28, abs=1e-3),
                    "wall_time_all_attempts_is_lower_bound": True}


def test_an_attempt_closed_as_interrupted_keeps_its_time_at_later_starts(tmp_path):
  """An attempt already closed as killed (25 s to its last write) keeps those 25 s when a
  third attempt starts: re-closing it at the workdir's newest write (80 s, written by the
  second attempt) counted the second attempt's time twice."""
  started = time.time() - 100
  (tmp_path / runner.ATTEMPTS).write_text(json.dumps([
      {"started": started, "wall_time_s": None, "interrupted": True, "wall_time_at_least_s": 25.0},
      {"started": started + 30, "wall_time_s": None}]))
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  os.utime(tmp_path / "metrics.jsonl", (started + 80, started + 80))
  attempts = runner.begin_attempt(tmp_path, tmp_path, resumed=True)
  assert [a.get("wall_time_at_least_s") for a in attempts] == [
      25.0, pytest.approx(50, abs=1e-3), None]
  totals = runner.end_attempt(tmp_path, attempts, 5.0)
  assert totals["wall_time_all_attempts_s"] == pytest.approx(80, abs=1e-3)


def test_runner_allowed_config_change_after_a_kill_keeps_one_trajectory(tmp_path, monkeypatch):
  """Killed after logging step 15 (last checkpoint: step 10), rerun with seed=1 and
  --allow-config-change: the metrics log holds the new run's steps 15 and 20, not the killed
  attempt's step 15 (the curve mixed the two trajectories)."""
  workdir = tmp_path / "run"
  args = [a for a in QUICK if not a.startswith("algorithms")] + [
      "algorithms=('sync SGD m=0.9 (optax)',)"]
  plain = report.JsonlWriter.__call__
  logged = []

  def dying(self, row):
    plain(self, row)
    logged.append(dict(row))
    if len(logged) == 3:
      raise KeyboardInterrupt  # (as a kill after the row reached the file)

  monkeypatch.setattr(report.JsonlWriter, "__call__", dying)
  with pytest.raises(KeyboardInterrupt):
    runner.run_experiment("quickstart", quick=True, workdir=workdir, overrides=args,
                          checkpoint_every=10)
  monkeypatch.setattr(report.JsonlWriter, "__call__", plain)
  assert [r["step"] for r in logged] == [5, 10, 15]
  again = runner.run_experiment("quickstart", quick=True, workdir=workdir,
                                overrides=args + ["seed=1"], checkpoint_every=10,
                                allow_config_change=True)
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [5, 10, 15, 20]
  assert rows[1]["train_loss"] == logged[1]["train_loss"]  # before the checkpoint: kept
  assert rows[2]["train_loss"] != logged[2]["train_loss"]  # the new trajectory's step 15
  assert rows[3]["train_loss"] == again["rows"][0]["final_train_loss"]
