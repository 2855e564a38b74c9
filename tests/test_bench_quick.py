"""``--quick`` mode of every benchmark (issue 8): it runs, and the HLO counts hold.

Timings are not checked (CI machines are shared); what is checked are facts with an
independent reference: the byte convention of the update benchmark against optax's own
state, and the collective counts/bytes of ``bench_comm`` against the parameter bytes of
the benchmark's MLP computed here by hand. The arithmetic from timings to figures and
verdicts (ratio directions, medians, warm-ups left out, thresholds, which variant is the
baseline) is checked with given medians or a fake clock, nothing timed.
"""

import math
import re

import jax
import pytest

from experiments import (bench_comm, bench_fit_dispatch, bench_input, bench_train_step, bench_update,
                         bench_virtual_workers)

# MLP 784-64-10 of bench_comm: (784*64 + 64) + (64*10 + 10) float32 parameters.
MLP_PARAM_BYTES = 4 * ((784 * 64 + 64) + (64 * 10 + 10))


def _figures(result):
  return [f for f in result["figures"] if "name" in f]


def test_bench_update_quick_runs_with_optax_byte_convention():
  result = bench_update.main(["--quick"])
  figs = _figures(result)
  assert figs, "no figure: not a single transform on main?"
  for f in figs:
    if "ratio" not in f:
      continue
    assert math.isfinite(f["ratio"]) and f["ratio"] > 0
    # optax.sgd(momentum)/lars keep 1 parameter-sized array (20 B/param), optax.adam 2 (28 B).
    want = 28 if f["baseline"] == "optax.adam" else 20
    assert f["bytes_per_param"] == want, f
    assert f["gbs_optax"] > 0 and f["gbs_mfopt"] > 0
  names = {f["transform"] for f in figs if "transform" in f}
  assert "mf_sgd" in names  # issue 3 is on main
  # Quick mode judges the compiled every-step bytes (one more parameter-sized buffer kept by a
  # transform passed unnoticed) and lists the timing targets unjudged.
  traffic = [t for t in result["targets"] if "compiled every-step traffic" in t["name"]]
  assert len(traffic) >= 9 and all(t["passed"] for t in traffic), traffic
  # +1% for every pair; only the hybrid's AdaBound phase on XLA:CPU gets 1.11 (44 vs 40 B/param)
  import jax
  cpu = jax.default_backend() == "cpu"
  assert {t["name"]: t["threshold"] for t in traffic} == {
      t["name"]: 1.11 if cpu and "hybrid_adabound_lars[adabound phase]" in t["name"] else 1.01
      for t in traffic}
  assert sum(t["threshold"] == 1.11 for t in traffic) == (1 if cpu else 0)
  assert all(t["passed"] is None for t in result["targets"] if t not in traffic)


def test_bench_comm_quick_hlo_counts_hold():
  result = bench_comm.main(["--quick"])
  assert result["passed"], [t for t in result["targets"] if t["passed"] is False]
  assert len(result["targets"]) >= 6
  rows = {f["transform"]: f for f in _figures(result) if "transform" in f}
  sync = rows["sync_gradients f32"]
  assert sync["hlo_every_step_bytes"] == MLP_PARAM_BYTES
  assert sync["counter_payload_bytes"] == 8 * MLP_PARAM_BYTES  # 8 steps
  bf16 = rows["sync_gradients bf16"]
  # Program bytes are per device: W=16 workers on 8 devices, 2 per device under vmap.
  assert sync["program_every_step_bytes"] == 2 * MLP_PARAM_BYTES
  assert bf16["program_every_step_bytes"] == 2 * MLP_PARAM_BYTES // 2
  assert bf16["program_every_step_dtypes"] == ["bfloat16"]
  fast = rows["fast path (sync SGD)"]
  assert fast["hlo_every_step_bytes"] == MLP_PARAM_BYTES and fast["counter_all_reduces"] == 8
  if "periodic_averaging p=4" in rows:
    pa = rows["periodic_averaging p=4"]
    assert pa["hlo_every_step_bytes"] < 64 and pa["hlo_sync_branch_bytes"] >= MLP_PARAM_BYTES
    # floor(8 / 4) parameter exchanges, exactly (>= let averaging on every step pass)
    assert pa["counter_all_reduces"] == 2
    assert pa["counter_payload_bytes"] == 2 * MLP_PARAM_BYTES
  # the figure: payload bytes per step from the counters (8 steps)
  for f in rows.values():
    assert f["value"] == f["counter_payload_bytes"] / 8 and f["unit"] == "B/step (counters)"
  ad = next(f for name, f in rows.items() if name.startswith("adpsgd"))
  assert ad["counter_all_reduces"] >= 2  # each sync: the parameters and S_k (4 bytes)
  assert ad["counter_payload_bytes"] == ad["counter_all_reduces"] // 2 * (MLP_PARAM_BYTES + 4)


def test_bench_train_step_quick_runs():
  result = bench_train_step.main(["--quick"])
  ratios = [f for f in _figures(result) if "ratio" in f]
  assert {f["dtype"] for f in ratios} == {"bf16", "fp32"}
  assert all(math.isfinite(f["ratio"]) and f["ratio"] > 0 for f in ratios)


def test_bench_train_step_compares_like_with_like():
  """The two steps the benchmark times compute the same update (plain flax+optax is the
  reference): one step of each from the same initialisation, fp32."""
  import jax
  import numpy as np
  import optax

  import mfopt
  from mfopt import models, parallel
  model = models.get_model("cnn", features=(4, 8), num_classes=10)
  x, y = bench_train_step.synthetic(4, 8, 10)
  sgd = optax.sgd(0.1, momentum=0.9)
  plain = bench_train_step.plain_runner(model, sgd, x, y)
  ours = bench_train_step.mfopt_runner(
      model, optax.chain(mfopt.sync_gradients(parallel.WORKER_AXES), sgd), x[None], y[None])
  p0 = jax.device_get(plain.state[0])
  plain.call(1)
  ours.call(1)
  got = jax.tree.map(lambda a: np.asarray(a)[0], jax.device_get(ours.state.params))
  want = jax.device_get(plain.state[0])
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want),
                                                          jax.tree.leaves(p0)))
  assert moved > 1e-4
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bench_virtual_workers_quick_runs():
  result = bench_virtual_workers.main(["--quick"])
  variants = {f["variant"] for f in _figures(result) if "variant" in f}
  assert variants == {"one replica @ W*B", "one replica @ B", "fast path", "vmap sync",
                      "vmap local", "lax.map local", "auto local", "gemm local", "unroll local",
                      "fast path cost", "sequential reference"}
  # the sequential reference is t(one @ W*B) / (W x t(one @ B)), from the timed medians
  timing = {f["variant"]: f["timing"]["median_s"] for f in _figures(result) if "timing" in f}
  (seq,) = [f for f in _figures(result) if f.get("variant") == "sequential reference"]
  assert seq["value"] == pytest.approx(
      timing["one replica @ W*B"] / (2 * timing["one replica @ B"]), rel=1e-9)
  # XLA's cost estimate: the fast path does one replica's work, not W replicas' worth. Its
  # GroupBatchNorm's hand-written backward pass takes fewer flops than autodiff through flax's
  # BatchNorm (one replica's step): about 0.91x on this tiny CNN, where BN is a large share.
  (cost,) = [f for f in _figures(result) if f.get("variant") == "fast path cost"]
  plain, fast = cost["cost"]
  assert 0.8 <= fast["flops"] / plain["flops"] < 1.1
  # the automatic lowering made its choice by timing its candidates (2 workers: no map:K)
  auto = [f for f in _figures(result) if f["name"].startswith("W=2 B=2 | auto local (chose ")]
  assert len(auto) == 1
  assert re.search(r"\(chose (vmap|map|unroll|gemm)\)", auto[0]["name"]), auto[0]["name"]
  assert all(f"{c} " in auto[0]["details"] for c in ("vmap", "map", "unroll", "gemm")), \
      auto[0]["details"]


def test_with_compiler_options_compiles_under_the_option_and_keeps_the_state():
  """A runner recompiled with XLA options runs that program: with the fusion passes off the
  entry holds one fusion per elementwise op instead of one fusion for all, and the result is
  the same function of the threaded state."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from experiments import _bench
  f = jax.jit(lambda s, a: (jnp.sin(s) * a + 1.0) * 2.0, donate_argnums=0)
  default = _bench.Runner(f, jnp.ones(64), (jnp.float32(3.0),))
  flagged = _bench.with_compiler_options(
      _bench.Runner(f, jnp.ones(64), (jnp.float32(3.0),)),
      {"xla_disable_hlo_passes": "fusion,cpu-fusion,loop-fusion"})
  fusions = lambda text: len(re.findall(r"= \S+ fusion\(", text))  # noqa: E731
  assert fusions(f.lower(default.state, *default.args).compile().as_text()) == 1
  assert fusions(flagged.fn.as_text()) > 1
  default.call(2)
  flagged.call(2)
  want = (np.sin((np.sin(1.0) * 3 + 1) * 2) * 3 + 1) * 2
  np.testing.assert_allclose(flagged.state, np.full(64, want), rtol=1e-5)
  np.testing.assert_allclose(default.state, flagged.state, rtol=1e-6)
  with pytest.raises(ValueError, match="runner.fn="):
    _bench.with_compiler_options(_bench.Runner(lambda s: s, 0), {})


def test_parse_option_types_values_for_xla():
  assert bench_virtual_workers.parse_option("a_flag=true") == ("a_flag", True)
  assert bench_virtual_workers.parse_option("n = -3") == ("n", -3)
  assert bench_virtual_workers.parse_option("mode=CONCURRENT") == ("mode", "CONCURRENT")
  with pytest.raises(Exception, match="NAME=VALUE"):
    bench_virtual_workers.parse_option("mode")


def test_bench_virtual_workers_stretch_only_times_the_stretch_runners_and_their_variants():
  # an option XLA does not know skips its variants with a note instead of ending the run
  result = bench_virtual_workers.main(["--quick", "--stretch-only", "--bn-variants",
                                       "--compiler-option", "no_such_xla_option=1"])
  notes = [f["note"] for f in result["figures"] if "note" in f]
  assert any("no_such_xla_option=1] not compiled" in n for n in notes), notes
  names = {f["name"].split(" | ", 1)[1] for f in _figures(result) if "timing" in f}
  # every runner's compile + warm-up time is noted as it finishes (before any figure)
  warmed = {n.split(" | ")[1].split(": compiled")[0] for n in notes if "warmed up in" in n}
  assert warmed == names, (warmed, names)
  assert names == {"one replica @ W*B", "one replica @ B", "lax.map local", "unroll local",
                   "lax.map local (bn_impl='mfopt')", "unroll local (bn_impl='mfopt')"}
  # no fast path and no auto: their targets are not listed; the best local counts the variants
  assert not any(t["name"].startswith(("4a", "4b: auto")) for t in result["targets"])
  timing = {f["name"].split(" | ", 1)[1]: f["timing"]["median_s"] for f in _figures(result)
            if "timing" in f}
  (best,) = [f for f in _figures(result) if "best local lowering" in f["name"]]
  assert best["value"] == pytest.approx(
      timing["one replica @ W*B"] / min(v for k, v in timing.items() if "local" in k), rel=1e-9)


def test_time_interleaved_drops_a_failing_runner_only_when_asked():
  """A runner whose compile or warm-up raises is reported through on_error and left out (its
  timing is None); the others are timed. Without on_error the error propagates."""
  import jax
  import jax.numpy as jnp

  from experiments import _bench

  def broken(state):
    raise RuntimeError("RESOURCE_EXHAUSTED: simulated")

  def good():
    return _bench.Runner(jax.jit(lambda s: s + 1.0, donate_argnums=0), jnp.zeros(8))

  ok1, ok2 = good(), good()
  errors, warmed = [], []
  got = _bench.time_interleaved([ok1, _bench.Runner(broken, 0), ok2], warmup=1, reps=3, iters=2,
                                on_warm=lambda i, s: warmed.append(i),
                                on_error=lambda i, e: errors.append((i, str(e))))
  assert got[1] is None and errors == [(1, "RESOURCE_EXHAUSTED: simulated")]
  assert warmed == [0, 2]
  assert [len(t.samples) for t in (got[0], got[2])] == [3, 3]
  # 1 warm-up + 3 reps x 2 iterations, each adding 1
  assert float(ok1.state[0]) == float(ok2.state[0]) == 7.0
  with pytest.raises(RuntimeError, match="simulated"):
    _bench.time_interleaved([good(), _bench.Runner(broken, 0)], warmup=1, reps=1, iters=1)


def test_time_interleaved_alternates_the_order_of_each_round():
  """A fixed order gave the first runner every round's cold start."""
  from experiments import _bench
  calls = []

  class Recorder(_bench.Runner):
    def __init__(self, name):
      super().__init__(lambda s: s, 0)
      self.name = name

    def call(self, iters):
      calls.append(self.name)
      return 1.0

  _bench.time_interleaved([Recorder("a"), Recorder("b")], warmup=0, reps=4, iters=1)
  assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]


def test_bench_virtual_workers_leaves_out_failing_programs_and_times_the_rest(monkeypatch):
  """One program failing to build (lax.map) and one failing in its warm-up (unroll with
  GroupBatchNorm) are named in notes; the stretch figures come from the programs that ran."""
  from experiments import _bench

  real = bench_virtual_workers.mfopt_runner

  def flaky(model, inner, x, y, *, num_workers, lowering="vmap"):
    if lowering == "map":
      raise RuntimeError("simulated compile failure")
    if lowering == "unroll" and model.bn_impl == "mfopt":
      def oom(state, *args):
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated out of memory")
      return _bench.Runner(oom, None)
    return real(model, inner, x, y, num_workers=num_workers, lowering=lowering)

  monkeypatch.setattr(bench_virtual_workers, "mfopt_runner", flaky)
  result = bench_virtual_workers.main(["--quick", "--stretch-only", "--bn-variants"])
  notes = [f["note"] for f in result["figures"] if "note" in f]
  assert any("lax.map local: failed, left out: RuntimeError: simulated compile failure" in n
             for n in notes), notes
  assert any("lax.map local (bn_impl='mfopt'): failed, left out" in n for n in notes), notes
  assert any("unroll local (bn_impl='mfopt'): failed, left out: RuntimeError: "
             "RESOURCE_EXHAUSTED" in n for n in notes), notes
  timing = {f["name"].split(" | ", 1)[1]: f["timing"]["median_s"] for f in _figures(result)
            if "timing" in f}
  assert set(timing) == {"one replica @ W*B", "one replica @ B", "unroll local"}
  (best,) = [f for f in _figures(result) if "best local lowering" in f["name"]]
  assert "(unroll)" in best["name"]
  assert best["value"] == pytest.approx(timing["one replica @ W*B"] / timing["unroll local"],
                                        rel=1e-9)
  assert not any("bn_impl='mfopt' / flax BatchNorm" in f["name"] for f in _figures(result))


def test_plain_data_parallel_baseline_computes_mfopt_sync_step():
  """The multi-device baseline (--devices N) is like for like: the textbook shard_map + pmean
  flax/optax step and mfopt's W = N synchronized step, from the same initialisation, give the
  same parameters, momentum and per-device BatchNorm statistics after 3 steps."""
  import jax
  import numpy as np
  import optax

  import mfopt
  from mfopt import models, parallel

  n = len(jax.devices())
  assert n > 1  # conftest: 8 fake CPU devices
  model = models.get_model("cnn", features=(4, 8), num_classes=10)
  x, y = bench_train_step.synthetic(n * 4, 8, 10)
  sgd = optax.sgd(0.1, momentum=0.9)
  sync = optax.chain(mfopt.sync_gradients(parallel.WORKER_AXES), sgd)
  mf = bench_train_step.mfopt_runner(model, sync, x.reshape(n, 4, *x.shape[1:]),
                                     y.reshape(n, 4), num_workers=n, devices=n)
  plain = bench_train_step.plain_dp_runner(model, sgd, x, y, n)
  mf.call(3)
  plain.call(3)
  params, stats, opt_state = jax.device_get(plain.state)
  mf_state = jax.device_get(mf.state)
  check = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)  # noqa: E731
  for w in range(n):  # every worker holds the replicated parameters
    jax.tree.map(lambda a, b: check(a[w], b), mf_state.params, params)
  jax.tree.map(check, mf_state.model_state["batch_stats"], stats)  # per device / worker
  # momentum: optax.sgd's trace, inside the chain after sync_gradients' counters
  mf_trace = [s for s in jax.tree.leaves(mf_state.opt_state, is_leaf=lambda s: isinstance(
      s, optax.TraceState)) if isinstance(s, optax.TraceState)]
  (plain_trace,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(
      s, optax.TraceState)) if isinstance(s, optax.TraceState)]
  jax.tree.map(lambda a, b: check(a[0], b), mf_trace[0].trace, plain_trace.trace)
  # and the parameters moved: the comparison is not of two initialisations
  init, _ = models.init_model(model, jax.random.PRNGKey(0), x[:1])
  assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(init))) > 1e-3


def test_time_targets_are_judged_except_in_quick_mode_and_on_fake_cpu_devices():
  judged = bench_train_step.judged
  assert judged(quick=False, gpu=False, devices=1) == (True, "")
  assert judged(quick=False, gpu=True, devices=8) == (True, "")  # 8 real GPUs
  assert judged(quick=False, gpu=False, devices=8) == (
      False, "8 fake CPU devices: ratios reported only")
  assert judged(quick=True, gpu=True, devices=1) == (False, "quick mode")


def test_bench_train_step_quick_on_8_devices_reports_ratios_only():
  result = bench_train_step.main(["--quick", "--devices", "8"])
  names = [f["name"] for f in _figures(result)]
  assert any("x 8 devices bf16 | mfopt sync step / plain data-parallel" in n for n in names)
  assert any("periodic_averaging sync step" in n for n in names)
  (sync,) = [f for f in _figures(result) if "periodic_averaging sync step" in f["name"]]
  assert "8-way all-reduce" in sync["details"]
  assert result["targets"] and not any(t["applies"] for t in result["targets"])
  with pytest.raises(SystemExit, match="--devices must be positive, got 0"):
    bench_train_step.main(["--quick", "--devices", "0"])
  with pytest.raises(SystemExit, match="--devices 64: only 8 cpu device"):
    bench_train_step.main(["--quick", "--devices", "64"])


def test_gpu_plan_calls_run_in_quick_mode(monkeypatch, tmp_path):
  """scripts/gpu_plan.sh: every planned device call's benches accept their flags and run with
  --quick on this CPU (shapes dropped: what `--check` runs; here in this process, but for the
  three benches that set up their own devices, each in a fresh interpreter as on the device:
  36 s against 63 s for `--check`'s 13 interpreters, both with a warm compilation cache on the
  idle 2-core VM), `--check` reports a failing bench, and the
  plan refuses what it cannot run here (a multi-GPU call without GPUs, an unknown call)
  instead of spending a device call."""
  import importlib
  import os
  import pathlib
  import shlex
  import subprocess
  import sys

  root = pathlib.Path(__file__).resolve().parents[1]
  env = {**os.environ, "PYTHON": sys.executable}
  run = lambda *a, **kw: subprocess.run(["bash", "scripts/gpu_plan.sh", *a], cwd=root,  # noqa: E731
                                        env={**env, **kw}, capture_output=True, text=True,
                                        timeout=600)
  listed = run("--list")
  assert listed.returncode == 0 and "call 1:" in listed.stdout
  assert "--stretch-only --bn-variants" in listed.stdout
  commands = [line.split("\t") for line in run("--check-list").stdout.splitlines()]
  assert len(commands) >= 12 and ["9", "bench_fit_dispatch", ""] in commands
  # call 7 on this CPU: the 8 fake devices of target 6, the collectives on CPU devices
  assert ["7", "bench_comm", "--platform cpu"] in commands
  assert ["7", "bench_train_step", "--devices 8"] in commands
  assert not any("--shapes" in args or "GPUS" in args or "--reps" in args
                 for _, _, args in commands)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # profile_step adds to it
  # Benches that set up their own CPU devices run as the device call runs them, in a fresh
  # interpreter: in this process conftest's 8 devices would cover for a broken setup.
  fresh = lambda bench, args: bench in ("bench_comm", "bench_fit_dispatch") or (  # noqa: E731
      "--devices" in args)
  for n, bench, args in commands:
    if fresh(bench, args):
      out = subprocess.run([sys.executable, "-m", f"experiments.{bench}", "--quick",
                            *shlex.split(args)], cwd=root, capture_output=True, text=True,
                           timeout=600)
      assert out.returncode == 0, f"call {n}: {bench} --quick {args}: {out.stderr[-2000:]}"
      continue
    try:
      importlib.import_module(f"experiments.{bench}").main(["--quick", *shlex.split(args)])
    except BaseException as e:  # SystemExit included: a refused flag
      raise AssertionError(f"call {n}: {bench} --quick {args}: {e!r}") from e
  assert sum(fresh(b, a) for _, b, a in commands) == 3  # call 7's two, call 9
  # --check runs the same commands, one interpreter each, and names the one that fails
  fake = tmp_path / "python"
  fake.write_text('#!/usr/bin/env bash\necho "$*" >> "$LOG"\n[[ "$*" != *bench_update* ]]\n')
  fake.chmod(0o755)
  check = run("--check", PYTHON=str(fake), LOG=str(tmp_path / "log"))
  assert check.returncode == 1 and check.stdout.count("call ") == len(commands)
  assert check.stdout.count("FAILED") == 1
  assert "FAILED: python -m experiments.bench_update --quick --only block" in check.stdout
  ran = (tmp_path / "log").read_text().splitlines()
  assert ran == [f"-m experiments.{b} --quick {a}".rstrip() for _, b, a in commands]
  import shutil
  if shutil.which("nvidia-smi") is None:  # (with GPUs, call 7 would run its benches)
    multi = run("7", "/tmp/unused")
    assert multi.returncode == 2 and "needs >= 2 GPUs" in multi.stdout
  assert run("10").returncode == 2


@pytest.mark.parametrize("dataset", ["imagenet2012", "cifar10"])
def test_bench_input_quick_threaded_batches_are_identical(dataset):
  """The threaded TFDS reader gives the one-thread reader's batches (per-example streams)."""
  result = bench_input.main(["--quick", "--threads", "3", "--dataset", dataset])
  figs = {f["name"]: f for f in _figures(result)}
  ratio = figs["ratio 3 threads / 1 thread"]
  assert ratio["identical_batches"] is True and ratio["value"] > 0
  assert figs["examples/s, 1 thread"]["value"] > 0 and result["targets"] == []
  assert dataset in figs["examples/s, 1 thread"]["details"]
  assert figs["normalize, in place (data._normalize)"]["identical_values"] is True
  with pytest.raises(SystemExit, match="--threads must be >= 2 .* got 1"):
    bench_input.main(["--quick", "--threads", "1"])


def test_bench_fit_dispatch_quick_reports_each_limit_against_8(monkeypatch):
  """On CPU: limits 8, 1 and 16 (no unbounded run: it deadlocks XLA:CPU), ratios to limit 8;
  fit really runs under each limit (seen at its dispatch-bound calls), then gets 8 back."""
  from mfopt import train
  limits_seen = set()
  real = train.wait_for_old_steps
  monkeypatch.setattr(train, "wait_for_old_steps", lambda window, limit=None: (
      limits_seen.add(train.MAX_STEPS_IN_FLIGHT), real(window, limit)))
  result = bench_fit_dispatch.main(["--quick"])
  assert limits_seen == {1, 8, 16} and train.MAX_STEPS_IN_FLIGHT == 8
  figs = {f["limit"]: f for f in _figures(result)}
  assert sorted(figs) == [1, 8, 16] and result["targets"] == []
  assert figs[8]["ratio_to_8"] == 1.0
  for f in figs.values():
    assert f["value"] > 0 and abs(f["ratio_to_8"] - f["value"] / figs[8]["value"]) < 1e-9
  with pytest.raises(SystemExit, match="--steps must be positive, got -1"):
    bench_fit_dispatch.main(["--quick", "--steps", "-1"])


def test_benches_refuse_what_would_measure_nothing():
  """`bench_update --only <typo>` timed nothing and said DONE; `bench_comm --platform gpu` on a
  machine without GPUs ran on one CPU device and said DONE: a device call wasted either way."""
  import jax
  with pytest.raises(SystemExit, match=r"--only 'mf_sdg' matches no transform; names: .*mf_sgd"):
    bench_update.main(["--quick", "--only", "mf_sdg"])
  if jax.default_backend() != "gpu":
    with pytest.raises(SystemExit, match=r"--platform gpu needs >= 2 GPUs, this machine has 8 "
                                         r"cpu device\(s\)"):
      bench_comm.main(["--quick", "--platform", "gpu"])


def test_bench_update_only_is_a_substring_filter():
  """--only is documented as a substring filter on transform names: a part of a name passes
  the no-match check (here the run then stops at the invalid --inner 0, before timing)."""
  names = [name for name, *_ in bench_update.pairs()]
  assert "mf_sgd" in names and "mf_sg" not in names
  with pytest.raises(SystemExit, match=r"--inner must be >= 1, got 0"):
    bench_update.main(["--quick", "--only", "mf_sg", "--inner", "0"])


def test_timing_statistics_are_the_median_and_the_spread_of_the_samples():
  """The figure is the median seconds per call; the spread is min, max and the IQR (NumPy's
  percentiles); faults per call are the median too. Synthetic samples, no timing."""
  import numpy as np

  from experiments import _bench
  samples = [0.004, 0.001, 0.003, 0.002, 0.010]
  t = _bench.Timing(samples, faults=[7.0, 1.0, 100.0])
  assert t.median == 0.003 and t.faults == 7.0
  q1, q3 = np.percentile(samples, [25, 75])
  assert t.spread() == (f"median 3.000 ms [min 1.000 ms, max 10.000 ms, "
                        f"IQR {(q3 - q1) * 1e3:.3f} ms, n=5]")
  assert q3 - q1 == pytest.approx(0.002)
  assert t.as_dict() == {"median_s": 0.003, "samples_s": samples, "page_faults_per_call": 7.0}
  assert _bench.Timing([1.0, 2.0]).faults is None


def test_runner_times_until_the_output_is_ready_per_call(monkeypatch):
  """Runner.call's clock stops after block_until_ready of the last output (a dispatch returns
  before the device is done), and it reports seconds and page faults per call. A fake clock:
  each call dispatches in 0.5 s, the wait for the device takes 2 s; 8 faults per call."""
  from experiments import _bench
  clock = {"t": 100.0, "faults": 0, "blocked": 0}

  def fn(state, a):
    clock["t"] += 0.5
    clock["faults"] += 8
    return state + a

  def block(tree):
    clock["t"] += 2.0
    clock["blocked"] += 1
    return tree

  monkeypatch.setattr(_bench.time, "perf_counter", lambda: clock["t"])
  monkeypatch.setattr(_bench, "block", block)
  monkeypatch.setattr(_bench, "minor_faults", lambda: clock["faults"])
  r = _bench.Runner(fn, 0, (3,))
  assert r.call(4) == pytest.approx((4 * 0.5 + 2.0) / 4)
  assert r.last_faults == 8.0 and r.state == 12 and clock["blocked"] == 1


def test_report_judges_targets_at_their_thresholds_and_writes_what_bench_tables_reads(tmp_path,
                                                                                      capsys):
  """value <= / >= threshold, the threshold itself included; a target that does not apply is
  listed, not judged, and does not fail the run; the JSON (complete after finish) gives
  bench_tables' rows."""
  import argparse
  import json

  from experiments import _bench, bench_tables
  path = tmp_path / "r.json"
  args = argparse.Namespace(quick=False, json=str(path), argv=["--json", str(path)])
  rep = _bench.Report("bench_x", args)
  rep.target("at <=", 1.03, "<=", 1.03)
  rep.target("over <=", 1.0301, "<=", 1.03)
  rep.target("at >=", 0.97, ">=", 0.97)
  rep.target("under >=", 0.9699, ">=", 0.97)
  rep.target("not here", 5.0, "<=", 1.0, applies=False, why_not="quick mode")
  assert json.loads(path.read_text())["complete"] is False  # written as it goes
  assert [t["passed"] for t in rep.targets] == [True, False, True, False, None]
  printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("TARGET")]
  assert printed == ["TARGET bench_x | at <= | 1.0300 <= 1.03 | PASS",
                     "TARGET bench_x | over <= | 1.0301 <= 1.03 | FAIL",
                     "TARGET bench_x | at >= | 0.9700 >= 0.97 | PASS",
                     "TARGET bench_x | under >= | 0.9699 >= 0.97 | FAIL",
                     "TARGET bench_x | not here | 5.0000 <= 1.0 | n/a (quick mode)"]
  result = rep.finish()
  assert result["passed"] is False and result["complete"] is True
  assert json.loads(path.read_text()) == json.loads(json.dumps(result, default=str))
  text = bench_tables.section(json.loads(path.read_text()))
  assert "| at <= | 1.0300 | <= 1.03 | **PASS** |" in text
  assert "| over <= | 1.0301 | <= 1.03 | **FAIL** |" in text
  assert "| under >= | 0.9699 | >= 0.97 | **FAIL** |" in text
  assert "| not here | 5.0000 | <= 1.0 | not judged |" in text
  assert "Result: 2/4 targets met." in text and "cut off" not in text
  # only the unjudged target misses: the run passes
  rep2 = _bench.Report("bench_x", argparse.Namespace(quick=True, json=None, argv=[]))
  rep2.target("met", 1.0, ">=", 1.0)
  rep2.target("not here", 0.0, ">=", 1.0, applies=False, why_not="quick mode")
  assert rep2.finish()["passed"] is True


def _fake_timings(monkeypatch, *calls):
  """Makes _bench.time_interleaved return these medians (seconds), one tuple per call, in
  order, without running anything; returns the runners it was given."""
  from experiments import _bench
  given, queue = [], list(calls)

  def fake(runners, **kw):
    given.append(list(runners))
    medians = queue.pop(0)
    assert len(medians) == len(runners)
    return [_bench.Timing([m, m * 1.5, m * 0.9]) for m in medians]

  monkeypatch.setattr(_bench, "time_interleaved", fake)
  return given


def test_bench_update_ratio_bytes_and_traffic_target_from_given_timings(monkeypatch):
  """run_case's figures from given medians: time ratio mfopt / optax, optax's byte convention
  (SGD momentum: 20 B/param, from its state), GB/s per variant; the judged ratio is the
  inner-loop one when inner > 1; the compiled-traffic target (here Adam as the 'mfopt' side
  against SGD momentum: it moves more bytes, so the <= 1.01 check must fail)."""
  import argparse

  import jax.numpy as jnp
  import optax

  from experiments import _bench
  n = 4096
  _fake_timings(monkeypatch, (3e-3, 2e-3), (5e-3, 4e-3))
  report = _bench.Report("bench_update", argparse.Namespace(quick=False, json=None, argv=[]))
  got = bench_update.run_case(report, "flat", {"w": jnp.zeros(n)}, "adam-as-mfopt",
                              lambda: optax.adam(1e-3), lambda: optax.sgd(0.1, momentum=0.9),
                              "optax.sgd", False, warmup=1, reps=1, iters=1, inner=2)
  assert got == pytest.approx(5 / 4)  # the device-time (inner loop) ratio is the judged one
  loop, per_call = [f for f in report.figures if "ratio" in f]
  assert loop["ratio"] == pytest.approx(5 / 4) and loop["per_call_ratio"] == pytest.approx(1.5)
  assert per_call["ratio"] == per_call["value"] == pytest.approx(3 / 2)
  assert per_call["bytes_per_param"] == 20 and per_call["state_arrays_optax"] == 1
  assert per_call["state_arrays_mfopt"] == 2
  assert per_call["gbs_mfopt"] == pytest.approx(n * 20 / 3e-3 / 1e9)
  assert per_call["gbs_optax"] == pytest.approx(n * 20 / 2e-3 / 1e9)
  (target,) = report.targets
  mf, ox = per_call["traffic_bpp_mfopt"][0], per_call["traffic_bpp_optax"][0]
  assert mf > 1.2 * ox  # Adam reads and writes one more parameter-sized array than SGD
  assert (target["value"], target["op"], target["threshold"]) == (pytest.approx(mf / ox), "<=",
                                                                  1.01)
  assert target["passed"] is False


def test_bench_update_main_judges_each_ratio_against_its_target(monkeypatch):
  """main's targets from the ratios run_case returns: update cost <= 1.03 for every pair,
  target 3 (periodic averaging's local step) <= 1.01 too, the 'before' reference row not
  judged; on the CPU one update per call (no inner loop) for both shapes."""
  import jax.numpy as jnp
  ratios = {"mf_sgd": 1.02, "periodic_averaging local step": 1.02,
            f"block_momentum local step {bench_update.BEFORE}": 1.5}
  inners = []

  def fake_case(report, shape_name, params, name, *a, inner=1, **kw):
    inners.append(inner)
    return ratios.get(name)

  monkeypatch.setattr(bench_update, "run_case", fake_case)
  monkeypatch.setattr(bench_update, "resnet50_params", lambda width: {"w": jnp.zeros(8)})
  monkeypatch.setattr(bench_update, "sync_step_cost", lambda *a, **kw: None)
  result = bench_update.main(["--flat", "64"])
  got = {t["name"]: (t["value"], t["op"], t["threshold"], t["passed"]) for t in result["targets"]}
  assert got == {
      "update cost flat mf_sgd (mfopt/optax)": (1.02, "<=", 1.03, True),
      "update cost resnet50-tree(width=64) mf_sgd (mfopt/optax)": (1.02, "<=", 1.03, True),
      "update cost flat periodic_averaging local step (mfopt/optax)": (1.02, "<=", 1.03, True),
      "update cost resnet50-tree(width=64) periodic_averaging local step (mfopt/optax)":
          (1.02, "<=", 1.03, True),
      "target 3: local step / no-communication step (flat)": (1.02, "<=", 1.01, False),
      "target 3: local step / no-communication step (resnet50-tree(width=64))":
          (1.02, "<=", 1.01, False)}
  assert result["passed"] is False
  if jax.default_backend() == "cpu":
    assert set(inners) == {1}


def test_bench_train_step_ratios_and_targets_from_given_timings(monkeypatch):
  """main's figures and targets from given medians (no step runs): images/s ratio mfopt /
  plain = t(plain) / t(mfopt) >= 0.97; target 5 is mfopt's own bf16 / fp32 step time <= 0.6
  (judged on GPU only); target 3 is periodic averaging's local step (the library's default
  gates, not the device-gate variant or the sync step) / the no-communication step <= 1.01."""
  import types

  import jax.numpy as jnp

  from experiments import _bench

  def runner(kind):
    def build(model, tx, x, y, *args, **kw):
      return types.SimpleNamespace(kind=kind, bf16=model.dtype == jnp.bfloat16, kw=kw)
    return build

  monkeypatch.setattr(bench_train_step, "mfopt_runner", runner("mfopt"))
  monkeypatch.setattr(bench_train_step, "plain_runner", runner("plain"))
  medians = {("mfopt", True): 2.0, ("plain", True): 1.8, ("mfopt", False): 4.0,
             ("plain", False): 3.0}
  periodic = [1.0, 1.005, 1.5, 1.2]  # no communication, local, sync, local with device gate

  def fake(runners, **kw):
    if len(runners) == 4:
      assert runners[3].kw.get("host_gates") is False and "host_gates" not in runners[1].kw
      got = periodic
    else:
      got = [medians[(r.kind, r.bf16)] for r in runners]
    return [_bench.Timing([m]) for m in got]

  monkeypatch.setattr(_bench, "time_interleaved", fake)
  result = bench_train_step.main(["--reps", "1"])
  figs = {f["name"].split(" | ")[1]: f for f in result["figures"] if "name" in f
          and "resnet18" in f["name"]}
  ratio = [f for f in result["figures"] if f.get("dtype") == "bf16" and "resnet18" in f["name"]]
  assert ratio[0]["ratio"] == ratio[0]["value"] == pytest.approx(1.8 / 2.0)
  assert figs["bf16 / fp32 step time (mfopt step)"]["value"] == pytest.approx(2.0 / 4.0)
  assert figs["periodic_averaging local step / no-communication step"]["value"] == \
      pytest.approx(1.005)
  assert figs["periodic_averaging sync step / no-communication step"]["value"] == \
      pytest.approx(1.5)
  assert figs["periodic_averaging local step, device-side gate (host_gates=False) / "
              "no-communication step"]["value"] == pytest.approx(1.2)
  t = {x["name"]: x for x in result["targets"]}
  two = t["target 2: resnet18 width 16 32x32 batch 32 bf16 images/s mfopt/plain"]
  assert (two["value"], two["op"], two["threshold"], two["passed"]) == (
      pytest.approx(0.9), ">=", 0.97, False)
  fp32 = t["target 2: resnet18 width 16 32x32 batch 32 fp32 images/s mfopt/plain"]
  assert fp32["value"] == pytest.approx(0.75) and fp32["passed"] is False
  five = t["target 5: resnet18 bf16/fp32"]
  assert (five["value"], five["op"], five["threshold"]) == (pytest.approx(0.5), "<=", 0.6)
  assert five["applies"] is (jax.default_backend() == "gpu")
  three = [x for x in result["targets"] if x["name"].startswith("target 3")]
  assert [(x["value"], x["op"], x["threshold"], x["passed"]) for x in three] == [
      (pytest.approx(1.005), "<=", 1.01, True)]


def test_bench_virtual_workers_ratios_and_targets_from_given_timings(monkeypatch):
  """main's figures and targets from given medians per program (nothing compiles): 4a is
  t(one replica @ W*B) / t(fast path) >= 0.97; 4b's auto is t(best plain lowering) / t(auto)
  >= 0.97, the bn_impl='mfopt' variants left out of it but counted for the best local
  lowering (the stretch, 16x256 only, judged on GPU); the speed-up figures are > 1 when the
  default is faster."""
  import types

  from experiments import _bench
  from mfopt import fastpath

  def runner(name, fn=None):  # (no XLA cost estimate: compiled_cost gives None)
    return types.SimpleNamespace(name=name, fn=fn, state=None, args=())

  def plain(model, tx, x, y):
    return runner("one replica @ W*B" if len(x) == n_wb[0] else "one replica @ B")

  def fast(model, tx, x, y, update_in_place=True, group_bn=None):
    return runner(fastpath.LABEL + (" (copying update)" if not update_in_place else
                                    " (vmap over BN groups)" if group_bn is False else ""))

  def local(model, tx, x, y, *, num_workers, lowering=None):
    name = {None: "vmap sync", "vmap": "vmap local", "map": "lax.map local",
            "gemm": "gemm local", "unroll": "unroll local", "auto": "auto local"}.get(
                lowering, f"mixed local ({lowering})")
    if model.bn_impl == "mfopt":
      name += " (bn_impl='mfopt')"
    return runner(name, types.SimpleNamespace(choice="unroll", timings={"unroll": 1.4}))

  monkeypatch.setattr(bench_virtual_workers, "plain_runner", plain)
  monkeypatch.setattr(bench_virtual_workers, "fast_runner", fast)
  monkeypatch.setattr(bench_virtual_workers, "mfopt_runner", local)
  medians = {"one replica @ W*B": 1.0, "one replica @ B": 0.1, fastpath.LABEL: 1.05,
             f"{fastpath.LABEL} (copying update)": 1.3,
             f"{fastpath.LABEL} (vmap over BN groups)": 1.1, "vmap sync": 2.0,
             "vmap local": 1.9, "lax.map local": 1.6, "gemm local": 3.0, "unroll local": 1.4,
             "auto local": 1.45, "unroll local (bn_impl='mfopt')": 1.2,
             "lax.map local (bn_impl='mfopt')": 1.3}

  def fake(runners, **kw):
    return [_bench.Timing([medians.get(r.name, 1.5)]) for r in runners]  # mixed: 1.5

  monkeypatch.setattr(_bench, "time_interleaved", fake)
  n_wb = [4 * 8]
  result = bench_virtual_workers.main(["--shapes", "4x8", "--reps", "1", "--bn-variants",
                                       "--fastpath-variants"])
  n_wb[0] = 16 * 256
  result16 = bench_virtual_workers.main(["--shapes", "16x256", "--reps", "1", "--bn-variants",
                                         "--fastpath-variants"])
  for shape, res in (("W=4 B=8", result), ("W=16 B=256", result16)):
    figs = {f["name"].split(" | ", 1)[1]: f["value"] for f in res["figures"] if "name" in f
            and f["name"].startswith(shape)}
    assert figs["fast path in place / copying update"] == pytest.approx(1.3 / 1.05)
    assert figs["fast path GroupBatchNorm / vmap over BN groups"] == pytest.approx(1.1 / 1.05)
    assert figs["unroll local: bn_impl='mfopt' / flax BatchNorm"] == pytest.approx(1.4 / 1.2)
    assert figs["lax.map local: bn_impl='mfopt' / flax BatchNorm"] == pytest.approx(1.6 / 1.3)
    assert figs["best local lowering (unroll bn_impl='mfopt') / one replica"] == \
        pytest.approx(1.0 / 1.2)
    (auto,) = [v for k, v in figs.items() if k.startswith("auto local (chose unroll)")]
    assert auto == pytest.approx(1.4 / 1.45)
    assert figs["noise gauge: auto local / unroll local (the same compiled program timed "
                "twice)"] == pytest.approx(1.4 / 1.45)
    w = 4 if shape == "W=4 B=8" else 16
    assert figs["sequential reference: one replica @ W*B / (W x one replica @ B)"] == \
        pytest.approx(1.0 / (w * 0.1))
    assert figs["fast path"] == pytest.approx(4 * 8 / 1.05 if shape == "W=4 B=8" else
                                              16 * 256 / 1.05)  # img/s
  got = {x["name"]: (x["value"], x["op"], x["threshold"], x["passed"])
         for x in result["targets"] + result16["targets"]}
  assert len(got) == len(result["targets"]) + len(result16["targets"])  # (stretch: 16x256 only)
  assert got == {
      "4b: auto local / best local lowering, W=4 B=8": (pytest.approx(1.4 / 1.45), ">=", 0.97,
                                                        False),
      "4a: fast path / one replica, W=4 B=8": (pytest.approx(1 / 1.05), ">=", 0.97, False),
      "4b: auto local / best local lowering, W=16 B=256": (pytest.approx(1.4 / 1.45), ">=",
                                                           0.97, False),
      "4a: fast path / one replica, W=16 B=256": (pytest.approx(1 / 1.05), ">=", 0.97, False),
      "4b stretch: best local lowering / one replica, 16x256": (
          pytest.approx(1 / 1.2), ">=", 0.75,
          (1 / 1.2 >= 0.75) if jax.default_backend() == "gpu" else None)}


def test_bench_fit_dispatch_medians_of_the_timed_runs_after_the_warm_up(monkeypatch):
  """steps/s = steps / fit's train_time_s, the median over the repetitions; the first run of
  each limit (compiles) is not one of them. A fake fit with scripted train times."""
  import types

  from mfopt import train
  script = {8: [999.0, 2.0, 1.0, 4.0], 1: [999.0, 6.0, 3.0, 12.0], 16: [999.0, 1.0, 1.0, 3.0]}

  def fit(**kw):
    assert kw["num_steps"] == 60
    t = script[train.MAX_STEPS_IN_FLIGHT].pop(0)
    return types.SimpleNamespace(history=[{"train_time_s": t}])

  monkeypatch.setattr(train, "fit", fit)
  result = bench_fit_dispatch.main(["--quick", "--reps", "3"])
  figs = {f["limit"]: f for f in result["figures"] if "limit" in f}
  want = {8: 60 / 2.0, 1: 60 / 6.0, 16: 60 / 1.0}  # medians of 60/t over the 3 timed runs
  assert {k: f["value"] for k, f in figs.items()} == pytest.approx(want)
  assert {k: f["ratio_to_8"] for k, f in figs.items()} == pytest.approx(
      {k: v / want[8] for k, v in want.items()})
  assert all(not s for s in script.values())


def test_bench_input_rates_are_medians_of_the_timed_reads_after_the_warm_up(monkeypatch):
  """examples/s = batch / the median read time over --reps, the warm-up read (rep 0) left out;
  the ratio is threads over one thread. A fake clock: the reads take scripted seconds."""
  import types
  reads = iter([100.0, 100.0, 2.0, 1.0, 4.0, 1.0, 3.0, 2.0])  # (1 thread, 3 threads) per rep
  now = [0.0]
  pending = []

  def perf_counter():
    if pending:  # the end of a read
      now[0] += pending.pop()
    else:
      pending.append(next(reads))
    return now[0]

  monkeypatch.setattr(bench_input, "time", types.SimpleNamespace(perf_counter=perf_counter))
  result = bench_input.main(["--quick", "--reps", "3", "--threads", "3", "--dataset", "cifar10"])
  figs = {f["name"]: f["value"] for f in _figures(result)}
  assert figs["examples/s, 1 thread"] == pytest.approx(16 / 3.0)  # median of 2, 4, 3
  assert figs["examples/s, 3 threads"] == pytest.approx(16 / 1.0)  # median of 1, 1, 2
  assert figs["ratio 3 threads / 1 thread"] == pytest.approx(3.0)


def test_gpu_plan_splits_its_budget_and_fills_in_the_gpu_count(tmp_path):
  """A planned call hands gpu_bench.sh its benches with BENCH_TIMEOUT = budget / benches, and
  call 7's GPUS is the machine's GPU count. `bash` and `nvidia-smi` on PATH are fakes that
  record what the plan runs (gpu_bench.sh itself is not run)."""
  import os
  import pathlib
  import subprocess

  root = pathlib.Path(__file__).resolve().parents[1]
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "bash").write_text('#!/bin/sh\necho "BENCH_TIMEOUT=$BENCH_TIMEOUT"\n'
                             'for a in "$@"; do echo "ARG $a"; done\n')
  (fake / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: H100"; done\n')
  for f in fake.iterdir():
    f.chmod(0o755)
  env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "BENCH_BUDGET": "300"}

  def plan(n):
    out = subprocess.run(["/bin/bash", "scripts/gpu_plan.sh", n, "/tmp/unused_out"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    return ([ln.split("=", 1)[1] for ln in lines if ln.startswith("BENCH_TIMEOUT=")],
            [ln[4:] for ln in lines if ln.startswith("ARG ")])

  assert plan("4") == (["100"], ["scripts/gpu_bench.sh", "/tmp/unused_out",
                                 "bench_update:--only block",
                                 "bench_train_step:--periodic-only --reps 25",
                                 "bench_train_step:--bn-variants"])
  assert plan("7") == (["150"], ["scripts/gpu_bench.sh", "/tmp/unused_out",
                                 "bench_comm:--platform gpu", "bench_train_step:--devices 4"])


def test_bench_update_sync_step_figure_is_sync_over_local(monkeypatch):
  """Target 3's second figure: t(sync step, period 1) / t(local step, period never due), the
  two runners in that order (nothing is built or run: given medians)."""
  import argparse

  import jax.numpy as jnp

  from experiments import _bench
  periods = []  # the "transform" is its period here
  monkeypatch.setattr(bench_update, "_mfopt_attr", lambda name: lambda inner, axes, period: period)
  monkeypatch.setattr(bench_update, "build_step", lambda tx, *a, **kw: (
      periods.append(tx), (None, None, None))[1])
  _fake_timings(monkeypatch, (3.0, 2.0))
  report = _bench.Report("bench_update", argparse.Namespace(quick=False, json=None, argv=[]))
  bench_update.sync_step_cost(report, {"w": jnp.zeros(8)}, warmup=1, reps=1, iters=1)
  (fig,) = report.figures
  assert fig["name"] == "flat | periodic_averaging sync step / local step"
  assert fig["value"] == pytest.approx(3.0 / 2.0)
  assert periods == [1, bench_update.NEVER]


def test_bench_comm_checks_fail_when_the_sync_loop_runs_every_step(monkeypatch):
  """The averaging checks can fail: with every compiled collective seen as every-step work (as
  if the sync loop ran on every step), the periodic rows' "no parameter-sized collective outside
  the sync loop" and "sync branch exchanges the parameters" fail, and nothing else does."""
  real = bench_comm.hlo_collectives
  monkeypatch.setattr(bench_comm, "hlo_collectives", lambda text: [
      {**c, "in_conditional": False} for c in real(text)])
  result = bench_comm.main(["--quick"])
  failed = sorted(t["name"].split(": ", 1)[1] for t in result["targets"] if t["passed"] is False)
  averaging = [f["transform"] for f in _figures(result) if f["kind"] in ("periodic", "adpsgd")]
  assert len(averaging) >= 3
  assert failed == sorted(["no parameter-sized collective outside the sync loop",
                           "sync branch exchanges the parameters"] * len(averaging))
  assert result["passed"] is False
