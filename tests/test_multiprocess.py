"""Two processes x 4 CPU devices (gloo on 127.0.0.1) train like one process with 8 devices.

Processes are started with ``scripts/launch_local.py`` (free port, gloo CPU
collectives, short heartbeat timeout); the child code is ``child_main`` below.
Checks: same final parameters as the 1-process run (allclose: the reduction
order differs), the 2-process checkpoint restores onto the 1-process mesh, and
killing one process makes the other exit non-zero within 30 s with the
launcher naming the dead process.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import mfopt
from mfopt import checkpoint, data, distributed, models, parallel, runner, train

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
LAUNCH = ROOT / "scripts" / "launch_local.py"
NUM_STEPS, LOG_EVERY = 10, 5
EVAL_BATCH = 16  # 64 test examples: 4 evaluation batches, 2 per process


def _setup(num_steps, algo="sync"):
  dataset = data.load("synthetic", num_train=512, num_test=64, input_shape=(12,), num_classes=4)
  model = models.get_model("mlp", hidden=(8,), num_classes=4)
  if algo == "sync":
    tx = optax.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), optax.sgd(0.1, momentum=0.9))
  else:  # local steps; every 3rd step averages across both processes inside the gated loop
    tx = mfopt.periodic_averaging(optax.sgd(0.1, momentum=0.9), mfopt.WORKER_AXES, 3,
                                  trace_length=4)
  return dict(model=model, tx=tx, dataset=dataset, num_workers=8, per_worker_batch=4,
              num_steps=num_steps, log_every=LOG_EVERY, seed=2, progress=False)


def child_main(out, num_steps, algo="sync"):
  """One process of the job: join, train with checkpoints, process 0 writes the final params."""
  distributed.initialize()  # MFOPT_* from the launcher: 4 CPU devices, gloo, coordinator
  runner.enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE") or ROOT / ".jax_cache")
  assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4

  def on_log(row):
    print(f"STEP {row['step']}", flush=True)

  train.EVAL_BATCH_SIZE = EVAL_BATCH
  read = []  # examples of each evaluation batch this process read
  plain = data.eval_batches

  def counting(source, batch_size, **kw):
    for b in plain(source, batch_size, **kw):
      read.append(int(b["mask"].sum()))
      yield b

  data.eval_batches = counting

  # Periodic averaging with host-decided gates (the GPU default): each process replays the
  # schedule from its own shards; the one-process reference uses the device-side gate.
  result = train.fit(**_setup(num_steps, algo), checkpoint_dir=pathlib.Path(out) / "ckpt",
                     on_log=on_log, host_gates=True if algo == "avg" else None)
  params = train.to_host(result.state.params, parallel.make_mesh())
  # evaluate's local copy of a global array that is not replicated (here: worker-sharded)
  # gathers the whole value onto a local device
  sharded = jax.tree.leaves(result.state.params)[0]
  assert not sharded.is_fully_replicated and not sharded.is_fully_addressable
  local = train._local_copy(sharded)
  assert local.is_fully_addressable
  np.testing.assert_array_equal(np.asarray(local), jax.tree.leaves(params)[0])
  (pathlib.Path(out) / f"eval_read{jax.process_index()}.json").write_text(json.dumps(read))
  if jax.process_index() == 0:
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    np.savez(pathlib.Path(out) / "params.npz", *leaves)
    (pathlib.Path(out) / "history.json").write_text(json.dumps(result.history))
  if algo == "avg":  # every process reads the sync trace from its own workers' rows
    trace = mfopt.sync_trace(result.state.opt_state)
    (pathlib.Path(out) / f"trace{jax.process_index()}.json").write_text(
        json.dumps({k: np.asarray(v).tolist() for k, v in trace.items()}))


def child_raises(out, at_step):
  """Process 1 raises from its logging callback at ``at_step``; process 0 trains on."""
  distributed.initialize()
  runner.enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE") or ROOT / ".jax_cache")

  def on_log(row):
    print(f"STEP {row['step']}", flush=True)
    if jax.process_index() == 1 and row["step"] >= at_step:
      raise RuntimeError(f"boom at step {row['step']}")

  train.fit(**_setup(10_000), checkpoint_dir=pathlib.Path(out) / "ckpt", on_log=on_log)


def _launch_job(call: str, *, heartbeat=5, grace=40) -> subprocess.Popen:
  """Starts ``test_multiprocess.<call>`` (e.g. ``"child_main(...)"``) as a 2-process job of
  ``scripts/launch_local.py`` with 4 CPU devices per process."""
  code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_multiprocess; "
          f"test_multiprocess.{call}")
  return subprocess.Popen(_launch_args("-c", code, heartbeat=heartbeat, grace=grace),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _launch_args(*python_args: str, heartbeat=5, grace=40) -> list[str]:
  """``scripts/launch_local.py``'s command line: 2 processes x 4 CPU devices running
  ``python *python_args``."""
  return [sys.executable, str(LAUNCH), "-n", "2", "--cpu-devices", "4", "--heartbeat-timeout",
          str(heartbeat), "--grace", str(grace), "--", *python_args]


def _launch(out, num_steps, heartbeat=5, algo="sync"):
  return _launch_job(f"child_main({str(out)!r}, {num_steps}, {algo!r})", heartbeat=heartbeat)


def _two_processes_vs_one(tmp_path, algo):
  """Runs the 2-process job and the 1-process reference (8 devices); checks that both end
  with the same parameters and returns ``(2-process leaves, reference leaves, reference)``."""
  proc = _launch(tmp_path, NUM_STEPS, algo=algo)
  out, err = proc.communicate(timeout=150)
  assert proc.returncode == 0, (out + err)[-4000:]
  assert "all 2 processes finished" in err
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, "EVAL_BATCH_SIZE", EVAL_BATCH)
    reference = train.fit(**_setup(NUM_STEPS, algo), mesh=parallel.make_mesh())
  want = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(reference.state.params))]
  with np.load(tmp_path / "params.npz") as z:
    got = [z[f"arr_{i}"] for i in range(len(z.files))]
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)  # the reduction order differs
  # The final evaluation was split: each process read its 2 of the 4 test batches, and the
  # gathered result is the one-process evaluation's.
  for p in (0, 1):
    assert json.loads((tmp_path / f"eval_read{p}.json").read_text()) == [EVAL_BATCH, EVAL_BATCH]
  last = json.loads((tmp_path / "history.json").read_text())[-1]
  np.testing.assert_allclose(last["test_loss"], reference.history[-1]["test_loss"], rtol=1e-5)
  assert last["test_accuracy"] == reference.history[-1]["test_accuracy"]
  return got, want, reference


@pytest.mark.slow  # child processes
def test_two_processes_match_one_process_and_checkpoint_restores_on_one(tmp_path):
  got, want, reference = _two_processes_vs_one(tmp_path, "sync")
  moved = max(float(np.abs(w - w0).max()) for w, w0 in zip(
      want, jax.tree.leaves(jax.device_get(train.init_train_state(
          _setup(1)["model"], _setup(1)["tx"], np.zeros((4, 12), np.float32), num_workers=8,
          mesh=parallel.make_mesh(), seed=2).params))))
  assert moved > 1e-3  # training moved the parameters: the comparison is not of the init
  history = json.loads((tmp_path / "history.json").read_text())
  for a, b in zip(history, reference.history):
    assert a["step"] == b["step"]
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-5)

  # The checkpoint written by both processes restores onto this single process's 8 devices.
  fresh = train.init_train_state(_setup(1)["model"], _setup(1)["tx"], np.zeros((4, 12), np.float32),
                                 num_workers=8, mesh=parallel.make_mesh(), seed=2)
  restored = checkpoint.RunCheckpointer(tmp_path / "ckpt", allow_mismatch=True).restore_latest(fresh)
  assert restored.step == NUM_STEPS
  for g, r in zip(got, jax.tree.leaves(jax.device_get(restored.state.params))):
    np.testing.assert_array_equal(g, r)


@pytest.mark.slow  # child processes
def test_two_processes_run_periodic_averaging_like_one_process(tmp_path):
  """Periodic averaging all-reduces across the two processes (gloo) on steps 3, 6 and 9
  only, there with host-decided gates (``host_gates=True``: the sync program is picked on
  each process's host), here in one process with the device-side gated loop: the same
  parameters, and the workers differ after step 10 (a local step), so not every step
  averaged."""
  got, _, reference = _two_processes_vs_one(tmp_path, "avg")
  assert max(float(np.ptp(g, axis=0).max()) for g in got) > 0  # worker-stacked, diverged
  assert mfopt.comm_totals(reference.state.opt_state)["all_reduces"] == NUM_STEPS // 3
  want = mfopt.sync_trace(reference.state.opt_state)
  for i in range(2):  # the trace of a multi-process state (it used to fail: non-addressable)
    trace = json.loads((tmp_path / f"trace{i}.json").read_text())
    assert trace["step"] == [3, 6, 9] == np.asarray(want["step"]).tolist()
    np.testing.assert_allclose(trace["period"], want["period"])


@pytest.mark.slow  # child processes
def test_an_exception_in_one_process_ends_it_at_once_and_the_job_soon(tmp_path):
  """Python's normal exit after an uncaught exception ran jax.distributed.shutdown, whose
  barrier the other process (in a collective with this one) never reached: the job hung for
  5 minutes, then both aborted and the launcher named process 0. distributed.initialize's
  hook ends the failing process at once; the other stops at the heartbeat timeout."""
  started = time.monotonic()
  proc = _launch_job(f"child_raises({str(tmp_path)!r}, 10)", heartbeat=5)
  try:
    out, err = proc.communicate(timeout=100)
  except subprocess.TimeoutExpired:  # (the hang this test is about: stop the job, then fail)
    proc.terminate()  # the launcher passes SIGTERM on and kills what is left
    proc.communicate(timeout=30)
    raise
  elapsed = time.monotonic() - started
  assert proc.returncode != 0
  assert "[p1] RuntimeError: boom at step 10" in out, out[-3000:]
  assert re.search(r"process 1 \(pid \d+\) died: exit code 1", err), err[-3000:]
  assert re.search(r"process 0 \(pid \d+\) then ended: (?!exit code 0)", err), err[-3000:]
  assert elapsed < 80, elapsed


@pytest.mark.slow  # child processes
def test_an_error_on_every_process_ends_the_job_cleanly_with_each_ones_message(tmp_path):
  """A config error every process raises after joining (adpsgd_table runs as one process):
  each prints it and all exit 2 together. Ending at once, process 0 took the coordination
  service with it and process 1 aborted (SIGABRT) before printing its own."""
  proc = subprocess.run(_launch_args("-m", "experiments", "adpsgd_table", "--quick",
                                     "--workdir", str(tmp_path / "w")),
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
  for p in (0, 1):
    assert re.search(rf"\[p{p}\] error: .*several processes", proc.stdout), proc.stdout[-3000:]
  assert "SIGABRT" not in proc.stderr and "ended: exit code 2" in proc.stderr, proc.stderr


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("victim", [1, 0])  # 0 hosts the coordination service
def test_killing_one_process_stops_the_other_and_launcher_names_it(tmp_path, victim):
  proc = _launch(tmp_path, 10_000, heartbeat=5)
  first = proc.stdout.readline()  # "launch_local: started 2 processes (pids A, B), ..."
  pids = [int(p) for p in re.search(r"pids (\d+), (\d+)", first).groups()]
  for line in proc.stdout:  # wait until both train (past the first checkpoint)
    if line.startswith("[p1] STEP 10"):
      break
  survivor = 1 - victim
  os.kill(pids[victim], signal.SIGKILL)
  killed_at = time.monotonic()
  out, err = proc.communicate(timeout=60)
  elapsed = time.monotonic() - killed_at
  assert proc.returncode != 0
  assert f"process {victim} (pid {pids[victim]}) died: killed by SIGKILL" in err, err[-3000:]
  match = re.search(rf"process {survivor} \(pid {pids[survivor]}\) then ended: (.*)", err)
  assert match, err[-3000:]  # it ended by itself ("did not exit within" would be a hang)
  assert match.group(1) != "exit code 0"
  assert elapsed < 30, elapsed
  # The run's checkpoints stay usable (the last good one restores in this process).
  ckpt = checkpoint.RunCheckpointer(tmp_path / "ckpt", allow_mismatch=True)
  fresh = train.init_train_state(_setup(1)["model"], _setup(1)["tx"], np.zeros((4, 12), np.float32),
                                 num_workers=8, mesh=parallel.make_mesh(), seed=2)
  assert ckpt.restore_latest(fresh).step >= 5


def _join_and_save_two_steps(out):
  """Joins the job, saves steps 1 and 2 of a worker-sharded state (values 1.0, 2.0) from both
  processes, and returns ``(directory, state)`` with ``state(v)`` a fresh such state."""
  from jax.sharding import NamedSharding, PartitionSpec
  distributed.initialize()
  mesh = parallel.make_mesh()
  sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))

  def state(v):
    return {"w": jax.make_array_from_callback(
        (8, 3), sharding, lambda idx: np.full((8, 3), v, np.float32)[idx])}

  directory = pathlib.Path(out) / "ckpt"
  ckpt = checkpoint.RunCheckpointer(directory, keep=3, fingerprint={"run": 1})
  ckpt.save(1, state(1.0), {})
  ckpt.save(2, state(2.0), {})
  ckpt.close()
  return directory, state


def child_corrupt_checkpoint(out):
  """Both processes save steps 1 and 2; step 2's meta is then garbled; both restore, process 1
  reaching the move-aside 1.5 s after process 0 has renamed the step (any scheduling delay:
  each process used to pick the new name itself, and they waited at different barriers)."""
  from jax.experimental import multihost_utils
  directory, state = _join_and_save_two_steps(out)
  if jax.process_index() == 0:
    (directory / "2" / "meta" / "metadata").write_text('{"step": 2, "hist')
  multihost_utils.sync_global_devices("garbled")
  if jax.process_index() == 1:
    move_aside = checkpoint.RunCheckpointer._move_aside

    def slow(self, step):
      time.sleep(1.5)
      return move_aside(self, step)

    checkpoint.RunCheckpointer._move_aside = slow
  restored = checkpoint.RunCheckpointer(directory, keep=3, fingerprint={"run": 1}).restore_latest(
      state(0.0))
  values = {float(v) for shard in restored.state["w"].addressable_shards
            for v in np.asarray(shard.data).ravel()}
  print(f"RESTORED step {restored.step} values {sorted(values)}", flush=True)


def child_one_process_read_fails(out):
  """As :func:`child_corrupt_checkpoint`, but step 2's state read fails on process 1 only (its
  own shards, as a damaged file holding them would): process 0 reads fine and waits in orbax's
  end-of-restore barrier, which process 1 used to skip (then the job hung)."""
  from jax.experimental import multihost_utils
  directory, state = _join_and_save_two_steps(out)
  multihost_utils.sync_global_devices("saved")
  again = checkpoint.RunCheckpointer(directory, keep=3, fingerprint={"run": 1})
  if jax.process_index() == 1:
    restore = again.manager.restore

    def failing(step, args=None):
      if "state" in args.keys() and step == 2:
        raise ValueError("DATA_LOSS: error reading a chunk (simulated, process 1 only)")
      return restore(step, args=args)

    again.manager.restore = failing
  restored = again.restore_latest(state(0.0))
  values = {float(v) for shard in restored.state["w"].addressable_shards
            for v in np.asarray(shard.data).ravel()}
  print(f"RESTORED step {restored.step} values {sorted(values)}", flush=True)


def child_auto_lowering(out):
  """Both processes time lowering="auto"'s candidates; the clock is rigged so that each process
  measures a different one fastest. They must still run one program: process 0's pick."""
  distributed.initialize()
  mesh = parallel.make_mesh()
  setup = _setup(1)
  step = train.make_train_step(setup["model"], setup["tx"], mesh=mesh, num_workers=16,
                               lowering="auto")
  names = list(step.steps)
  favourite = names[jax.process_index() % len(names)]
  current = {"name": None}
  ticks = iter(range(10**6))

  def clock():  # favourite's steps take 1 tick, the others 100
    return next(ticks) * (1 if current["name"] == favourite else 100)

  def traced(name, fn):
    def run(*args):
      current["name"] = name
      return fn(*args)
    return run

  step.steps = {name: traced(name, fn) for name, fn in step.steps.items()}
  step.clock = clock
  x = np.zeros((16, 4, 12), np.float32)
  state = train.init_train_state(setup["model"], setup["tx"], x[0], num_workers=16, mesh=mesh)
  rows = parallel.process_worker_slice(16, mesh)
  batch = parallel.shard_workers({"x": x[rows], "y": np.zeros((16, 4), np.int32)[rows]}, mesh)
  print(f"FAVOURITE {favourite} CHOICE {step.choose(state, batch)}", flush=True)


def child_worker_mesh(out):
  """Records which process owns each device of ``worker_mesh(W)``, and reads every worker of a
  6-worker array (3 + 3 devices) back with ``unstack_worker`` in both processes."""
  distributed.initialize()
  layouts = {w: [d.process_index for d in parallel.worker_mesh(w).devices.flat]
             for w in (2, 6, 8, 16)}
  try:
    parallel.worker_mesh(1)
    refused = None
  except ValueError as e:
    refused = str(e)
  mesh = parallel.worker_mesh(6)
  rows = parallel.process_worker_slice(6, mesh)
  values = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
  tree = parallel.shard_workers({"w": values[rows], "n": np.arange(6)[rows]}, mesh)
  read = [{k: np.asarray(v).tolist() for k, v in parallel.unstack_worker(tree, i).items()}
          for i in range(6)]
  (pathlib.Path(out) / f"mesh{jax.process_index()}.json").write_text(json.dumps(
      {"layouts": layouts, "refused": refused, "rows": [rows.start, rows.stop], "read": read}))


def child_interval_decision(out):
  """Each process's clock says something else about the checkpoint interval; both must follow
  process 0's (deciding apart, one process entered a collective save while the other went on
  training: the job hung)."""
  distributed.initialize()
  mine = {0: 5.0, 1: 100.0}[jax.process_index()]  # seconds since the last save, per process
  decided = [checkpoint.interval_elapsed(0.0, 10.0, clock=lambda: mine) for _ in range(2)]
  flipped = checkpoint.interval_elapsed(0.0, 10.0, clock=lambda: 105.0 - mine)
  print(f"DECIDED {decided} {flipped}", flush=True)


def child_settings_agree(out):
  """The same settings pass; a seed that differs on process 1 is refused on both processes,
  and process 1 names the field (nothing compared them: the job ran a mixture of seeds)."""
  distributed.initialize()
  runner.require_same_settings_on_every_process({"config": {"seed": 0, "lr": 0.1}})
  try:
    runner.require_same_settings_on_every_process(
        {"config": {"seed": jax.process_index(), "lr": 0.1}})
  except runner.ConfigError as e:
    print(f"REFUSED {e}", flush=True)


def _run_child(function: str, out) -> subprocess.CompletedProcess:
  """Runs ``test_multiprocess.<function>(out)`` as a 2-process job and checks it succeeded."""
  job = _launch_job(f"{function}({str(out)!r})", grace=20)
  try:
    stdout, stderr = job.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    job.kill()
    stdout, stderr = job.communicate()
    raise AssertionError(f"{function}: no result in 120 s\n{(stdout + stderr)[-4000:]}") from None
  proc = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  return proc


@pytest.mark.slow  # child processes
def test_two_processes_agree_on_the_auto_lowering(tmp_path):
  proc = _run_child("child_auto_lowering", tmp_path)
  # (a lowering name: letters, maybe ":K"; gloo's own stderr lines can land on the same line)
  name = r"([a-z]+(?::\d+)?)"
  got = dict(re.findall(rf"\[p(\d)\] FAVOURITE [a-z:0-9]+ CHOICE {name}", proc.stdout))
  fav = dict(re.findall(rf"\[p(\d)\] FAVOURITE {name}", proc.stdout))
  assert fav["0"] != fav["1"], proc.stdout  # the processes did measure differently
  assert got == {"0": fav["0"], "1": fav["0"]}, proc.stdout


@pytest.mark.slow  # child processes
def test_two_processes_take_process_0s_checkpoint_interval_decision(tmp_path):
  proc = _run_child("child_interval_decision", tmp_path)
  got = dict(re.findall(r"\[p(\d)\] DECIDED (.*)", proc.stdout))
  assert got == {"0": "[False, False] True", "1": "[False, False] True"}, proc.stdout


@pytest.mark.slow  # child processes
def test_processes_given_different_settings_are_refused_on_every_process(tmp_path):
  proc = _run_child("child_settings_agree", tmp_path)
  got = dict(re.findall(r"\[p(\d)\] REFUSED (.*)", proc.stdout))
  assert got["1"].startswith("process 1 was given other settings than process 0 (process 0 -> "
                             "here): config.seed: 0 -> 1"), proc.stdout
  assert got["0"].startswith("process(es) [1] were given other settings"), proc.stdout


@pytest.mark.slow  # child processes
def test_worker_mesh_gives_every_process_an_equal_share_and_reads_back_across_them(tmp_path):
  _run_child("child_worker_mesh", tmp_path)
  for p in (0, 1):
    got = json.loads((tmp_path / f"mesh{p}.json").read_text())
    assert got["layouts"] == {"2": [0, 1], "6": [0, 0, 0, 1, 1, 1], "8": [0] * 4 + [1] * 4,
                              "16": [0] * 4 + [1] * 4}
    assert got["refused"] == ("num_workers must be a multiple of the process count 2 (every "
                              "process trains an equal share of the workers), got 1")
    assert got["rows"] == [3 * p, 3 * p + 3]
    # every process reads every worker, its own and the other process's
    assert got["read"] == [{"w": [3.0 * i, 3.0 * i + 1, 3.0 * i + 2], "n": i} for i in range(6)]


def _mf_batch_workers_agree(two, one):
  """W = 2 ran on 1 + 1 devices, W = 6 on 3 + 3, W = 8 on all 8; same accuracies and losses."""
  two, one = (json.loads((d / "runs.json").read_text()) for d in (two, one))
  assert [r["workers"] for r in two] == [r["workers"] for r in one] == [2, 6, 8]
  assert [r["mesh"] for r in two] == ["2 of 8 device(s) (W not a multiple of 8, 1 per process)",
                                      "6 of 8 device(s) (W not a multiple of 8, 3 per process)",
                                      "8 device(s)"]
  for a, b in zip(two, one):
    assert a["test_accuracy"] == b["test_accuracy"], (a, b)
    np.testing.assert_allclose(a["final_train_loss"], b["final_train_loss"], rtol=1e-5)


def _bn_strategies_agree(two, one):
  """The varying-batch row (its own loop: each process feeds its rows, reads every worker's
  metrics) logs the same losses and accuracies at every evaluation, and the same all-reduces."""
  two, one = (json.loads((d / "runs.json").read_text())["varying_sync_ma"][0] for d in (two, one))
  assert [h["step"] for h in two["history"]] == [h["step"] for h in one["history"]] != []
  for a, b in zip(two["history"], one["history"]):
    for k in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=k)
  assert two["summary"]["all_reduces"] == one["summary"]["all_reduces"] > 0


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("name,overrides,agree", [
    ("mf_batch_workers", ["batches=(48,)", "workers=(2, 6, 8)", "optimizers=('sgd',)"],
     _mf_batch_workers_agree),
    ("bn_strategies", ["rows=('varying_sync_ma',)"], _bn_strategies_agree),
])
def test_an_experiment_on_two_processes_matches_one_process(tmp_path, name, overrides, agree):
  """The experiment on 2 processes x 4 devices and on one process with 8 devices."""
  overrides = [*overrides, "progress=false"]
  job = subprocess.run(
      _launch_args("-m", "experiments", name, "--quick", "--workdir", str(tmp_path / "two"),
                   *overrides, heartbeat=10), cwd=ROOT, capture_output=True, text=True,
      timeout=150)
  assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
  runner.run_experiment(name, quick=True, workdir=tmp_path / "one", overrides=overrides)
  agree(tmp_path / "two", tmp_path / "one")
  assert (tmp_path / "two" / "process-1" / "report.md").exists()


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("child,said_too", [
    ("child_corrupt_checkpoint", "corrupt or truncated"),  # both fail (the shared meta)
    ("child_one_process_read_fails", "unreadable on process(es) [1]"),  # process 1 only
])
def test_two_processes_fall_back_past_a_bad_checkpoint_together(tmp_path, child, said_too):
  proc = _run_child(child, tmp_path)
  for p in (0, 1):
    assert f"[p{p}] RESTORED step 1 values [1.0]" in proc.stdout, proc.stdout[-3000:]
  assert sorted(q.name for q in (tmp_path / "ckpt").iterdir()) == ["1", "corrupt-2-0"]
  said = proc.stdout + proc.stderr  # (the launcher forwards the children's stderr, prefixed)
  assert "checkpoint step 2" in said and said_too in said


@pytest.mark.parametrize("kwargs,match", [
    (dict(coordinator_address="127.0.0.1:1234"), r"incomplete: num_processes, process_id missing"),
    (dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2),
     r"process_id must be in \[0, 2\), got 2"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0),
     r"coordinator_address must look like host:port, got 'localhost'"),
    (dict(coordinator_address="h:1", num_processes="two", process_id=0),
     r"num_processes must be an integer, got 'two'"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), r"num_processes must be >= 1"),
])
def test_distributed_settings_are_validated(kwargs, match):
  with pytest.raises(ValueError, match=match):
    distributed.resolve(**kwargs, environ={})


def test_a_failing_process_of_a_job_exits_at_once_and_a_finished_one_does_not(monkeypatch,
                                                                              capsys):
  """exit_now (runner.main's non-zero codes) and initialize's excepthook end a failing
  process with os._exit, skipping jax.distributed.shutdown's barrier; exit code 0, and any
  code outside a multi-process job, return as before."""
  exits = []
  monkeypatch.setattr(os, "_exit", exits.append)
  monkeypatch.setattr(sys, "excepthook", lambda *a: exits.append(("printed", a[0].__name__)))
  assert runner.main(["quickstart", "--quick", "seed=-1"]) == 2 and exits == []  # one process
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert runner.main(["quickstart", "--quick", "seed=-1"]) == 2 and exits == [2]
  assert "ends with exit code 2 without the shutdown barrier" in capsys.readouterr().err
  # every process failing (they all reach the exit barrier): a normal exit, together
  monkeypatch.setattr(distributed, "_every_process_arrives", lambda *a: True)
  assert runner.main(["quickstart", "--quick", "seed=-1"]) == 2 and exits == [2]
  monkeypatch.undo()
  monkeypatch.setattr(os, "_exit", exits.append)
  monkeypatch.setattr(sys, "excepthook", lambda *a: exits.append(("printed", a[0].__name__)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  distributed.exit_now(0)
  assert exits == [2]
  distributed._exit_on_uncaught_error()
  distributed._exit_on_uncaught_error()  # (idempotent: one hook, not a chain of two)
  sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
  sys.excepthook(RuntimeError, RuntimeError("boom"), None)
  assert exits == [2, ("printed", "KeyboardInterrupt"), 130, ("printed", "RuntimeError"), 1]


def test_distributed_settings_from_environment():
  env = {"MFOPT_COORDINATOR": "10.0.0.1:8476", "MFOPT_NUM_PROCESSES": "4", "MFOPT_PROCESS_ID": "3",
         "MFOPT_HEARTBEAT_TIMEOUT": "20"}
  assert distributed.resolve(environ=env) == distributed.DistributedConfig("10.0.0.1:8476", 4, 3, 20)
  assert distributed.resolve(process_id=1, environ=env).process_id == 1  # flags win
  assert distributed.resolve(environ={}) is None
  assert distributed.resolve(environ={"MFOPT_DISTRIBUTED": "1"}) == distributed.DistributedConfig(
      None, None, None, None)


def test_initialize_in_cluster_detection_mode_accepts_the_detected_job(monkeypatch, capsys):
  """MFOPT_DISTRIBUTED=1 (the README's srun recipe) leaves the count to JAX's detection; the
  count check compared the detected 2 with None and failed every job this mode started."""
  calls = []
  monkeypatch.setenv("MFOPT_DISTRIBUTED", "1")
  monkeypatch.setenv("MFOPT_INIT_TIMEOUT", "17")
  for name in ("MFOPT_COORDINATOR", "MFOPT_NUM_PROCESSES", "MFOPT_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  settings = distributed.initialize(cpu_collectives=None)
  assert settings == distributed.DistributedConfig(None, None, None, None)
  assert calls == [((None, None, None), {"initialization_timeout": 17})]
  assert "joining the processes at the cluster's coordinator" in capsys.readouterr().err


def test_only_jaxs_missing_coordinator_in_detection_mode_is_reworded(monkeypatch):
  """The "no cluster detected" explanation replaces JAX's error only where it applies: in
  detection mode and for the missing coordinator address. Another ValueError, or one from a
  job given an explicit --coordinator, reaches the caller unchanged."""
  def fail(message):
    def initialize(*args, **kwargs):
      raise ValueError(message)
    return initialize

  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  for name in ("MFOPT_COORDINATOR", "MFOPT_NUM_PROCESSES", "MFOPT_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  explicit = dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1,
                  cpu_collectives=None)
  monkeypatch.setattr(jax.distributed, "initialize", fail("coordinator_address is unreachable"))
  with pytest.raises(ValueError, match=r"^coordinator_address is unreachable$"):
    distributed.initialize(**explicit)
  monkeypatch.setenv("MFOPT_DISTRIBUTED", "1")
  monkeypatch.setattr(jax.distributed, "initialize", fail("process_id out of range"))
  with pytest.raises(ValueError, match=r"^process_id out of range$"):
    distributed.initialize(cpu_collectives=None)
  monkeypatch.setattr(jax.distributed, "initialize", fail("coordinator_address should be defined."))
  with pytest.raises(ValueError, match=r"JAX detected no cluster here .*JAX said: "
                                       r"coordinator_address should be defined\.$"):
    distributed.initialize(cpu_collectives=None)


def test_port_check_ignores_time_wait_but_not_a_listener():
  """A rerun on a fixed port was refused for about a minute: the probe bound without
  SO_REUSEADDR, so the last job's TIME_WAIT connections counted (gRPC binds with it)."""
  import socket
  server = socket.socket()
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  client = socket.create_connection(("127.0.0.1", port))
  conn, _ = server.accept()
  with pytest.raises(ValueError, match=rf"coordinator port {port} .* is in use"):
    distributed._check_port_free(f"127.0.0.1:{port}")  # a live listener
  conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
  server.close()
  client.close()
  distributed._check_port_free(f"127.0.0.1:{port}")  # free to bind again for gRPC


def test_single_process_experiments_are_refused_in_a_multi_process_job(monkeypatch, tmp_path):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(runner.ConfigError,
                     match=r"'adpsgd_table' does not run as several processes yet"):
    runner.run_experiment("adpsgd_table", quick=True, workdir=tmp_path)
  assert not (tmp_path / "config.json").exists()  # refused before anything was written


@pytest.mark.parametrize("name,field", [
    ("mf_mlp", "num_workers"), ("mf_lstm", "num_workers"), ("mf_sweep", "workers"),
    ("mf_batch_workers", "workers"), ("bn_variance", "train_workers"),
    ("block_momentum_mu_vs_p", "workers"), ("block_momentum_table", "num_workers"),
    ("adpsgd_variance", "num_workers"), ("hybrid_vs_baselines", "num_workers"),
    ("hybrid_warmup_T", "num_workers"), ("precision", "num_workers"),
    ("bn_strategies", "num_workers"), ("quickstart", "num_workers")])
def test_worker_counts_that_cannot_split_over_the_processes_stop_before_training(
    monkeypatch, tmp_path, name, field):
  """Every multi-process experiment names its worker field and the fix before anything
  trains (the README says so); without the check some failed in worker_mesh, unnamed."""
  monkeypatch.setattr(jax, "process_count", lambda: 5)  # no default worker count divides
  # (one real process: the settings comparison's collectives would span 5 that do not exist)
  monkeypatch.setattr(runner, "require_same_settings_on_every_process", lambda settings: None)
  monkeypatch.setattr(train, "fit", lambda *a, **k: pytest.fail("trained"))
  with pytest.raises(runner.ConfigError, match=rf"config field '{field}': worker counts .* not "
                                              r"multiples of the 5 processes"):
    runner.run_experiment(name, quick=True, workdir=tmp_path)


def test_a_coordinator_port_in_use_is_named():
  import socket
  with socket.socket() as s:
    s.bind(("", 0))
    s.listen()
    port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"coordinator port {port} .* is in use"):
      distributed._check_port_free(f"127.0.0.1:{port}")


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_sigterm_to_the_launcher_stops_its_processes(tmp_path):
  """A scheduler's cancel (SIGTERM) to launch_local used to leave both children running,
  re-parented to init; it now passes the signal on and exits 128 + 15."""
  # Each child writes its pid to a temporary name and renames it into place, so the file the
  # test waits for is never seen half-written (CI once read an empty one).
  child = ("import pathlib, os, time; d = pathlib.Path(os.environ['OUT']); "
           "i = os.environ['MFOPT_PROCESS_ID']; (d / ('.' + i)).write_text(str(os.getpid())); "
           "(d / ('.' + i)).rename(d / i); time.sleep(120)")
  proc = subprocess.Popen([sys.executable, str(LAUNCH), "-n", "2", "--", "-c", child],
                          env=dict(os.environ, OUT=str(tmp_path)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 30
  while not all((tmp_path / str(i)).exists() for i in range(2)) and time.monotonic() < deadline:
    time.sleep(0.05)
  pids = [int((tmp_path / str(i)).read_text()) for i in range(2)]
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert "got SIGTERM" in err
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_sigterm_during_the_grace_period_still_stops_the_processes(tmp_path):
  """After one process failed, the launcher waits up to --grace for the others; a cancel in
  that window used to be recorded and dropped (the launcher sat out the whole grace period and
  exited with the child's code). It is forwarded now, and the launcher exits 128 + 15."""
  child = ("import os, pathlib, sys, time; i = os.environ['MFOPT_PROCESS_ID']\n"
           "if i == '0': sys.exit(3)\n"
           "pathlib.Path(os.environ['OUT'], 'up').write_text(str(os.getpid())); time.sleep(120)")
  proc = subprocess.Popen([sys.executable, str(LAUNCH), "-n", "2", "--grace", "60", "--",
                           "-c", child], env=dict(os.environ, OUT=str(tmp_path)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and not (tmp_path / "up").exists():
    time.sleep(0.05)
  # the launcher has seen process 0's exit once it reports it (its poll loop: 50 ms)
  time.sleep(1.0)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  try:
    _, err = proc.communicate(timeout=20)
  finally:
    proc.kill()
    try:  # (so that a failure leaves nothing running)
      os.kill(int((tmp_path / "up").read_text()), signal.SIGKILL)
      survivor = True
    except ProcessLookupError:
      survivor = False
  assert "process 0" in err and "died: exit code 3" in err, err
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert "got SIGTERM" in err
  assert time.monotonic() - t0 < 15
  assert not survivor


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_a_failed_job_leaves_no_process_its_children_started(tmp_path):
  """Each process leads its own group; the launcher used to kill the process alone, so
  whatever it had started (here a ``sleep``) outlived the job. The whole group goes now."""
  child = ("import os, pathlib, subprocess, sys, time; i = os.environ['MFOPT_PROCESS_ID']\n"
           "if i == '0': time.sleep(1); sys.exit(3)\n"
           "g = subprocess.Popen(['sleep', '120'])\n"
           "pathlib.Path(os.environ['OUT'], 'g').write_text(str(g.pid)); time.sleep(120)")
  proc = subprocess.run([sys.executable, str(LAUNCH), "-n", "2", "--grace", "1", "--", "-c",
                         child], env=dict(os.environ, OUT=str(tmp_path)), capture_output=True,
                        text=True, timeout=60)
  grandchild = int((tmp_path / "g").read_text())
  try:
    alive = True
    os.kill(grandchild, 0)
    # a zombie has not been reaped by its (dead) parent yet: dead all the same
    alive = "Z" not in pathlib.Path(f"/proc/{grandchild}/stat").read_text().split()[2]
  except (ProcessLookupError, FileNotFoundError):
    alive = False
  finally:
    if alive:
      os.kill(grandchild, signal.SIGKILL)
  assert proc.returncode == 3, proc.stderr
  assert not alive


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_the_launcher_signals_no_process_group_whose_leader_it_has_reaped(tmp_path):
  """Process groups are signalled by their leader's pid. Once a child is reaped its pid can be
  reused, and a group led by the new owner would take the launcher's SIGKILL; children used to
  be reaped (Popen.poll) as soon as they exited, and their groups killed after the grace
  period. Here the driver checks, at every killpg, that the leader is still unreaped."""
  driver = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("launch_local", {str(LAUNCH)!r})
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
real, calls = os.killpg, []
def killpg(pgid, sig):
  try:
    os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    calls.append("unreaped")
  except ChildProcessError:
    calls.append("reaped")
  return real(pgid, sig)
os.killpg = killpg
child = ("import os, sys, time\\n"
         "if os.environ['MFOPT_PROCESS_ID'] == '0': time.sleep(0.5); sys.exit(3)\\n"
         "time.sleep(120)")
code = launch.main(["-n", "2", "--grace", "1", "--", "-c", child])
print("CALLS", calls)
sys.exit(code)
"""
  proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 3, proc.stderr
  calls = next(line for line in proc.stdout.splitlines() if line.startswith("CALLS"))
  assert "'unreaped'" in calls and "'reaped'" not in calls, calls


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_the_launcher_names_the_process_that_exited_first_when_several_are_found_dead():
  """Two processes found dead at one poll: the launcher names (and returns the code of) the
  one that exited first, not the lowest index. Here its first poll sleeps 2.5 s, by which time
  process 1 (exit 3 at once) and then process 0 (exit 4 after 1 s) have both ended."""
  driver = f"""
import importlib.util, sys, time, types
spec = importlib.util.spec_from_file_location("launch_local", {str(LAUNCH)!r})
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
slept = []
def sleep(s):
  slept.append(s)
  time.sleep(2.5 if len(slept) == 1 else s)
launch.time = types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep)
child = ("import os, sys, time\\n"
         "if os.environ['MFOPT_PROCESS_ID'] == '0': time.sleep(1.0); sys.exit(4)\\n"
         "sys.exit(3)")
sys.exit(launch.main(["-n", "2", "--grace", "1", "--", "-c", child]))
"""
  proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 3, (proc.returncode, proc.stderr)
  assert re.search(r"process 1 \(pid \d+\) died: exit code 3", proc.stderr), proc.stderr
  assert re.search(r"process 0 \(pid \d+\) then ended: exit code 4", proc.stderr), proc.stderr


@pytest.mark.slow  # child processes (no JAX in them: seconds)
def test_sigterm_while_the_launcher_starts_its_processes_stops_them(tmp_path):
  """A cancel that lands while the children are being started: the handlers used to be
  installed after the last start, so SIGTERM then killed the launcher alone (exit -15) and
  left the started children (own sessions) running. Here the launcher runs in a driver whose
  Popen signals the driver right after the first child starts."""
  driver = f"""
import importlib.util, os, pathlib, signal, subprocess, sys
spec = importlib.util.spec_from_file_location("launch_local", {str(LAUNCH)!r})
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
real = subprocess.Popen
class Popen(real):
  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    (pathlib.Path({str(tmp_path)!r}) / str(self.pid)).touch()
    os.kill(os.getpid(), signal.SIGTERM)
subprocess.Popen = Popen
sys.exit(launch.main(["-n", "2", "--", "-c", "import time; time.sleep(120)"]))
"""
  proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                        timeout=60)
  pids = [int(p.name) for p in tmp_path.iterdir()]
  alive = []
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)  # (so that a failure leaves nothing running)
      alive.append(pid)
    except ProcessLookupError:
      pass
  assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr)
  assert "got SIGTERM; stopping the" in proc.stderr
  assert pids and not alive


def test_launcher_draws_its_coordinator_port_below_the_ephemeral_range(monkeypatch):
  """The coordinator's port is bound seconds after it is chosen: one the kernel handed out
  (bind to 0) could meanwhile go to another job's gloo or gRPC socket, which draw from the
  ephemeral range. It is drawn below that range now, free, and the kernel's pick is the
  fallback when the range starts too low to leave room."""
  import importlib.util
  import socket
  spec = importlib.util.spec_from_file_location("launch_local", LAUNCH)
  launch = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launch)
  lo = launch._ephemeral_start()
  assert lo == int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
  ports = {launch.free_port() for _ in range(20)}
  assert all(10000 <= p < lo for p in ports) and len(ports) > 1  # drawn, not one fixed port
  for p in ports:
    with socket.socket() as s:
      s.bind(("127.0.0.1", p))  # free
  monkeypatch.setattr(launch, "_ephemeral_start", lambda: 2000)
  assert launch.free_port() >= lo  # the kernel's pick, from the ephemeral range


def test_launcher_port_draw_skips_a_taken_port_and_reads_the_range_defensively(monkeypatch):
  """The draw is from [10000, start of the ephemeral range) (the start itself is ephemeral),
  a taken port is skipped for the next draw rather than ending the search, and an unreadable
  or empty ip_local_port_range falls back to Linux's default start, 32768."""
  import importlib.util
  import socket
  import types
  spec = importlib.util.spec_from_file_location("launch_local", LAUNCH)
  launch = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launch)
  with socket.socket() as taken, socket.socket() as probe:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    probe.bind(("127.0.0.1", 0))
    free = probe.getsockname()[1]
    probe.close()
    draws, calls = [taken.getsockname()[1], free], []

    class Rng:
      def randrange(self, a, b):
        calls.append((a, b))
        return draws[len(calls) - 1]

    monkeypatch.setattr(launch.random, "SystemRandom", Rng)
    monkeypatch.setattr(launch, "_ephemeral_start", lambda: 20000)
    assert launch.free_port() == free
    assert calls == [(10000, 20000)] * 2
  monkeypatch.undo()
  for text in ("", "abc 60999"):
    fake = types.SimpleNamespace(Path=lambda _p, t=text: types.SimpleNamespace(
        read_text=lambda: t))
    monkeypatch.setattr(launch, "pathlib", fake)
    assert launch._ephemeral_start() == 32768


def test_distributed_outside_a_cluster_says_what_to_pass_instead(tmp_path):
  """--distributed with no cluster to detect failed with JAX's bare "coordinator_address
  should be defined."; it now says that no cluster was detected and what to pass instead."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "OMPI_", "MFOPT_"))}  # (no cluster, whatever runs CI)
  out = subprocess.run([sys.executable, "-m", "experiments", "quickstart", "--quick",
                        "--distributed", "--workdir", str(tmp_path), "progress=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  assert re.search(r"error: --distributed \(MFOPT_DISTRIBUTED=1\): JAX detected no cluster here"
                   r" .*pass --coordinator HOST:PORT --num-processes N --process-id I", out.stderr)
  assert not (tmp_path / "metrics.jsonl").exists()


def test_distributed_flags_win_over_the_environment_for_every_setting():
  """Flags come first, then MFOPT_*: a launcher's environment must not override an explicit
  --coordinator or --num-processes (a mixed-up job would join the wrong coordinator); empty
  variables count as unset, and "0" in MFOPT_DISTRIBUTED does not ask for cluster detection."""
  env = {"MFOPT_COORDINATOR": "10.0.0.1:8476", "MFOPT_NUM_PROCESSES": "4", "MFOPT_PROCESS_ID": "3",
         "MFOPT_HEARTBEAT_TIMEOUT": "20"}
  got = distributed.resolve("h:99", 2, 1, 7, environ=env)
  assert got == distributed.DistributedConfig("h:99", 2, 1, 7)
  blank = {"MFOPT_COORDINATOR": "", "MFOPT_NUM_PROCESSES": "", "MFOPT_PROCESS_ID": "",
           "MFOPT_HEARTBEAT_TIMEOUT": ""}
  assert distributed.resolve(environ=blank) is None
  assert distributed.resolve(environ={"MFOPT_DISTRIBUTED": "0"}) is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(heartbeat_timeout_s=0), r"heartbeat_timeout_s must be positive, got 0"),
    (dict(coordinator_address=":8476"), r"coordinator_address must look like host:port"),
])
def test_distributed_settings_refuse_a_zero_heartbeat_and_an_address_without_host(kwargs, match):
  """A heartbeat timeout of 0 s would abort the job at once, and ':8476' names no host; both are
  refused before JAX starts, like the other malformed settings."""
  settings = dict(coordinator_address="h:1", num_processes=2, process_id=0) | kwargs
  with pytest.raises(ValueError, match=match):
    distributed.resolve(**settings, environ={})


def test_distributed_address_is_split_at_its_last_colon():
  """The port is what follows the last colon, so a bracketed IPv6 coordinator is accepted."""
  got = distributed.resolve("[::1]:8476", 2, 0, environ={})
  assert got.coordinator_address == "[::1]:8476"


def _fake_join(monkeypatch, count):
  """jax.distributed stand-ins: records initialize's arguments and the port checks."""
  calls, ports = [], []
  for name in ("MFOPT_COORDINATOR", "MFOPT_NUM_PROCESSES", "MFOPT_PROCESS_ID",
               "MFOPT_HEARTBEAT_TIMEOUT", "MFOPT_INIT_TIMEOUT", "MFOPT_DISTRIBUTED",
               "MFOPT_NUM_CPU_DEVICES"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax, "process_count", lambda: count)
  monkeypatch.setattr(distributed, "_check_port_free", ports.append)
  return calls, ports


def test_initialize_passes_jax_its_own_keywords_and_checks_the_port_on_process_0(
    monkeypatch, capsys):
  """initialize forwards the timeouts under the names jax.distributed.initialize takes (a
  misspelt keyword fails only in a real multi-process job), waits 300 s by default, and only
  process 0, which hosts the coordination service, checks that its port is free."""
  import inspect
  real = inspect.signature(jax.distributed.initialize).parameters
  calls, ports = _fake_join(monkeypatch, 2)
  distributed.initialize("127.0.0.1:5", 2, 1, heartbeat_timeout_s=9, cpu_collectives=None)
  assert calls == [(("127.0.0.1:5", 2, 1),
                    {"initialization_timeout": 300, "heartbeat_timeout_seconds": 9})]
  assert set(calls[0][1]) <= set(real) and ports == []
  distributed.initialize("127.0.0.1:5", 2, 0, cpu_collectives=None)
  assert ports == ["127.0.0.1:5"]
  assert "waits up to 300 s" in capsys.readouterr().err


def test_initialize_refuses_a_zero_timeout_and_a_process_count_other_than_the_jobs(monkeypatch):
  """An initialization timeout of 0 s could never let the peers join; and a process told the
  job has 2 processes when the coordinator's job has 3 must stop, not train on a wrong split."""
  calls, _ = _fake_join(monkeypatch, 3)
  with pytest.raises(ValueError, match=r"initialization_timeout_s must be positive, got 0"):
    distributed.initialize("127.0.0.1:5", 2, 1, cpu_collectives=None, initialization_timeout_s=0)
  assert calls == []
  with pytest.raises(ValueError, match=r"num_processes .* is 2 here but the job that process 0 "
                                       r"started has 3 processes"):
    distributed.initialize("127.0.0.1:5", 2, 1, cpu_collectives=None)
