"""``experiments.profile_step``: the trace parsing, the HLO join and the per-step arithmetic.

References: hand-built traces in the GPU's trace-event layout (a device process with Stream
threads and the derived "XLA Ops"/"XLA Modules" lines, whose events must not be counted
twice), a real XLA:CPU trace of a program whose kernels and bytes are known, and closed forms.
"""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _bench, profile_step

GPU_LINES = {
    "fusion.7": ('  %fusion.7 = bf16[64,32]{1,0} fusion(bf16[64,32]{1,0} %p0), kind=kLoop, '
                 'calls=%fused_add'),
    "reduce_fusion": ('  %reduce_fusion = f32[32]{0} fusion(bf16[64,32]{1,0} %fusion.7), '
                      'kind=kInput, calls=%fused_reduce'),
    "custom-call.3": ('  %custom-call.3 = (bf16[64,32]{1,0}, u8[0]{0}) custom-call(bf16[64,32]{1,0} '
                      '%fusion.7, bf16[32,32]{1,0} %p1), custom_call_target="__cudnn$convForward"'),
    "all-reduce-start": ('  %all-reduce-start = f32[32]{0} all-reduce-start(f32[32]{0} '
                         '%reduce_fusion), replica_groups={}, to_apply=%add'),
    "gemm": ('  %gemm = bf16[64,32]{1,0} custom-call(bf16[64,32]{1,0} %fusion.7, bf16[32,32]{1,0} '
             '%p1), custom_call_target="__cublas$gemm"'),
    "copy.1": '  %copy.1 = bf16[32,64]{0,1} copy(bf16[64,32]{1,0} %fusion.7)',
}


def test_categories_of_gpu_instructions():
  got = {name: profile_step.categorize(_bench.HLO_INSTR.match(line).group("op"), line)
         for name, line in GPU_LINES.items()}
  assert got == {"fusion.7": "elementwise fusion", "reduce_fusion": "reduction fusion",
                 "custom-call.3": "convolution", "all-reduce-start": "collective",
                 "gemm": "matmul", "copy.1": "copy/transpose"}


def test_union_of_intervals_closed_form():
  assert profile_step.union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
  assert profile_step.union_seconds([]) == 0.0


def _gpu_trace(steps: int) -> list[dict]:
  """A trace in the layout XLA:GPU's profiler writes: per step, three kernels on a Stream
  thread (one of them a memcpy without an HLO op), their copies on the derived "XLA Ops"
  line, one "XLA Modules" event; plus a host process whose events must be ignored."""
  ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 9, "tid": 20, "name": "thread_name",
         "args": {"name": "Stream #20(Compute)"}},
        {"ph": "M", "pid": 9, "tid": 1, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 9, "tid": 2, "name": "thread_name", "args": {"name": "XLA Modules"}}]
  for s in range(steps):
    t0 = 1000.0 * s
    kernels = [("loop_add_fusion", "fusion.7", t0, 10.0),
               ("sm90_xmma_fprop", "custom-call.3", t0 + 12.0, 30.0),
               ("MemcpyD2D", None, t0 + 50.0, 5.0)]
    for name, hop, ts, dur in kernels:
      args = {"hlo_module": "jit_step", **({"hlo_op": hop} if hop else {})}
      ev.append({"ph": "X", "pid": 9, "tid": 20, "ts": ts, "dur": dur, "name": name,
                 "args": args})
      if hop:
        ev.append({"ph": "X", "pid": 9, "tid": 1, "ts": ts, "dur": dur, "name": hop,
                   "args": {"hlo_module": "jit_step"}})
    ev.append({"ph": "X", "pid": 9, "tid": 2, "ts": t0, "dur": 55.0, "name": "jit_step(1)",
               "args": {}})
    ev.append({"ph": "X", "pid": 1, "tid": 5, "ts": t0, "dur": 400.0, "name": "PjitFunction",
               "args": {"hlo_op": "fusion.7"}})
  return ev


def test_gpu_trace_kernels_and_per_step_figures(tmp_path):
  steps = 3
  run = tmp_path / "plugins" / "profile" / "run1"
  run.mkdir(parents=True)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": _gpu_trace(steps)}, f)
  where, kernels, runs = profile_step.device_events(profile_step.load_trace(str(tmp_path)),
                                                    "jit_step")
  assert (where, len(kernels), runs) == ("gpu", 3 * steps, steps)
  _, index = profile_step.hlo_index("HloModule jit_step\n\nENTRY %main () -> bf16[64,32] {\n"
                                    + "\n".join(GPU_LINES.values()) + "\n}\n")
  got = profile_step.summarize(kernels, index, steps)
  assert got["kernel_s_per_step"] == pytest.approx(45e-6)
  assert got["busy_s_per_step"] == pytest.approx(45e-6)
  # span: from the first kernel of step 0 to the end of the last memcpy, over 3 steps
  assert got["span_s_per_step"] == pytest.approx((2000 + 55) * 1e-6 / steps)
  conv = got["categories"]["convolution"]
  # cuDNN conv: writes bf16[64,32] + u8[0], reads bf16[64,32] + the unknown %p1 (0 bytes)
  assert conv["written_per_step"] == 64 * 32 * 2 and conv["read_per_step"] == 64 * 32 * 2
  assert conv["GBps"] == pytest.approx(2 * 64 * 32 * 2 / 30e-6 / 1e9)
  assert got["categories"]["unmatched: MemcpyD2D"]["launches_per_step"] == 1
  assert [r["hlo_op"] for r in got["top"]] == ["custom-call.3", "fusion.7", "MemcpyD2D"]
  # another module's kernels are not this program's
  assert profile_step.device_events(_gpu_trace(1), "jit_other")[1] == []


def test_trace_line_census_counts_every_line():
  """The census kept in the JSON (for a trace layout the parser misreads): every line's
  events, summed duration and argument keys, busiest first, counted by hand from _gpu_trace."""
  steps = 3
  lines = profile_step.trace_lines(_gpu_trace(steps))
  got = {(ln["process"], ln["thread"]): ln for ln in lines}
  assert [(ln["process"], ln["thread"], ln["events"]) for ln in lines] == [
      ("/device:GPU:0", "Stream #20(Compute)", 3 * steps),
      ("/device:GPU:0", "XLA Ops", 2 * steps),
      ("/device:GPU:0", "XLA Modules", steps),
      ("/host:CPU", "5", steps)]  # a thread without a name is named by its tid
  stream = got[("/device:GPU:0", "Stream #20(Compute)")]
  assert stream["s"] == pytest.approx(steps * (10 + 30 + 5) * 1e-6)
  assert stream["arg_keys"] == ["hlo_module", "hlo_op"]
  assert stream["example"] == "loop_add_fusion"
  assert got[("/device:GPU:0", "XLA Modules")]["arg_keys"] == []
  assert len(profile_step.trace_lines(_gpu_trace(steps), top=2)) == 2


def test_cpu_trace_joins_every_kernel_with_its_instruction(tmp_path):
  """A real trace: the dot and the fused elementwise ops of a known program, every event
  matched to an instruction of the compiled module, one execution seen per step."""
  n = 256

  def step(state, w):
    return jnp.tanh(state @ w) * 0.5 + state

  fn = jax.jit(step, donate_argnums=0)
  x = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
  w = jax.device_put(jnp.eye(n, dtype=jnp.float32) * 0.01, jax.devices()[0])
  runner = _bench.Runner(fn, x, (w,))
  steps = 4
  prof = profile_step.profile_runner(runner, steps, str(tmp_path))
  assert prof["where"] == "cpu" and prof["executions_seen"] == steps
  assert prof["kernels"] >= 2 * steps
  assert not [c for c in prof["categories"] if c.startswith("unmatched")], prof["categories"]
  assert "matmul" in prof["categories"]
  mm = prof["categories"]["matmul"]
  assert mm["launches_per_step"] == 1
  # the dot reads two f32[n, n] and writes one (the traffic model, by hand)
  assert mm["read_per_step"] == 2 * 4 * n * n and mm["written_per_step"] == 4 * n * n
  assert 0 < prof["busy_s_per_step"] <= prof["span_s_per_step"] + 1e-9
  assert prof["kernel_s_per_step"] <= prof["traced_wall_s_per_step"] * 1.5


def test_kernels_inside_a_cuda_graph_are_reported_unattributed():
  """A kernel inside an XLA:GPU command buffer names the graph, not its instruction."""
  event = {"ph": "X", "ts": 0.0, "dur": 7.0, "name": "sm90_kernel",
           "args": {"hlo_op": "command_buffer.2", "hlo_module": "jit_step"}}
  got = profile_step.summarize([event], {"fusion.7": {"category": "elementwise fusion",
                                                      "written": 1, "read": 1}}, 1)
  assert list(got["categories"]) == ["unmatched: command_buffer.2"]


def test_quick_run_fast_path_has_one_replicas_convolutions(monkeypatch):
  """The fast path runs one replica's convolutions (same launches; no grouped ones): the
  profile's join shows it, and the comparison figures name the reference. The run turns
  XLA:GPU's command buffers off for later backends (this process's CPU one is running)."""
  # (restored after the test: delenv of an unset variable records nothing to undo, and the
  # flag main adds leaked into later tests, e.g. a Report's command line in test_bench_tables)
  monkeypatch.setenv("XLA_FLAGS", "")
  result = profile_step.main(["--quick", "--programs", "one,fast"])
  import os
  assert os.environ["XLA_FLAGS"] == profile_step.NO_COMMAND_BUFFERS
  profs = {f["program"]: f["profile"] for f in result["figures"] if "profile" in f}
  assert set(profs) == {"one", "fast"}
  for p in profs.values():
    assert p["kernels"] > 0 and p["executions_seen"] == p["steps"]
    assert p["lines"] and p["lines"][0]["events"] >= p["kernels"] / len(p["lines"])
    assert not [c for c in p["categories"] if c.startswith("unmatched")], p["categories"]
  convs = [profs[k]["categories"]["convolution"]["launches_per_step"] for k in ("one", "fast")]
  assert convs[0] == convs[1] > 0
  names = [f["name"] for f in result["figures"] if "name" in f]
  assert "W=2 B=2 | fast - one | busy time" in names
  # the differences are the program's minus the reference's, from the profiles themselves
  figs = {f["name"]: f["value"] for f in result["figures"] if "name" in f}
  assert figs["W=2 B=2 | fast - one | busy time"] == pytest.approx(
      (profs["fast"]["busy_s_per_step"] - profs["one"]["busy_s_per_step"]) * 1e3)
  per_cat = {k.rsplit(" | ", 1)[1]: v for k, v in figs.items()
             if k.startswith("W=2 B=2 | fast - one | ") and not k.endswith("busy time")}
  assert per_cat
  s = lambda p, c: p["categories"].get(c, {"s_per_step": 0.0})["s_per_step"]  # noqa: E731
  for cat, value in per_cat.items():
    assert value == pytest.approx((s(profs["fast"], cat) - s(profs["one"], cat)) * 1e3), cat
  # the Markdown table (bench_tables prints it for a profile run): one column per program
  table = profile_step.markdown(result)
  assert "| | one | fast |" in table
  (conv_row,) = [r for r in table if r.startswith("| convolution |")]
  assert conv_row.count(f"({convs[0]:.0f})") == 2, conv_row
  (idle,) = [r for r in table if r.startswith("| idle (span - busy) |")]
  assert idle == "| idle (span - busy) | " + " | ".join(
      f"{(profs[k]['span_s_per_step'] - profs[k]['busy_s_per_step']) * 1e3:.3f}"
      for k in ("one", "fast")) + " |"


def test_bad_programs_are_named():
  with pytest.raises(SystemExit, match="--programs must be a comma list.*'one,bogus'"):
    profile_step.main(["--quick", "--programs", "one,bogus"])
  with pytest.raises(SystemExit, match="--steps must be positive, got -1"):
    profile_step.main(["--quick", "--steps", "-1"])
  np.testing.assert_equal(profile_step.parse_programs("one, map"), ["one", "map"])


SLICED = """\
HloModule sliced

%fused_split (p0: f32[100], p1: f32[10]) -> (f32[10], f32[30]) {
  %p0 = f32[100]{0} parameter(0)
  %p1 = f32[10]{0} parameter(1)
  %s1 = f32[10]{0} slice(%p0), slice={[0:10]}
  %s2 = f32[30]{0} slice(%p0), slice={[10:40]}
  %a = f32[10]{0} add(%s1, %p1)
  ROOT %t = (f32[10]{0}, f32[30]{0}) tuple(%a, %s2)
}

%fused_mixed (p0: f32[100]) -> f32[10] {
  %p0 = f32[100]{0} parameter(0)
  %s = f32[10]{0} slice(%p0), slice={[0:10]}
  %r = f32[10]{0} slice(%p0), slice={[10:20]}
  %n = f32[] reduce(%p0, %s), dimensions={0}
  ROOT %m = f32[10]{0} add(%s, %r)
}

ENTRY %main (v: f32[100], w: f32[10]) -> f32[10] {
  %v = f32[100]{0} parameter(0)
  %w = f32[10]{0} parameter(1)
  %f = (f32[10]{0}, f32[30]{0}) fusion(%v, %w), kind=kLoop, calls=%fused_split
  %g = f32[10]{0} fusion(%v), kind=kLoop, calls=%fused_mixed
  ROOT %s = f32[5]{0} slice(%w), slice={[0:5]}
}
"""


def test_traffic_model_counts_what_slices_read():
  """A fusion that only slices an operand reads the slices (10 + 30 floats of 100), one that
  also reads it whole reads all of it; a bare slice reads its result's bytes. Hand-counted."""
  comps, entry = _bench.hlo_computations(SLICED)
  rows = {r["name"]: r for r in _bench.hlo_instruction_traffic(comps[entry],
                                                                _bench.HLO_NOT_KERNELS, comps)}
  assert rows["f"]["read"] == 4 * (10 + 30) + 4 * 10 and rows["f"]["written"] == 4 * 40
  assert rows["g"]["read"] == 4 * 100
  assert rows["s"]["read"] == rows["s"]["written"] == 4 * 5
  # without the computations the model cannot look inside: whole operands
  plain = {r["name"]: r for r in _bench.hlo_instruction_traffic(comps[entry],
                                                                 _bench.HLO_NOT_KERNELS)}
  assert plain["f"]["read"] == 4 * 100 + 4 * 10


def test_profile_runner_warms_up_outside_the_trace_and_reports_wall_time_per_step(tmp_path,
                                                                                 monkeypatch):
  """One untraced call first (so no compile or first-call cost lands in the trace), then the
  traced steps; the traced wall time is per step. A fake clock: 0.25 s per step."""
  import contextlib
  import types
  events, clock = [], [0.0]

  real_trace = jax.profiler.trace

  @contextlib.contextmanager
  def trace(*a, **kw):
    events.append("trace")
    with real_trace(*a, **kw):
      yield

  class Recorded(_bench.Runner):
    def call(self, iters):
      events.append(iters)
      clock[0] += 0.25 * iters
      return super().call(iters)

  monkeypatch.setattr(jax.profiler, "trace", trace)
  monkeypatch.setattr(profile_step, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
  fn = jax.jit(lambda s: jnp.tanh(s) + 1.0, donate_argnums=0)
  steps = 3
  prof = profile_step.profile_runner(Recorded(fn, jnp.ones(64)), steps, str(tmp_path))
  assert events == [1, "trace", steps]
  assert prof["traced_wall_s_per_step"] == pytest.approx(0.25)
  assert prof["executions_seen"] == steps
