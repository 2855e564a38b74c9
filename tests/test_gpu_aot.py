"""Deviceless XLA:GPU compilation helpers (experiments/_gpu_aot.py, bench_gpu_hlo.py).

The HLO parsers are checked against hand-written HLO modules whose launches, copies and
convolutions are counted here by hand. The deviceless compilations themselves need the JAX
CUDA plugin (``bash scripts/gpu_aot.sh`` builds an environment with it and runs this file
there); without it those tests are skipped, and the error a user gets is checked instead.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _bench, _gpu_aot, bench_gpu_hlo
from mfopt import parallel

# A hand-written optimised module: ENTRY launches 2 fusions (one of them a transposing copy
# inside its body), a cuDNN convolution (tuple
# result, 4 feature groups), a copy of f32[2,3] (24 B) and a conditional whose true branch
# launches 3 instructions (2 fusions, an all-reduce-start of bf16[8] (+ its done, free)) and
# whose false branch launches 1 copy-start of f32[4] (16 B); a while loop whose body launches
# 1 fusion and runs 5 times (XLA's known_trip_count); and periodic averaging's sync loop (a while named mfopt_gate in its metadata:
# 0 or 1 trips) whose body launches a fusion and a copy of f32[2,3] (24 B). Fusion bodies
# (%fused_*) and reducers are not top-level: not counted.
MODULE = """\
HloModule test

%fused_add (p0: f32[2,3]) -> f32[2,3] {
  %p0 = f32[2,3]{1,0} parameter(0)
  ROOT %add = f32[2,3]{1,0} add(%p0, %p0)
}

%fused_copy (p0: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  ROOT %c = f32[64,64]{0,1} copy(%p0)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sync (t: (f32[4], bf16[8])) -> f32[4] {
  %t = (f32[4]{0}, bf16[8]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %f1 = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_add
  %f2 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_add
  %h = bf16[8]{0} get-tuple-element(%t), index=1
  %ars = bf16[8]{0} all-reduce-start(%h), replica_groups={}, to_apply=%sum
  %ard = bf16[8]{0} all-reduce-done(%ars)
  ROOT %r = f32[4]{0} bitcast(%f2)
}

%local (t: (f32[4], bf16[8])) -> f32[4] {
  %t = (f32[4]{0}, bf16[8]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %cs = (f32[4]{0}, f32[4]{0}, u32[]) copy-start(%g)
  ROOT %cd = f32[4]{0} copy-done(%cs)
}

%body (x: f32[2,3]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  ROOT %f = f32[2,3]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
}

%sync_body (x: f32[2,3]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  %sf = f32[2,3]{1,0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %sc = f32[2,3]{1,0} copy(%sf)
}

%cond (x: f32[2,3]) -> pred[] {
  %x = f32[2,3]{1,0} parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p: f32[2,3], q: bf16[1,8,8,4], k: bf16[3,3,1,4], pr: pred[]) -> f32[2,3] {
  %p = f32[2,3]{1,0} parameter(0)
  %q = bf16[1,8,8,4]{3,2,1,0} parameter(1)
  %k = bf16[3,3,1,4]{3,2,1,0} parameter(2)
  %pr = pred[] parameter(3)
  %fu = f32[2,3]{1,0} fusion(%p), kind=kLoop, calls=%fused_add
  %fc = f32[64,64]{0,1} fusion(%q), kind=kLoop, calls=%fused_copy
  %cv = (bf16[1,8,8,4]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k), window={size=3x3}, dim_labels=b01f_01io->b01f, feature_group_count=4, custom_call_target="__cudnn$convForward"
  %cp = f32[2,3]{1,0} copy(%fu)
  %tu = (f32[4]{0}, bf16[8]{0}) tuple(%fu, %q)
  %co = f32[4]{0} conditional(%pr, %tu, %tu), true_computation=%sync, false_computation=%local
  %wh = f32[2,3]{1,0} while(%cp), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %sy = f32[2,3]{1,0} while(%wh), condition=%cond, body=%sync_body, metadata={op_name="jit(step)/vmap(mfopt_gate)/while"}
  ROOT %out = f32[2,3]{1,0} add(%sy, %sy)
}
"""


def test_program_structure_counts_launches_per_path():
  s = bench_gpu_hlo.program_structure(MODULE)
  # every step: 2 fusions, custom-call, copy, add (ROOT) in ENTRY + the while body's fusion
  assert s["launches_every_step"] == 6
  assert s["ops_every_step"] == {"fusion": 3, "custom-call": 1, "copy": 1, "add": 1}
  # both branches: 2 fusions + all-reduce-start (sync), copy-start (local); the sync body's
  # fusion and copy
  assert s["launches_in_conditional"] == 4 + 2
  assert s["launches_cheapest"] == 6 + 1 and s["launches_dearest"] == 6 + 3 + 2
  # run: the loop body's fusion 5 times instead of once
  assert s["launches_run"] == 6 + 1 + 4
  assert s["convs"] == [{"kind": "Forward", "dtype": "bf16", "batch": 1, "groups": 4}]
  assert s["gemms"] == 0
  # the copy in ENTRY (f32[2,3]) and the copy-start in the local branch (f32[4]); the copy
  # inside the fusion body %fused_copy is part of that kernel
  # ... and the sync body's copy (24 B), which a local step does not run
  assert (s["copies"], s["copy_bytes"]) == (3, 24 + 16 + 24)
  assert s["copy_bytes_every_step"] == 24  # scalars' copies are left out of this one
  # ENTRY's kernels (not loop bodies or branches): written fu 24 + fc 64*64*4 + cv's tuple
  # (512 + u8[0]) + cp 24 + out 24; read fu<-p 24, fc<-q 512, cv<-q,k 512+72, cp<-fu 24,
  # out<-sy,sy 48 (a while's result is defined in ENTRY; the loop itself is not a kernel)
  assert s["entry_bytes_written"] == 24 + 16384 + 512 + 24 + 24
  assert s["entry_bytes_read"] == 24 + 512 + 584 + 24 + 48
  # with loop trips: the counted loop's fusion (f32[2,3] in and out) 5 times; the gated sync
  # loop runs only its condition (a constant: no kernel) on a local step
  assert s["bytes_written_run"] == s["entry_bytes_written"] + 5 * 24
  assert s["bytes_read_run"] == s["entry_bytes_read"] + 5 * 24


def test_shape_bytes_sums_tuple_elements():
  assert _bench.hlo_shape_bytes("(bf16[8]{0}, f32[2,3]{1,0}, pred[])") == 16 + 24 + 1
  assert _bench.hlo_shape_bytes("f32[]") == 4


def test_conv_summary_names_kinds_batches_and_groups():
  convs = [{"kind": "Forward", "dtype": "bf16", "batch": 64, "groups": 1},
           {"kind": "BackwardFilter", "dtype": "bf16", "batch": 3, "groups": 16}]
  assert bench_gpu_hlo.conv_summary(convs) == (
      "2 convs (1 BackwardFilter, 1 Forward), batch [3, 64], groups [1, 16], ['bf16']")
  assert bench_gpu_hlo.conv_summary([]) == "0 convs"


def test_program_structure_of_a_compiled_cpu_conditional():
  """A real optimised module (XLA:CPU): the dear branch launches more than the cheap one."""
  def f(pred, x):
    return jax.lax.cond(pred, lambda v: jnp.sin(v) @ jnp.cos(v).T + 1.0, lambda v: v[:, :4] * 2,
                        x)
  text = jax.jit(f).lower(True, jnp.ones((4, 4))).compile().as_text()
  s = bench_gpu_hlo.program_structure(text)
  assert s["launches_in_conditional"] > 0
  assert s["launches_dearest"] > s["launches_cheapest"] >= s["launches_every_step"]


def test_abstract_on_keeps_shapes_dtypes_and_partition_specs():
  mesh = parallel.make_mesh()
  tree = {"w": parallel.shard_workers(np.zeros((8, 3), np.float32), mesh),
          "n": jnp.zeros((), jnp.int32)}
  other = parallel.make_mesh(jax.devices()[::-1])
  out = _gpu_aot.abstract_on(tree, other)
  assert out["w"].shape == (8, 3) and out["w"].dtype == jnp.float32
  assert out["w"].sharding.mesh is other and out["w"].sharding.spec == tree["w"].sharding.spec
  assert out["n"].shape == () and out["n"].sharding.spec == jax.sharding.PartitionSpec()


def test_topology_devices_validates_its_arguments():
  with pytest.raises(ValueError, match="target must be one of \\['h100'\\], got 'a100'"):
    _gpu_aot.topology_devices(8, "a100")
  with pytest.raises(ValueError, match="num_devices must be a positive integer, got 0"):
    _gpu_aot.topology_devices(0)
  with pytest.raises(ValueError, match="num_devices must be a positive integer, got True"):
    _gpu_aot.topology_devices(True)


needs_plugin = pytest.mark.skipif(_gpu_aot.unavailable_reason() is not None,
                                  reason="JAX CUDA plugin not installed (bash scripts/gpu_aot.sh)")


@pytest.mark.skipif(_gpu_aot.unavailable_reason() is None, reason="the plugin is installed")
def test_without_the_plugin_the_error_says_how_to_install_it():
  with pytest.raises(RuntimeError, match="jax-cuda12-plugin"):
    _gpu_aot.topology_devices(8)


@needs_plugin
def test_bench_comm_gpu_aot_compiles_bf16_all_reduces_for_8_h100s():
  from experiments import bench_comm
  result = bench_comm.main(["--quick", "--platform", "gpu-aot"])
  assert result["passed"], [t for t in result["targets"] if t["passed"] is False]
  rows = {f["transform"]: f for f in result["figures"] if "transform" in f}
  assert rows["sync_gradients bf16"]["hlo_every_step_dtypes"] == ["bf16"]
  assert rows["sync_gradients f32"]["hlo_every_step_dtypes"] == ["f32"]
  assert rows["sync_gradients bf16"]["hlo_every_step_bytes"] * 2 == \
      rows["sync_gradients f32"]["hlo_every_step_bytes"]
  assert rows["periodic_averaging p=4 bf16"]["hlo_sync_branch_dtypes"] == ["bf16"]


@needs_plugin
def test_bench_gpu_hlo_quick_structure_holds():
  result = bench_gpu_hlo.main(["--quick"])
  assert result["passed"], [t for t in result["targets"] if t["passed"] is False]


@pytest.mark.skipif(_gpu_aot.unavailable_reason() is None, reason="the plugin is installed")
def test_bench_update_gpu_aot_without_the_plugin_says_why():
  from experiments import bench_update
  with pytest.raises(SystemExit, match="bench_update --platform gpu-aot: .*jax-cuda12-plugin"):
    bench_update.main(["--quick", "--platform", "gpu-aot"])


@needs_plugin
def test_bench_update_gpu_aot_every_transform_moves_optax_bytes():
  """Every mfopt update compiled for an H100 moves no more every-step bytes than its optax
  counterpart. The hybrid's AdaBound phase read w and g twice (XLA:GPU had turned its norms
  ``lax.cond`` into a select: 36 vs 28 B/param) before the norms moved into a gated loop."""
  from experiments import bench_update
  result = bench_update.main(["--quick", "--platform", "gpu-aot"])
  assert result["passed"], [t for t in result["targets"] if t["passed"] is False]
  hyb = [f for f in result["figures"] if f.get("transform") == "hybrid_adabound_lars[adabound phase]"]
  assert hyb and all(f["mfopt_structure"]["entry_bpp"] <= 28.2 for f in hyb), hyb
  assert all(f["mfopt_structure"]["branches_bpp"][0] >= 8.0 for f in hyb)  # norms: gated


@needs_plugin
def test_host_gated_steps_compiled_for_an_h100_have_no_gate_loop():
  """XLA:GPU blocks the host on a gated loop's predicate every step (H100, session 6: a
  local step 1.26x a no-communication step). The host-gated programs compiled for an H100:
  the shut one has no loop and no all-reduce, and only 3 scalar fusions more than the step
  without averaging (the counters; W=1 on one compile-only H100, as bench_gpu_hlo); the open
  one all-reduces unconditionally (W=2 on two)."""
  import optax

  import mfopt
  from mfopt import models, train
  host_mesh = parallel.make_mesh(jax.devices()[:1])
  model = models.get_model("cnn", features=(4, 8), num_classes=10, dtype=jnp.bfloat16)
  x1 = np.zeros((1, 8, 8, 3), np.float32)
  sgd = optax.sgd(0.1, momentum=0.9)

  def compiled(tx, host_gates, gate=False, workers=1):
    gpu_mesh = parallel.make_mesh(_gpu_aot.topology_devices(workers, "h100"))
    batch = {"x": jax.ShapeDtypeStruct((workers, 4, 8, 8, 3), jnp.float32),
             "y": jax.ShapeDtypeStruct((workers, 4), jnp.int32)}
    state = train.init_train_state(model, tx, x1, num_workers=workers, mesh=host_mesh)
    step = train.make_train_step(model, tx, mesh=gpu_mesh, num_workers=workers,
                                 host_gates=host_gates)
    step = step.steps[gate] if host_gates else step
    text = step.lower(*_gpu_aot.abstract_on((state, batch), gpu_mesh)).compile().as_text()
    return bench_gpu_hlo.program_structure(text), text

  avg = lambda: mfopt.periodic_averaging(sgd, parallel.WORKER_AXES, 10**9)  # noqa: E731
  none, _ = compiled(sgd, False)
  _, device_text = compiled(avg(), False)
  shut, shut_text = compiled(avg(), True, False)
  _, open_text = compiled(avg(), True, True, workers=2)
  assert any(_bench.hlo_is_gated_loop(line) for line in device_text.splitlines())
  for text in (shut_text, open_text):
    assert not any(_bench.hlo_is_gated_loop(line) for line in text.splitlines())
  assert "all-reduce" not in shut_text
  assert "all-reduce" in open_text
  assert shut["launches_cheapest"] == none["launches_cheapest"] + 3, (
      shut["ops_every_step"], none["ops_every_step"])
  assert shut["copy_bytes"] == none["copy_bytes"]


# XLA:GPU's thunk sequence dump, as --xla_dump_to writes it (trimmed; this layout from
# jax 0.10.2's CUDA plugin): 2 command buffers holding 3 and 1 commands; outside them a
# kernel, 2 convolutions and a copy.
THUNKS = """\
001: kCustomKernel   [source       | next=005 (4) ] loop_transpose_fusion_1 grid: [1, 1, 1] threads: [108, 1, 1]  shared_memory: 0 bytes
005: kConvolution    [prev=004 (1) | next=006 (1) ] kConvolution
000: kCommandBuffer  [prev=007 (1) | next=017 (1) ] 
    008: kCustomKernel [source       | next=009 (1)] input_reduce_fusion_6 grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
    010: kCopy         [prev=009 (1) | next=011 (1)] kCopy
    011: kCustomKernel [prev=010 (1) | next=012 (1)] input_concatenate_fusion_5 grid: [1, 1, 1] threads: [4, 1, 1]  shared_memory: 0 bytes
017: kConvolution    [prev=000 (1) | next=018 (1) ] kConvolution
000: kCommandBuffer  [prev=019 (1) | next=052 (1) ] 
    020: kCublasLtMatmul [source       | next=021 (1)] 
018: kCopy           [prev=017 (1) | next=000 (2) ] kCopy
"""


def test_thunk_census_counts_graphs_and_what_runs_outside_them():
  c = _gpu_aot.thunk_census(THUNKS)
  assert c["command_buffers"] == 2
  assert c["commands_in_buffers"] == 4
  assert c["thunks_outside"] == 4
  assert c["outside_by_kind"] == {"kCustomKernel": 1, "kConvolution": 2, "kCopy": 1}
  assert c["all_by_kind"] == {"kCustomKernel": 3, "kConvolution": 2, "kCopy": 2,
                              "kCublasLtMatmul": 1}
  assert _gpu_aot.thunk_census("")["command_buffers"] == 0


@needs_plugin
def test_bench_gpu_hlo_compiler_options_reach_the_compile():
  """--compiler-option compiles the unroll step under cumulative options: XLA's experimental
  convolution fusion leaves no cuDNN convolution and fewer thunks outside CUDA graphs."""
  result = bench_gpu_hlo.main(["--quick", "--compiler-option",
                               "xla_gpu_experimental_enable_conv_fusion=true"])
  rows = [f for f in result["figures"] if "command_buffers" in f]
  assert len(rows) == 2, [f["name"] for f in result["figures"]]
  default, fused = rows
  assert default["all_by_kind"].get("kConvolution", 0) > 0
  assert fused["all_by_kind"].get("kConvolution", 0) == 0
  assert fused["thunks_outside"] < default["thunks_outside"]


@pytest.mark.parametrize("shape,op,want", [
    ("f32[50890]{0}", "all-reduce", 203_560),  # JAX 0.10's XLA:GPU: the result
    ("((f32[50890]{0}), f32[50890]{0})", "all-reduce", 203_560),  # 0.11: (operands), result
    ("((f32[10]{0}, bf16[20]{0}), (f32[10]{0}, bf16[20]{0}))", "all-reduce", 80),  # combined
    ("(f32[10]{0}, bf16[20]{0})", "all-reduce", 80),  # 0.10 combined: a tuple result, both
    ("(f32[8]{0}, f32[64]{0})", "all-gather", 256),  # (operand, result): the result
])
def test_async_collective_bytes_count_the_result_once(shape, op, want):
  """Under JAX 0.11, XLA:GPU prints an all-reduce-start as ((operands), result); counting both
  doubled every GPU all-reduce in bench_comm (a reviewer's compile with jax 0.11.2)."""
  from experiments import bench_comm
  line = f"%s = {shape} {op}-start(%p), replica_groups={{}}, to_apply=%sum"
  text = f"HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n  {line}\n}}\n"
  assert sum(c["bytes"] for c in bench_comm.hlo_collectives(text)) == want


def test_every_step_copy_bytes_leave_out_scalars_but_count_them_in_all_copies():
  """copy_bytes_every_step counts arrays only (a loop counter's 4-byte copy is not the
  traffic it is meant to show); copies/copy_bytes count every copy. Hand-counted."""
  text = """\
HloModule copies

ENTRY %main (a: f32[4], s: s32[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %s = s32[] parameter(1)
  %c1 = s32[] copy(%s)
  %c2 = f32[4]{0} copy(%a)
  %c3 = f32[1]{0} copy(%a)
  ROOT %t = f32[4]{0} add(%c2, %c2)
}
"""
  s = bench_gpu_hlo.program_structure(text)
  assert (s["copies"], s["copy_bytes"]) == (3, 4 + 16 + 4)
  assert s["copy_bytes_every_step"] == 16
