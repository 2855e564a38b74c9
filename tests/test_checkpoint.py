"""mfopt.checkpoint: exact round trip, keep-N, checksum, fallback past corrupt checkpoints, atomicity."""

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mfopt import checkpoint, parallel

HERE = pathlib.Path(__file__).resolve().parent


class Inner(NamedTuple):
  count: jax.Array
  mu: dict


class State(NamedTuple):
  params: dict
  opt: tuple


def make_state(step: int, mesh=None):
  """A worker-stacked state whose every value is a function of ``step`` (so a restore is checkable)."""
  mesh = mesh or parallel.make_mesh()
  rng = np.random.default_rng(step)
  tree = State(
      params={"w": rng.normal(size=(8, 3, 5)).astype(np.float32),
              "b": rng.normal(size=(8, 5)).astype(jnp.bfloat16)},
      opt=(Inner(count=np.full((8,), step, np.int32),
                 mu={"w": rng.normal(size=(8, 3, 5)).astype(np.float32)}),
           np.full((8, 2), np.nan, np.float32)))  # NaN diagnostics are legal state
  return parallel.shard_workers(tree, mesh)


def assert_tree_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def reference_checksum(tree):
  """NumPy re-derivation of tree_checksum: sums of the uint32 words times 2i+1, mod 2**32."""
  out = []
  for leaf in jax.tree.leaves(jax.device_get(tree)):
    a = np.ascontiguousarray(np.asarray(leaf)).ravel()
    if a.dtype.itemsize == 2:
      words = a.view(np.uint16).astype(np.uint64)
    elif a.dtype == np.bool_:
      words = a.astype(np.uint64)
    else:
      words = a.view(np.uint32).astype(np.uint64)
    i = np.arange(words.size, dtype=np.uint64)
    weights = (2 * i + 1) % 2**32
    first = int((words * weights % 2**32).sum() % 2**32)
    second = int((words ^ (weights * 0x9E3779B1 % 2**32)).sum() % 2**32)
    out.append([first, second])
  return out


def test_checksum_matches_numpy_and_sees_one_changed_element():
  state = make_state(3)
  assert checkpoint.tree_checksum(state) == reference_checksum(state)
  host = jax.device_get(state)
  w = np.array(host.params["w"])
  w[5, 2, 4] = np.nextafter(w[5, 2, 4], np.float32(np.inf))  # one ulp
  changed = host._replace(params={**host.params, "w": w})
  assert checkpoint.tree_checksum(changed)[1][0] != checkpoint.tree_checksum(host)[1][0]  # leaf 1 is "w"
  swapped = np.array(host.params["w"])
  swapped[[0, 1]] = swapped[[1, 0]]  # same multiset of values, different places
  assert (checkpoint.tree_checksum(host._replace(params={**host.params, "w": swapped}))[1][0]
          != checkpoint.tree_checksum(host)[1][0])


def test_checksum_of_numpy_leaves_is_the_reference_and_the_device_sum():
  """An all-NumPy tree (run_resumable's plain-data state) is summed on the host with the
  device's odd weights: the same numbers as the NumPy reference and as the same arrays summed
  on the device, and a single changed element changes the first number (with weight 2 at
  index 1, a flipped sign bit added 2**32 and went unseen there)."""
  rng = np.random.default_rng(0)
  tree = {"a": rng.standard_normal(37).astype(np.float32),
          "b": rng.integers(-9, 9, (3, 5)).astype(np.int32),
          "c": np.array([True, False, True]), "d": rng.standard_normal(4).astype(np.float16)}
  host = checkpoint.tree_checksum(tree)
  assert host == reference_checksum(tree)
  assert host == checkpoint.tree_checksum(jax.tree.map(jnp.asarray, tree))
  flipped = tree["a"].copy()
  flipped[1] = -flipped[1]  # the sign bit alone
  assert checkpoint.tree_checksum({**tree, "a": flipped})[0][0] != host[0][0]


def test_checksum_of_a_mixed_tree_sees_the_low_bits_of_a_float64_numpy_leaf():
  """A NumPy float64 leaf beside JAX arrays was summed on the device as float32 (no x64):
  a change in its low bits went unseen. NumPy leaves are summed on the host, bit for bit."""
  x = np.linspace(0.0, 1.0, 7)
  tree = {"device": jnp.arange(5.0), "host": x}
  y = x.copy()
  y[3] = np.nextafter(y[3], 2.0)  # one float64 ulp: the same value in float32
  assert np.float32(y[3]) == np.float32(x[3])
  a, b = checkpoint.tree_checksum(tree), checkpoint.tree_checksum({**tree, "host": y})
  assert a[0] == b[0] and a[1] != b[1]  # (leaves in key order: device, host)
  assert a[1] == checkpoint.tree_checksum({"host": x})[0]  # the same sum as an all-host tree


def test_round_trip_is_exact_and_keeps_the_newest_n(tmp_path):
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=2, fingerprint={"seed": 1})
  for step in (5, 10, 15):
    ckpt.save(step, make_state(step), {"history": [{"step": step, "loss": 0.1 + step}]})
  assert ckpt.steps() == [10, 15]
  assert ckpt.describe_last_good() == f"step 15 at {tmp_path.absolute() / '15'}"
  ckpt.close()
  fresh = checkpoint.RunCheckpointer(tmp_path, keep=2, fingerprint={"seed": 1})
  restored = fresh.restore_latest(make_state(0))
  assert restored.step == 15 and restored.meta["history"] == [{"step": 15, "loss": 15.1}]
  assert_tree_equal(restored.state, make_state(15))
  assert type(restored.state.opt[0]) is Inner  # the target's NamedTuple types come back
  assert restored.state.params["w"].sharding == make_state(0).params["w"].sharding


@pytest.mark.parametrize("name", ["KSync[working]", "a[b]c"])
def test_directory_orbax_cannot_read_back_is_refused_before_saving(tmp_path, name):
  """orbax globs the path when it merges a save: under runs/KSync[working] the save returned
  normally, wrote no manifest, and the next start set every checkpoint aside as corrupt."""
  with pytest.raises(ValueError,
                     match=r"checkpoint directory .* contains '\[.*\]'.*cannot be read back"):
    checkpoint.RunCheckpointer(tmp_path / name / "ckpt")
  assert not (tmp_path / name).exists()


def test_runner_refuses_a_workdir_orbax_cannot_read_back(tmp_path):
  from mfopt import runner
  workdir = tmp_path / "wd[x]"
  with pytest.raises(runner.ConfigError, match=r"workdir '.*wd\[x\]': checkpoint directory"):
    runner.run_experiment("bb_lr", quick=True, workdir=workdir)
  assert not workdir.exists()  # refused before anything was written


def test_nothing_saved_restores_none(tmp_path):
  assert checkpoint.RunCheckpointer(tmp_path / "absent").restore_latest(make_state(0)) is None


def _data_files(step_dir):
  return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p))


def _truncate(step_dir):
  for p in _data_files(step_dir):
    with open(p, "r+b") as f:
      f.truncate(max(0, p.stat().st_size // 2))


def _flip(step_dir):
  # One flipped bit in the middle of each (compressed) chunk: a decoder error or different numbers.
  for p in _data_files(step_dir):
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))


def _stale_state(step_dir):
  # Perfectly readable arrays that are not the ones written for this step: only the checksum
  # can tell (orbax itself restores them without complaint).
  shutil.rmtree(step_dir / "state")
  shutil.copytree(step_dir.parent / "10" / "state", step_dir / "state")


def _drop_meta(step_dir):
  (step_dir / "meta" / "metadata").unlink()


def _garble_meta(step_dir):
  (step_dir / "meta" / "metadata").write_text('{"step": 20, "history": [')


@pytest.mark.parametrize("damage", [_truncate, _flip, _stale_state, _drop_meta, _garble_meta])
def test_corrupt_newest_falls_back_to_previous_and_says_so(tmp_path, capsys, damage):
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  for step in (10, 20):
    ckpt.save(step, make_state(step), {"history": [step]})
  ckpt.close()
  damage(tmp_path / "20")
  again = checkpoint.RunCheckpointer(tmp_path, keep=3)
  restored = again.restore_latest(make_state(0))
  assert restored.step == 10 and restored.meta["history"] == [10]
  assert_tree_equal(restored.state, make_state(10))
  err = capsys.readouterr().err
  assert "checkpoint step 20" in err and "corrupt or truncated" in err
  assert "falling back to the previous checkpoint" in err and "step 10" in err
  if damage is _stale_state:
    assert "checksum mismatch" in err
  # The bad one is moved aside (kept for inspection); training can save step 20 again.
  assert (tmp_path / "corrupt-20-0").is_dir() and again.steps() == [10]
  again.save(20, make_state(20), {"history": [20]})
  assert again.restore_latest(make_state(0)).step == 20


def test_all_corrupt_is_an_error_not_a_silent_restart(tmp_path):
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  ckpt.save(10, make_state(10), {})
  ckpt.close()
  _truncate(tmp_path / "10")
  with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint.*step 10"):
    checkpoint.RunCheckpointer(tmp_path).restore_latest(make_state(0))


@pytest.mark.parametrize("failure", [
    MemoryError("RESOURCE_EXHAUSTED: out of memory while restoring"),
    OSError(errno.EMFILE, "Too many open files"),
    PermissionError(errno.EACCES, "Permission denied"),
    MemoryError(),  # (no text naming the cause: the type alone must tell)
    OSError(errno.ENOSPC, "No space left on device")])
def test_a_failure_that_is_not_corruption_is_raised_and_the_checkpoint_kept(tmp_path, failure):
  """Out of memory, file handles or permission say nothing about the checkpoint: it stays in
  place (it used to be moved aside as corrupt, and the next run started over silently)."""
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  for step in (10, 20):
    ckpt.save(step, make_state(step), {"history": [step]})
  ckpt.close()
  flaky = checkpoint.RunCheckpointer(tmp_path, keep=3)
  restore = flaky.manager.restore

  def failing(step, args=None):
    if "state" in args.keys():  # the array read fails; the meta reads fine
      raise failure
    return restore(step, args=args)

  flaky.manager.restore = failing
  with pytest.raises(type(failure)) as info:
    flaky.restore_latest(make_state(0))
  assert "checkpoint was left in place" in "".join(getattr(info.value, "__notes__", []))
  flaky.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "20"]
  assert checkpoint.RunCheckpointer(tmp_path, keep=3).restore_latest(make_state(0)).step == 20


def test_a_newer_format_is_refused_not_moved_aside(tmp_path):
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  ckpt.save(10, make_state(10), {})
  ckpt.close()
  meta_file = tmp_path / "10" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["format"] = checkpoint.FORMAT_VERSION + 1
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(checkpoint.CheckpointError, match="has format 2, newer than this mfopt's 1"):
    checkpoint.RunCheckpointer(tmp_path).restore_latest(make_state(0))
  assert (tmp_path / "10").is_dir() and not list(tmp_path.glob("corrupt-*"))


def test_only_set_aside_checkpoints_left_restarts_loudly(tmp_path, capsys):
  """After every checkpoint was found corrupt (an error, once), the next run starts over, and
  says that it does."""
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  ckpt.save(10, make_state(10), {})
  ckpt.close()
  _truncate(tmp_path / "10")
  with pytest.raises(checkpoint.CheckpointError):
    checkpoint.RunCheckpointer(tmp_path).restore_latest(make_state(0))
  capsys.readouterr()
  assert checkpoint.RunCheckpointer(tmp_path).restore_latest(make_state(0)) is None
  err = capsys.readouterr().err
  assert "1 set aside earlier as corrupt (corrupt-10-0): starting from the beginning" in err


def test_other_run_is_refused_naming_fields_unless_allowed(tmp_path, capsys):
  ckpt = checkpoint.RunCheckpointer(tmp_path, fingerprint={"seed": 0, "opt": {"lr": 0.1}, "w": 8})
  ckpt.save(10, make_state(10), {})
  ckpt.close()
  other = {"seed": 1, "opt": {"lr": 0.2}, "w": 8}
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"differing fields \(checkpoint -> now\): opt.lr: 0.1 -> 0.2; seed: 0 -> 1\."):
    checkpoint.RunCheckpointer(tmp_path, fingerprint=other).restore_latest(make_state(0))
  assert (tmp_path / "10").is_dir()  # refused, not treated as corrupt
  restored = checkpoint.RunCheckpointer(tmp_path, fingerprint=other,
                                        allow_mismatch=True).restore_latest(make_state(0))
  assert restored.step == 10 and "resuming anyway" in capsys.readouterr().err


def test_config_diff_and_bad_keep():
  assert checkpoint.config_diff({"a": 1, "b": {"c": (1, 2)}}, {"a": 1, "b": {"c": [1, 2]}}) == []
  assert checkpoint.config_diff({"a": 1}, {"b": 2}) == ["a: 1 -> (absent)", "b: (absent) -> 2"]
  nan = float("nan")  # (NaN != NaN refused every resume of a run_info holding one)
  assert checkpoint.config_diff({"t": nan, "u": 1.0}, {"t": nan, "u": 1.0}) == []
  assert checkpoint.config_diff({"t": nan}, {"t": 0.5}) == ["t: nan -> 0.5"]
  assert checkpoint.config_diff({"t": [1.0, nan]}, {"t": (1.0, nan)}) == []  # inside a list too
  for keep in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=f"keep must be a positive integer, got {keep!r}"):
      checkpoint.RunCheckpointer("/tmp/x", keep=keep)


def test_config_diff_sees_a_shorter_list_and_a_key_added_inside_one():
  """A sweep's list of seeds or of per-run settings is part of a fingerprint: a list that lost
  its last item, or one of whose dicts gained a key, is another run (comparing pairwise up to
  the shorter length, or only the saved dict's keys, called them equal)."""
  assert checkpoint.config_diff({"seeds": [0, 1, 2]}, {"seeds": (0, 1)}) == [
      "seeds: [0, 1, 2] -> [0, 1]"]
  assert checkpoint.config_diff({"runs": [{"lr": 0.1}]}, {"runs": [{"lr": 0.1, "m": 0.9}]}) == [
      "runs: [{'lr': 0.1}] -> [{'lr': 0.1, 'm': 0.9}]"]


def test_a_fingerprint_from_before_chunk_events_left_it_still_resumes(tmp_path):
  """Checkpoints written while run_resumable fingerprinted its chunk size hold a chunk_events
  field that today's fingerprint lacks: they resume, while a field that still counts (the
  engine's limits) is refused as before."""
  limits = {"run_kwargs": {"max_samples": 320}}
  ckpt = checkpoint.RunCheckpointer(tmp_path, fingerprint={**limits, "chunk_events": 8})
  ckpt.save(4, make_state(4), {})
  ckpt.close()
  restored = checkpoint.RunCheckpointer(tmp_path, fingerprint=limits).restore_latest(make_state(0))
  assert restored.step == 4
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"\(checkpoint -> now\): run_kwargs.max_samples: 320 -> 640\.") as info:
    checkpoint.RunCheckpointer(tmp_path, fingerprint={"run_kwargs": {"max_samples": 640}}
                               ).restore_latest(make_state(0))
  assert "chunk_events" not in str(info.value)


def test_saving_a_step_that_exists_is_refused_and_keeps_what_was_saved(tmp_path):
  """A second save of a step already on disk is an error: orbax alone skips it and returns,
  so the caller believed the new state saved while the disk still held the old one."""
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  ckpt.save(10, make_state(10), {"history": [10]})
  with pytest.raises(checkpoint.CheckpointError, match="checkpoint step 10 already exists"):
    ckpt.save(10, make_state(11), {"history": [11]})
  ckpt.close()
  restored = checkpoint.RunCheckpointer(tmp_path, keep=3).restore_latest(make_state(0))
  assert restored.meta["history"] == [10]
  assert_tree_equal(restored.state, make_state(10))


def test_a_state_of_another_shape_is_refused_and_the_checkpoint_kept(tmp_path):
  """Restoring into a state whose arrays have other shapes (another model width) is a
  different run, not a damaged checkpoint: refused by name, and the checkpoint stays in place
  (taken for corruption, it was moved aside and the run started over)."""
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  ckpt.save(10, make_state(10), {})
  ckpt.close()
  host = jax.device_get(make_state(0))
  narrow = host._replace(params={**host.params, "w": np.zeros((8, 3, 4), np.float32)})
  # the message names the leaf and both shapes, from orbax's metadata of the saved arrays
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"state of a different structure .*: params\.w: checkpoint "
                           r"\(8, 3, 5\) float32 -> now \(8, 3, 4\) float32$"):
    checkpoint.RunCheckpointer(tmp_path).restore_latest(
        parallel.shard_workers(narrow, parallel.make_mesh()))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["10"]
  # another worker count: every leaf differs in its leading axis alone, which is named
  four = jax.tree.map(lambda x: np.asarray(x)[:4], host)
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"opt\.0\.count: checkpoint \(8,\) int32 -> now \(4,\) int32; .*"
                           r"\(and 2 more\)\. Only the leading axis differs \(8 -> 4\): .*"
                           r"worker axis"):
    checkpoint.RunCheckpointer(tmp_path).restore_latest(four)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["10"]
  # a width 4 -> 5 changes a bias's only axis too: no worker-axis hint; and an unchanged NumPy
  # float64 leaf (saved as float64, kept so without x64) is not listed as float64 -> float32
  ckpt = checkpoint.RunCheckpointer(tmp_path / "flax", keep=1)
  ckpt.save(1, {"kernel": jnp.zeros((3, 4)), "bias": jnp.zeros(4), "hist": np.zeros(2)}, {})
  ckpt.close()
  with pytest.raises(checkpoint.ConfigMismatchError) as info:
    checkpoint.RunCheckpointer(tmp_path / "flax").restore_latest(
        {"kernel": jnp.zeros((3, 5)), "bias": jnp.zeros(5), "hist": np.zeros(2)})
  assert str(info.value).endswith(": bias: checkpoint (4,) float32 -> now (5,) float32; "
                                  "kernel: checkpoint (3, 4) float32 -> now (3, 5) float32")
  # the first 3 differing leaves by name, then a count of the rest; the worker-axis hint
  # only where every difference is the same leading-axis change
  ckpt = checkpoint.RunCheckpointer(tmp_path / "four", keep=1)
  ckpt.save(1, {k: jnp.zeros((1, 2) if k == "a" else (1,)) for k in "abcd"}, {})
  ckpt.close()

  def refused(shapes):
    with pytest.raises(checkpoint.ConfigMismatchError) as info:
      checkpoint.RunCheckpointer(tmp_path / "four").restore_latest(
          {k: jnp.zeros(shape) for k, shape in zip("abcd", shapes)})
    return str(info.value).split("tree); it cannot be restored into this run's state")[1]

  f32 = "float32 -> now"
  assert refused([(2, 2), (2,), (2,), (2,)]) == (
      f": a: checkpoint (1, 2) {f32} (2, 2) float32; b: checkpoint (1,) {f32} (2,) float32; "
      f"c: checkpoint (1,) {f32} (2,) float32 (and 1 more). Only the leading axis differs "
      f"(1 -> 2): in train.fit's state that is the worker axis, and a run cannot resume with "
      f"another number of workers")
  assert refused([(2, 2), (3,), (2,), (1,)]) == (  # two different leading changes: no hint
      f": a: checkpoint (1, 2) {f32} (2, 2) float32; b: checkpoint (1,) {f32} (3,) float32; "
      f"c: checkpoint (1,) {f32} (2,) float32")


def test_a_step_set_aside_twice_is_reported_under_its_newest_name(tmp_path, capsys):
  """The second corrupt copy of a step goes to corrupt-<step>-1 beside the first, and the
  message names that one (the directory a user would open to inspect this failure)."""
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=3)
  for step in (10, 20):
    ckpt.save(step, make_state(step), {})
  ckpt.close()
  for _ in range(2):
    _drop_meta(tmp_path / "20")
    again = checkpoint.RunCheckpointer(tmp_path, keep=3)
    assert again.restore_latest(make_state(0)).step == 10
    again.save(20, make_state(20), {})
    again.close()
  err = capsys.readouterr().err
  assert "moved it to corrupt-20-0;" in err and "moved it to corrupt-20-1;" in err
  assert (tmp_path / "corrupt-20-0").is_dir() and (tmp_path / "corrupt-20-1").is_dir()


def test_interval_elapsed_at_its_bound_and_without_an_interval():
  """Exactly the interval counts as elapsed, so min_interval_s=0 never skips a save (on a
  coarse clock two readings are often equal); None means a save after every chunk."""
  assert checkpoint.interval_elapsed(5.0, 0.0, clock=lambda: 5.0)
  assert checkpoint.interval_elapsed(0.0, 10.0, clock=lambda: 10.0)
  assert not checkpoint.interval_elapsed(0.0, 10.0, clock=lambda: 9.5)
  assert checkpoint.interval_elapsed(1e9, None, clock=lambda: 0.0)


class _CountingEngine:
  """run_resumable's engine protocol in plain Python: each event adds 4 samples and 1 to w."""

  def __init__(self):
    self.samples, self.version, self.now, self.w = 0, 0, 0.0, np.zeros(3)

  def run(self, max_events, max_samples=None, max_time=None, **unused):
    for _ in range(max_events):
      if (max_samples is not None and self.samples >= max_samples
          or max_time is not None and self.now >= max_time):
        return
      self.samples, self.version, self.now, self.w = (self.samples + 4, self.version + 1,
                                                      self.now + 0.5, self.w + 1.0)

  def state_dict(self):
    return {"samples": self.samples, "version": self.version, "now": self.now, "w": self.w}

  def load_state_dict(self, d):
    self.samples, self.version, self.now, self.w = d["samples"], d["version"], d["now"], d["w"]


def test_run_resumable_saves_each_chunk_once_and_a_finished_run_not_again(tmp_path):
  """24 samples at 4 per event are 6 events, 2 chunks of 3: two saves, the second marked
  final as soon as the limit is met (not after an empty third chunk); a rerun finds the final
  checkpoint and returns its state without running or saving again."""
  saves = []
  engine = checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3,
                                    on_checkpoint=saves.append, max_samples=24)
  assert saves == [1, 2] and engine.samples == 24
  again = []
  engine = checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3,
                                    on_checkpoint=again.append, max_samples=24)
  assert again == [] and engine.samples == 24 and engine.version == 6
  np.testing.assert_array_equal(engine.w, np.full(3, 6.0))
  assert checkpoint.RunCheckpointer(tmp_path).steps() == [1, 2]


def test_run_resumable_refuses_a_rerun_with_another_time_limit(tmp_path):
  """Every engine limit is part of the fingerprint: a finished run to max_time=2 rerun with
  max_time=3 is another run (refused by name), not the old result returned as the new one."""
  engine = checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, max_time=2.0)
  assert engine.now == 2.0 and engine.version == 4  # 0.5 per event
  with pytest.raises(checkpoint.ConfigMismatchError, match=r"run_kwargs.max_time: 2.0 -> 3.0"):
    checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, max_time=3.0)


def saver_main(directory):
  """Child: saves steps 1, 2, 3, ... as fast as it can until killed (see the test below)."""
  jax.config.update("jax_num_cpu_devices", 8)
  ckpt = checkpoint.RunCheckpointer(directory, keep=2)
  step = 1
  while True:
    ckpt.save(step, make_state(step), {"history": [step]})
    print(f"SAVED {step}", flush=True)
    step += 1


@pytest.mark.slow  # child processes
@pytest.mark.parametrize("delay", [0.05, 0.12])
def test_sigkill_during_saves_never_corrupts_the_last_good_checkpoint(tmp_path, delay):
  code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_checkpoint; "
          f"test_checkpoint.saver_main({str(tmp_path)!r})")
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  saved = 0
  for line in proc.stdout:  # wait for a few saves, then kill at an arbitrary moment
    saved = int(line.split()[1])
    if saved >= 3:
      time.sleep(delay)
      os.kill(proc.pid, signal.SIGKILL)
      break
  proc.wait(timeout=30)
  assert proc.returncode == -signal.SIGKILL
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=2)
  restored = ckpt.restore_latest(make_state(0))
  assert restored.step >= saved
  assert_tree_equal(restored.state, make_state(restored.step))
  assert restored.meta["history"] == [restored.step]


def test_star_and_question_mark_round_trip(tmp_path):
  """Orbax's glob matches a literal '*', '?' or unpaired bracket in the path too: such
  directories work (only a [...] pair is refused)."""
  for name in ("run*", "q?x", "x]", "y["):
    ckpt = checkpoint.RunCheckpointer(tmp_path / name, keep=2)
    ckpt.save(3, make_state(3), {"history": []})
    ckpt.close()
    restored = checkpoint.RunCheckpointer(tmp_path / name, keep=2).restore_latest(make_state(0))
    assert restored.step == 3
    assert_tree_equal(restored.state, make_state(3))


def test_a_checkpoint_of_skip_nonfinite_from_before_its_own_state_type_restores(tmp_path):
  """skip_nonfinite's state was optax's ApplyIfFiniteState until it got its own subclass (same
  fields); the structure hash names every namedtuple, so a checkpoint written before was
  refused as "a state of a different structure". It restores, into the new type."""
  import optax
  from mfopt import precision
  tx = precision.skip_nonfinite(optax.sgd(0.1, momentum=0.9))
  new = tx.init({"w": jnp.arange(3.0)})
  old = optax.ApplyIfFiniteState(*new)._replace(total_notfinite=jnp.asarray(7, jnp.int32))
  assert checkpoint.structure_hash(old) == checkpoint.structure_hash(new)
  assert checkpoint.structure_hash(old) != checkpoint.structure_hash((old,))  # still a hash
  ckpt = checkpoint.RunCheckpointer(tmp_path, keep=1)
  ckpt.save(3, old, {"history": []})
  ckpt.close()
  restored = checkpoint.RunCheckpointer(tmp_path, keep=1).restore_latest(new)
  assert type(restored.state) is precision.SkipNonfiniteState
  assert int(restored.state.total_notfinite) == 7


def test_averaging_checkpoints_from_before_trace_variance_restore_and_nothing_else_does(
    tmp_path, capsys):
  """AveragingDiagnostics gained trace_variance (() unless track_variance), and every
  periodic_averaging / block_momentum checkpoint written before was refused as "a different
  structure". Its registered migration reads them: the old layout's structure hashes are the
  ones 4cdba43 recorded for these states (printed by that version's structure_hash). A
  state that only shares leaf names with a checkpoint (adamw after adam: no arrays added) is
  still refused; matching by name alone had returned the adam run's result for adamw."""
  import optax
  import mfopt
  from mfopt import averaging
  params = {"w": jnp.ones((3,))}
  made = {"plain": mfopt.periodic_averaging(optax.sgd(0.1), None, 4),
          "trace": mfopt.periodic_averaging(optax.sgd(0.1), None, 4, trace_length=8),
          "bm": mfopt.block_momentum(optax.sgd(0.1), None, period=4, momentum=0.5)}
  recorded = {"plain": "c1d0de9c8e6e379f", "trace": "b3eb26723ed6f66b", "bm": "917b4e898af31a06"}
  for name, tx in made.items():
    new = {"params": params, "opt": tx.init(params)}
    old = averaging._layout_before_trace_variance(new)
    assert checkpoint.structure_hash(old) == recorded[name] != checkpoint.structure_hash(new)
    old = jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, old)
    ckpt = checkpoint.RunCheckpointer(tmp_path / name, keep=1)
    ckpt.save(3, old, {"history": [name]})
    ckpt.close()
    got = checkpoint.RunCheckpointer(tmp_path / name).restore_latest(new)
    assert got.step == 3 and got.meta["history"] == [name]
    assert jax.tree.structure(got.state) == jax.tree.structure(new)
    assert_tree_equal(got.state, averaging._layout_with_trace_variance(old))
  # a state holding the per-step trace has arrays no earlier checkpoint has: no migration
  tracked = mfopt.periodic_averaging(optax.sgd(0.1), None, 4, trace_length=8,
                                     track_variance=True)
  assert averaging._layout_before_trace_variance(tracked.init(params)) is None
  # the same leaf names under another optimizer are refused, as before
  ckpt = checkpoint.RunCheckpointer(tmp_path / "adam", keep=1)
  ckpt.save(1, optax.adam(0.1).init(params), {})
  ckpt.close()
  with pytest.raises(checkpoint.ConfigMismatchError,
                     match=r"state of a different structure .*: the same arrays under another "
                           r"state tree \(a different optimizer or transform chain\?\)$"):
    checkpoint.RunCheckpointer(tmp_path / "adam").restore_latest(
        optax.adamw(0.1, weight_decay=0.5).init(params))


def test_model_fingerprints_hold_the_changed_fields_and_see_into_partials():
  """fit fingerprints a model by its fields that differ from their defaults: a field a later
  version adds with a default leaves earlier checkpoints resumable (every field made them
  'a different run'); a partial's keywords are seen (a changed activation compared equal)."""
  import functools

  import flax.linen as nn
  from mfopt import models
  import jax.numpy as jnp
  mlp = models.get_model("mlp", hidden=(8,), num_classes=3)
  assert checkpoint.changed_settings(mlp) == {"hidden": [8], "num_classes": 3}
  bf16 = models.get_model("mlp", hidden=(8,), num_classes=3, dtype=jnp.bfloat16)
  assert checkpoint.changed_settings(bf16)["dtype"] == "bfloat16"
  exact, approx = (functools.partial(nn.gelu, approximate=a) for a in (False, True))
  assert checkpoint.plain_settings(exact) != checkpoint.plain_settings(approx)
  assert checkpoint.plain_settings(approx) == {"partial": "gelu", "args": [],
                                               "keywords": {"approximate": True}}


def test_structure_hash_of_states_without_renamed_classes_is_unchanged():
  """Checkpoints store the structure hash, so the rename mapping must send the new class name
  to the old one, never the reverse: a state of optax.apply_if_finite (the old name) keeps
  the hash it had, sha256(treedef | shape:dtype per leaf)[:16], and old checkpoints match."""
  import hashlib
  import optax
  old = optax.apply_if_finite(optax.sgd(0.1), 3).init({"w": jnp.zeros(3)})
  leaves, treedef = jax.tree.flatten(old)
  assert "namedtuple[ApplyIfFiniteState]" in str(treedef)
  text = str(treedef) + "|" + ";".join(f"{tuple(np.shape(x))}:{jnp.result_type(x)}"
                                       for x in leaves)
  assert checkpoint.structure_hash(old) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_run_resumable_continues_a_finished_run_whose_limit_was_raised_when_allowed(tmp_path):
  """allow_mismatch with a higher limit: the finished run to 24 samples goes on to 36 (it
  printed 'resuming anyway' and returned the 24-sample state), and equals a run to 36."""
  checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, max_samples=24)
  engine = checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3,
                                    max_samples=36, allow_mismatch=True)
  assert engine.samples == 36 and engine.version == 9
  np.testing.assert_array_equal(engine.w, np.full(3, 9.0))
  # a lower limit already passed: the finished state, not run further nor saved again
  steps, saves = checkpoint.RunCheckpointer(tmp_path).steps(), []
  engine = checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3,
                                    max_samples=12, allow_mismatch=True,
                                    on_checkpoint=saves.append)
  assert engine.samples == 36 and saves == []
  assert checkpoint.RunCheckpointer(tmp_path).steps() == steps


def test_run_resumable_fingerprints_the_simulators_settings(tmp_path):
  """The simulator's own fingerprint (compute model, network, strategy, ...) is checked with
  no fingerprint passed: a checkpoint directory of a run with base_s=0.01 resumed under
  base_s=1.0 (a hybrid of the two), or returned its finished result as the new one's."""
  from mfopt import costmodel, data, models, sim
  ds = data.load("synthetic", num_train=256, num_test=32, input_shape=(8,), num_classes=3)
  model = models.get_model("mlp", hidden=(4,), num_classes=3)

  def make(base_s=0.01, strategy=sim.ASP):
    return sim.Simulator(strategy(sim.BaseSGD(0.1)), model=model, dataset=ds, num_workers=2,
                         per_worker_batch=4, compute=sim.ComputeModel(base_s=base_s),
                         network=costmodel.Link("slow", bandwidth=2e4, latency=1e-3))

  done = checkpoint.run_resumable(make(), tmp_path, chunk_events=20, max_samples=64)
  assert done.samples == 64
  with pytest.raises(checkpoint.ConfigMismatchError, match=r"compute.base_s: 0.01 -> 1.0"):
    checkpoint.run_resumable(make(base_s=1.0), tmp_path, chunk_events=20, max_samples=64)
  with pytest.raises(checkpoint.ConfigMismatchError, match=r"strategy: 'ASP' -> 'BSP'"):
    checkpoint.run_resumable(make(strategy=sim.BSP), tmp_path, chunk_events=20, max_samples=64)
  with pytest.raises(checkpoint.ConfigMismatchError, match=r"network.bandwidth: 20000.0 -> "):
    other = sim.Simulator(sim.ASP(sim.BaseSGD(0.1)), model=model, dataset=ds, num_workers=2,
                          per_worker_batch=4, compute=sim.ComputeModel(base_s=0.01),
                          network=costmodel.Link("slow", bandwidth=4e4, latency=1e-3))
    checkpoint.run_resumable(other, tmp_path, chunk_events=20, max_samples=64)
  again = checkpoint.run_resumable(make(), tmp_path, chunk_events=20, max_samples=64)
  assert again.result().summary == done.result().summary  # the same settings: the result


def test_run_resumable_needs_a_limit(tmp_path):
  """Chunks of max_events satisfied the engine's own 'at least one limit' check, so a run
  without a limit (or a finished one continued with its limit removed) spun for ever."""
  for limits in ({}, {"max_samples": None, "max_time": None}):
    with pytest.raises(ValueError, match=r"needs at least one of max_samples, max_server_steps"):
      checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, **limits)
  checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, max_samples=12)
  with pytest.raises(ValueError, match=r"needs at least one"):
    checkpoint.run_resumable(_CountingEngine(), tmp_path, chunk_events=3, max_samples=None,
                             allow_mismatch=True)
