"""Tests for mfopt.models: shapes (1-D and 2-D inputs), dtypes, init, BatchNorm statistics.

Models are tiny (width 8 / 4, 8x8 to 32x32 inputs) and every compiled function is shared
through module-level caches, so the file runs in well under a minute on two CPU cores. Keys
use the ``rbg`` PRNG implementation: its initialisers compile several times faster on CPU than
threefry's and draw from the same distributions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mfopt import models

KEY = jax.random.key(0, impl="rbg")
W = 4  # workers in the BatchNorm tests

init_jit = jax.jit(models.init_model, static_argnums=0)
apply_jit = jax.jit(models.apply_model, static_argnums=(0, 4))

# name -> (registry name, constructor kwargs, input shape, input dtype)
CASES = {
    "mlp_2d": ("mlp", dict(hidden=(16, 16), num_classes=5), (2, 8, 8, 3), jnp.float32),
    "mlp_1d": ("mlp", dict(hidden=(16, 16), num_classes=5), (2, 16, 3), jnp.float32),
    "cnn_2d": ("cnn", dict(features=(8, 16), num_classes=5), (2, 8, 8, 3), jnp.float32),
    "cnn_1d": ("cnn", dict(features=(8, 16), num_classes=5), (2, 16, 3), jnp.float32),
    "resnet18_2d": ("resnet18", dict(num_classes=10, width=8), (2, 16, 16, 3), jnp.float32),
    "resnet18_1d": ("resnet18", dict(num_classes=10, width=8), (2, 16, 3), jnp.float32),
    "resnet50_2d": ("resnet50", dict(num_classes=10, width=4), (2, 32, 32, 3), jnp.float32),
    "resnet50_1d": ("resnet50", dict(num_classes=10, width=4), (2, 32, 3), jnp.float32),
    "lstm_lm": ("lstm_lm", dict(vocab_size=11, embed_dim=8, hidden=16, num_layers=2), (2, 7),
                jnp.int32),
}
BN_CASES = [c for c in CASES if not c.startswith(("mlp", "lstm"))]
RESNET_CASES = [c for c in CASES if c.startswith("resnet")]


def _example_x(case, seed=1):
  _, _, shape, dtype = CASES[case]
  if dtype == jnp.int32:
    return jax.random.randint(jax.random.key(seed), shape, 0, CASES[case][1]["vocab_size"])
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _model(case, **overrides):
  name, kwargs, _, _ = CASES[case]
  return models.get_model(name, **{**kwargs, **overrides})


@functools.cache
def _initialized(case):
  """(model, params, model_state, x) for a float32 model, built once per test session."""
  model = _model(case)
  x = _example_x(case)
  params, state = init_jit(model, KEY, x)
  return model, params, state, x


def _flat(tree):
  """{'a/b/c': leaf} for a nested dict."""
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _eqns(jaxpr):
  """All equations of a jaxpr, recursing into sub-jaxprs (scan, jit, custom_jvp, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)
        elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
          yield from _eqns(sub.jaxpr)


# ----------------------------------------------------------------------------- shapes


EXPECTED_LOGITS = {
    "mlp_2d": (2, 5), "mlp_1d": (2, 5), "cnn_2d": (2, 5), "cnn_1d": (2, 5),
    "resnet18_2d": (2, 10), "resnet18_1d": (2, 10), "resnet50_2d": (2, 10),
    "resnet50_1d": (2, 10), "lstm_lm": (2, 7, 11),
}


@pytest.mark.parametrize("case", list(CASES))
def test_init_apply_shapes(case):
  model, params, state, x = _initialized(case)
  logits, new_state = apply_jit(model, params, state, x, True)
  assert logits.shape == EXPECTED_LOGITS[case]
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  assert set(state) == ({"batch_stats"} if case in BN_CASES else set())
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert jax.tree.map(jnp.shape, new_state) == jax.tree.map(jnp.shape, state)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith(("_1d", "_2d"))])
def test_conv_rank_follows_input(case):
  _, params, _, x = _initialized(case)
  kernels = {k: v for k, v in _flat(params).items() if k.endswith("kernel") and "head" not in k
             and "dense" not in k}
  if case.startswith("mlp"):
    assert not kernels
    return
  spatial = x.ndim - 2
  assert kernels and all(v.ndim == spatial + 2 for v in kernels.values()), kernels.keys()


def test_resnet_architecture_details():
  p18 = _flat(_initialized("resnet18_2d")[1])
  p50 = _flat(_initialized("resnet50_2d")[1])
  # CIFAR stem 3x3 stride 1 (no pool) vs ImageNet stem 7x7 (stride 2 + max-pool).
  assert p18["stem_conv/kernel"].shape == (3, 3, 3, 8)
  assert p50["stem_conv/kernel"].shape == (7, 7, 3, 4)
  # 2 BasicBlocks x 4 stages, Bottlenecks [3, 4, 6, 3]; final width 8*width (x4 for bottleneck).
  blocks18 = {k.split("/")[0] for k in p18 if k.startswith("stage")}
  blocks50 = {k.split("/")[0] for k in p50 if k.startswith("stage")}
  assert len(blocks18) == 8 and len(blocks50) == 16
  assert p18["head/kernel"].shape == (64, 10)
  assert p50["head/kernel"].shape == (128, 10)
  # Projection shortcut exactly where the shape changes.
  proj18 = sorted(k.split("/")[0] for k in p18 if "proj_conv" in k)
  assert proj18 == ["stage2_block0", "stage3_block0", "stage4_block0"]
  proj50 = sorted(k.split("/")[0] for k in p50 if "proj_conv" in k)
  assert proj50 == ["stage1_block0", "stage2_block0", "stage3_block0", "stage4_block0"]
  # 1-D ResNet-50 on length 32: 32 -stem-> 16 -pool-> 8 -> 8, 4, 2, 1.
  m, p, s, x = _initialized("resnet50_1d")
  _, inter = jax.jit(lambda p, s, x: m.apply(
      {"params": p, **s}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name == "stage4_block2"))(p, s, x)
  assert inter["intermediates"]["stage4_block2"]["__call__"][0].shape == (2, 1, 128)
  # v1.5: a downsampling bottleneck strides in its 3x3 conv2, not in conv1 (v1): conv1 keeps
  # the input's length (8 into stage 2), conv2 halves it (the shapes of v1 are the same).
  _, inter = jax.jit(lambda p, s, x: m.apply(
      {"params": p, **s}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name in ("conv1", "conv2")))(p, s, x)
  block = inter["intermediates"]["stage2_block0"]
  assert block["conv1"]["__call__"][0].shape[1] == 8
  assert block["conv2"]["__call__"][0].shape[1] == 4


# ----------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_compute_fp32_params_and_logits(case):
  _, params_f32, state_f32, x = _initialized(case)
  model = _model(case, dtype=jnp.bfloat16)
  params, state = jax.eval_shape(functools.partial(models.init_model, model), KEY, x)
  # Parameters and BN statistics are float32 and identical in structure to the fp32 model's.
  assert {l.dtype for l in jax.tree.leaves((params, state))} == {jnp.dtype(jnp.float32)}
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, params_f32)
  closed = jax.make_jaxpr(models.apply_model, static_argnums=(0, 4))(
      model, params_f32, state_f32, x, True)
  logits_aval, *state_avals = closed.out_avals
  assert logits_aval.dtype == jnp.float32
  assert all(a.dtype == jnp.float32 for a in state_avals)
  eqns = list(_eqns(closed.jaxpr))
  # Every matmul / convolution runs in bf16 ...
  mm = [e for e in eqns if e.primitive.name in ("dot_general", "conv_general_dilated")]
  assert mm
  assert all(v.aval.dtype == jnp.bfloat16 for e in mm for v in e.invars), case
  # ... and every reduction (BN mean / second moment, global average pool) in float32.
  sums = [e for e in eqns if e.primitive.name == "reduce_sum"]
  assert all(v.aval.dtype == jnp.float32 for e in sums for v in e.invars), case


def test_bn_stats_float32_under_bf16_compute():
  """flax promotes BN inputs to float32 before reducing: stats match an fp64 reference."""
  model = _model("cnn_2d", dtype=jnp.bfloat16, num_classes=5)
  _, params, state, _ = _initialized("cnn_2d")
  x = 3.0 + 2.0 * jax.random.normal(jax.random.key(7), (16, 8, 8, 3))
  run = jax.jit(lambda p, s, x: model.apply(
      {"params": p, **s}, x, train=True, mutable=["batch_stats", "intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name == "conv0"))
  # XLA may otherwise skip the bf16 rounding of the conv output inside the fusion that feeds BN,
  # and BN would then see more precise values than the captured ones.
  run = run.lower(params, state, x).compile({"xla_allow_excess_precision": False})
  _, new = run(params, state, x)
  act = np.asarray(new["intermediates"]["conv0"]["__call__"][0])
  assert new["intermediates"]["conv0"]["__call__"][0].dtype == jnp.bfloat16
  act = act.astype(np.float64)
  stats = new["batch_stats"]["bn0"]
  assert stats["mean"].dtype == jnp.float32 and stats["var"].dtype == jnp.float32
  np.testing.assert_allclose(stats["mean"], 0.1 * act.mean((0, 1, 2)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * act.var((0, 1, 2)), rtol=1e-5)


# ----------------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("case", RESNET_CASES)
def test_zero_init_last_bn_scale_in_every_residual_block(case):
  flat = _flat(_initialized(case)[1])
  scales = {k[: -len("/scale")]: v for k, v in flat.items() if k.endswith("/scale")}
  blocks = sorted({k.split("/")[0] for k in scales if k.startswith("stage")})
  assert len(blocks) == (8 if "18" in case else 16)
  zero = set()
  for block in blocks:
    branch_bns = sorted(k for k in scales if k.startswith(block + "/bn"))
    assert len(branch_bns) == (2 if "18" in case else 3)
    zero.add(branch_bns[-1])  # bn2 (basic) / bn3 (bottleneck): the residual branch's last BN
  for name, scale in scales.items():
    expected = 0.0 if name in zero else 1.0
    assert np.all(np.asarray(scale) == expected), (name, scale)
  for name, leaf in flat.items():
    if name.endswith("/bias") and ("bn" in name.split("/")[-2]):
      assert np.all(np.asarray(leaf) == 0.0), name


def test_kaiming_normal_fan_in_init():
  """Every large conv kernel has std sqrt(2/fan_in), fan_in = prod(kernel) * in_channels."""
  checked, fan_out_differs = 0, False
  for case in ("resnet18_2d", "resnet18_1d", "resnet50_2d", "cnn_2d"):
    for name, k in _flat(_initialized(case)[1]).items():
      if not name.endswith("kernel") or "conv" not in name or k.size < 4096:
        continue
      fan_in = int(np.prod(k.shape[:-1]))
      fan_out = int(np.prod(k.shape[:-2])) * k.shape[-1]
      std = float(np.std(np.asarray(k)))
      assert abs(std / np.sqrt(2.0 / fan_in) - 1) < 0.05, (case, name, std, fan_in)
      assert abs(float(np.mean(np.asarray(k)))) < 0.05 * np.sqrt(2.0 / fan_in)
      fan_out_differs |= abs(np.sqrt(fan_out / fan_in) - 1) > 0.2
      checked += 1
  assert checked >= 10
  assert fan_out_differs  # the check above could tell fan_in from fan_out


# ----------------------------------------------------------------------------- BatchNorm


def _worker_batches():
  """(W, 4, 8, 8, 3): worker w's inputs have mean w and std w + 1, so its statistics differ."""
  z = jax.random.normal(jax.random.key(3), (W, 4, 8, 8, 3))
  w = jnp.arange(W, dtype=jnp.float32).reshape(W, 1, 1, 1, 1)
  return z * (w + 1.0) + w


@functools.cache
def _first_conv_outputs():
  """(W, 4, 8, 8, 8): the first conv's output (BN input) on each worker's batch."""
  model, params, state, _ = _initialized("cnn_2d")
  capture = jax.jit(jax.vmap(lambda x: model.apply(
      {"params": params, **state}, x, train=True, mutable=["batch_stats", "intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name == "conv0")[1]["intermediates"]))
  return np.asarray(capture(_worker_batches())["conv0"]["__call__"][0], np.float64)


def test_per_worker_batchnorm_statistics_under_vmap():
  model, params, state, _ = _initialized("cnn_2d")
  assert model.bn_axis_name is None
  step = jax.jit(jax.vmap(lambda s, x: models.apply_model(model, params, s, x, True),
                          in_axes=(None, 0), axis_name="w"))
  _, new_state = step(state, _worker_batches())
  act = _first_conv_outputs()
  mean, var = act.mean(axis=(1, 2, 3)), act.var(axis=(1, 2, 3))  # (W, C), biased variance
  stats = new_state["batch_stats"]["bn0"]
  assert stats["mean"].shape == (W, 8)
  # momentum 0.9 from the initial (mean 0, var 1): new = 0.9 * old + 0.1 * batch statistic.
  np.testing.assert_allclose(stats["mean"], 0.1 * mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * var, rtol=1e-5, atol=1e-6)
  assert not np.allclose(var[0], var[-1], rtol=0.1)  # the workers really differ


def test_synchronised_batchnorm_statistics_under_vmap():
  model = _model("cnn_2d", bn_axis_name="w")
  _, params, state, _ = _initialized("cnn_2d")
  step = jax.jit(jax.vmap(lambda x: models.apply_model(model, params, state, x, True),
                          axis_name="w"))
  _, new_state = step(_worker_batches())
  act = _first_conv_outputs()
  mean, var = act.mean(axis=(0, 1, 2, 3)), act.var(axis=(0, 1, 2, 3))  # concatenated batch
  stats = new_state["batch_stats"]["bn0"]
  np.testing.assert_allclose(stats["mean"], np.broadcast_to(0.1 * mean, (W, 8)),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["var"], np.broadcast_to(0.9 + 0.1 * var, (W, 8)),
                             rtol=1e-5, atol=1e-6)
  for leaf in jax.tree.leaves(new_state):  # deeper BN layers agree across workers too
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), rtol=1e-6)


@pytest.mark.parametrize("case", BN_CASES)
def test_bn_axis_name_reaches_every_batchnorm(case):
  """One collective per BN layer with ``bn_axis_name``; none without (per-worker BN)."""
  _, params, state, x = _initialized(case)
  num_bn = len(jax.tree.leaves(state)) // 2
  counts = {}
  for axis in (None, "w"):
    closed = jax.make_jaxpr(models.apply_model, static_argnums=(0, 4), axis_env=[("w", W)])(
        _model(case, bn_axis_name=axis), params, state, x, True)
    psums = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "psum"]
    assert all(v.aval.dtype == jnp.float32 for e in psums for v in e.invars)
    counts[axis] = len(psums)
  assert counts == {None: 0, "w": num_bn}


def test_eval_mode_uses_running_statistics():
  model, params, state, _ = _initialized("cnn_2d")
  x = _worker_batches()[1]
  # Pretend some training happened so the running statistics are not the identity.
  state = jax.tree.map(lambda a: a + 0.5, state)
  logits_eval, state_eval = apply_jit(model, params, state, x, False)
  single_eval, _ = apply_jit(model, params, state, x[:1], False)
  logits_train, state_train = apply_jit(model, params, state, x, True)
  single_train, _ = apply_jit(model, params, state, x[:1], True)
  assert jax.tree.all(jax.tree.map(np.array_equal, state_eval, state))
  assert not jax.tree.all(jax.tree.map(np.array_equal, state_train, state))
  # Evaluation is per-example (running stats); training normalises with the batch's stats.
  np.testing.assert_allclose(single_eval[0], logits_eval[0], rtol=1e-5, atol=1e-5)
  assert not np.allclose(single_train[0], logits_train[0], rtol=1e-3, atol=1e-3)


def test_bn_momentum_zero_keeps_last_batch_statistics():
  model = _model("cnn_2d", bn_momentum=0.0)
  _, params, state, _ = _initialized("cnn_2d")
  x = _worker_batches()[2]
  _, new_state = jax.jit(lambda x: models.apply_model(model, params, state, x, True))(x)
  act = _first_conv_outputs()[2]
  np.testing.assert_allclose(new_state["batch_stats"]["bn0"]["var"], act.var((0, 1, 2)),
                             rtol=1e-5)


def test_stateless_models_apply_is_a_no_op_on_state():
  for case in ("mlp_2d", "lstm_lm"):
    model, params, state, x = _initialized(case)
    assert state == {}
    for train in (True, False):
      _, new_state = apply_jit(model, params, state, x, train)
      assert new_state == {}
  model = _model("cnn_2d", use_bn=False)
  params, state = jax.eval_shape(functools.partial(models.init_model, model), KEY, _initialized("cnn_2d")[3])
  assert state == {} and "bias" in params["conv0"]


# ----------------------------------------------------------------------------- LSTM LM


def test_lstm_lm_is_causal():
  model, params, state, tokens = _initialized("lstm_lm")
  t = 3
  perturbed = tokens.at[:, t].set((tokens[:, t] + 1) % 11)
  logits, _ = apply_jit(model, params, state, tokens, False)
  logits_p, _ = apply_jit(model, params, state, perturbed, False)
  np.testing.assert_array_equal(logits[:, :t], logits_p[:, :t])
  for s in range(t, tokens.shape[1]):  # position t and every later one do see the change
    assert not np.allclose(logits[:, s], logits_p[:, s], rtol=1e-6, atol=1e-6), s


# ----------------------------------------------------------------------------- registry, validation


def test_registry_builds_each_model():
  expected = {"mlp": models.MLP, "cnn": models.CNN, "resnet18": models.ResNet18,
              "resnet50": models.ResNet50, "lstm_lm": models.LSTMLM}
  assert dict(models.MODELS) == expected
  assert isinstance(models.get_model("cnn", features=(4,), num_classes=3), models.CNN)
  assert models.get_model("resnet18", width=8).width == 8
  assert models.get_model("resnet50").stage_sizes == (3, 4, 6, 3)


def test_registry_unknown_name():
  with pytest.raises(ValueError, match=r"'resnet34'.*cnn.*lstm_lm.*mlp.*resnet18.*resnet50"):
    models.get_model("resnet34")


# ----------------------------------------------------------------------------- GEMM convolution


@pytest.mark.parametrize("kernel,strides,padding,dilation", [
    ((3, 3), (1, 1), [(1, 1), (1, 1)], (1, 1)),
    ((3, 3), (2, 2), [(1, 1), (1, 1)], (1, 1)),
    ((7, 7), (2, 2), [(3, 3), (3, 3)], (1, 1)),
    ((1, 1), (2, 2), "VALID", (1, 1)),
    ((1, 1), (1, 1), "SAME", (1, 1)),
    ((3, 3), (1, 1), "SAME", (2, 2)),
    ((3, 2), (1, 2), [(2, 0), (1, 1)], (1, 1)),
    ((3,), (1,), "SAME", (1,)),
])
def test_gemm_conv_equals_lax_conv(kernel, strides, padding, dilation):
  """Patches x matrix against XLA's convolution (float32, highest precision both sides)."""
  nd = len(kernel)
  rng = np.random.default_rng(len(kernel) + sum(strides))
  x = jnp.asarray(rng.normal(size=(2,) + (9,) * nd + (3,)), jnp.float32)
  k = jnp.asarray(rng.normal(size=kernel + (3, 5)), jnp.float32)
  spec = ("NHWC", "HWIO", "NHWC") if nd == 2 else ("NWC", "WIO", "NWC")
  dn = jax.lax.conv_dimension_numbers(x.shape, k.shape, spec)
  kw = dict(rhs_dilation=dilation, dimension_numbers=dn, precision=jax.lax.Precision.HIGHEST)
  want = jax.lax.conv_general_dilated(x, k, strides, padding, **kw)
  got = models.gemm_conv_general_dilated(x, k, strides, padding, **kw)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["cnn_2d", "cnn_1d", "resnet18_2d", "resnet50_2d"])
def test_conv_impl_gemm_is_the_same_model(case):
  """Same parameters, same logits and BN statistics; the per-worker ``vmap`` of the GEMM
  model has no grouped convolution (a batched dot instead)."""
  model, params, state, x = _initialized(case)
  gemm = model.clone(conv_impl="gemm")
  want, want_state = apply_jit(model, params, state, x, True)
  got, got_state = apply_jit(gemm, params, state, x, True)
  # float32 rounding differs by summation order; ResNet-50's 1x1-spatial last stage normalises
  # over 2 examples, which amplifies it (measured max 1.6e-4 on logits of size ~1)
  tol = 1e-3 if case.startswith("resnet50") else 1e-4
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol / 10)
  stacked = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), params)
  xs = jnp.stack([x, x])
  per_worker = lambda m: jax.jit(jax.vmap(  # noqa: E731
      lambda p, xx: models.apply_model(m, p, state, xx, train=False)[0])).lower(stacked, xs)
  assert "feature_group_count = 2" in per_worker(model).as_text()
  text = per_worker(gemm).as_text()
  assert "feature_group_count = 2" not in text and "batching_dims = [0]" in text
  # Every patch matrix (3x3 via _patches, 1x1 via a strided slice) reaches its dot through an
  # optimization barrier, one per convolution of the XLA model: without it, XLA:GPU (JAX
  # 0.10.2) aborts compiling ResNet-18 steps of this lowering (experiments/bench_gpu_hlo.py;
  # BENCHMARKS.md, "deviceless XLA:GPU compilation").
  num_convs = per_worker(model).as_text().count("stablehlo.convolution")
  assert num_convs > 0
  assert text.count("stablehlo.optimization_barrier") == num_convs


def test_conv_impl_validation():
  with pytest.raises(ValueError, match="conv_impl must be one of .*got 'cudnn'"):
    models.get_model("resnet18", conv_impl="cudnn")


@pytest.mark.parametrize("name,kwargs,field", [
    ("mlp", dict(num_classes=0), "num_classes"),
    ("mlp", dict(hidden=(8, -1)), "hidden"),
    ("cnn", dict(features=()), "features"),
    ("cnn", dict(dtype=jnp.int32), "dtype"),
    ("cnn", dict(bn_momentum=1.0), "bn_momentum"),
    ("resnet18", dict(width=0), "width"),
    ("resnet18", dict(bn_axis_name=3), "bn_axis_name"),
    ("resnet50", dict(num_classes=-2), "num_classes"),
    ("resnet50", dict(stem="tiny"), "stem"),
    ("lstm_lm", dict(vocab_size=0), "vocab_size"),
    ("lstm_lm", dict(vocab_size=10, num_layers=0), "num_layers"),
])
def test_constructor_validation(name, kwargs, field):
  with pytest.raises(ValueError, match=field):
    models.get_model(name, **kwargs)


def test_input_validation():
  with pytest.raises(ValueError, match=r"\(2, 8\)"):
    models.init_model(_model("cnn_2d"), KEY, jnp.zeros((2, 8)))
  with pytest.raises(ValueError, match="tokens"):
    models.init_model(_model("lstm_lm"), KEY, jnp.zeros((2, 7), jnp.float32))


# ----------------------------------------------------------------------------- grouped BatchNorm


def _flax_bn_per_group(x, scale, bias, groups, momentum=0.9):
  """Reference: flax's BatchNorm applied to each group of N/groups examples (vmap), with its
  running statistics starting at (0, 1): (y, new mean (G, C), new var (G, C))."""
  import flax.linen as nn
  bn = nn.BatchNorm(use_running_average=False, momentum=momentum, epsilon=models.BN_EPSILON,
                    dtype=x.dtype, param_dtype=jnp.float32)
  c = x.shape[-1]

  def one(xg):
    y, st = bn.apply({"params": {"scale": scale, "bias": bias},
                      "batch_stats": {"mean": jnp.zeros(c), "var": jnp.ones(c)}},
                     xg, mutable=["batch_stats"])
    return y, st["batch_stats"]["mean"], st["batch_stats"]["var"]

  y, mean, var = jax.vmap(one)(x.reshape((groups, -1) + x.shape[1:]))
  return y.reshape(x.shape), mean, var


@pytest.mark.parametrize("shape,groups,dtype", [
    ((12, 5, 5, 6), 4, jnp.float32),    # 2-D images
    ((8, 7, 3), 2, jnp.float32),        # 1-D sequences
    ((9, 4), 3, jnp.float32),           # no spatial axis (3 examples per group)
    ((8, 4, 4, 8), 8, jnp.float32),     # one example per group
    ((12, 5, 5, 6), 4, jnp.bfloat16),   # bf16 compute, float32 statistics
    ((6, 5, 5, 6), 1, jnp.float32),     # one group: bn_impl="mfopt"
])
def test_group_batch_norm_equals_flax_batchnorm_per_group(shape, groups, dtype):
  """Values, running statistics and gradients (x, scale, bias) of the hand-written VJP against
  autodiff through flax's BatchNorm applied group by group. Channel offsets of 10 make the
  one-pass variance's cancellation visible if the arithmetic differs."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=shape) * 3 + 10 * rng.normal(size=shape[-1]), dtype)
  c = shape[-1]
  scale = jnp.asarray(rng.normal(size=c), jnp.float32)
  bias = jnp.asarray(rng.normal(size=c), jnp.float32)
  w = jnp.asarray(rng.normal(size=shape), jnp.float32)
  tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-4, atol=2e-4)

  def mine(x, scale, bias):
    return models.group_batch_norm(x, scale, bias, models.BN_EPSILON, groups)

  # jitted: compiling each small program is quicker than dispatching its ops one by one
  y, mean, var = jax.jit(mine)(x, scale, bias)
  y_ref, mean_ref, var_ref = jax.jit(_flax_bn_reference(groups))(x, scale, bias)
  assert y.dtype == dtype and mean.dtype == var.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), **tol)
  # flax's new running value is 0.9 * init + 0.1 * batch statistic
  np.testing.assert_allclose(0.1 * mean, mean_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(0.9 + 0.1 * var, var_ref, rtol=1e-4, atol=1e-4)

  def loss(f):
    return lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * w)

  got = jax.jit(jax.grad(loss(mine), argnums=(0, 1, 2)))(x, scale, bias)
  want = jax.jit(jax.grad(loss(_flax_bn_reference(groups)), argnums=(0, 1, 2)))(x, scale, bias)
  for g, r in zip(got, want):
    scale_of = float(jnp.abs(r.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(g, np.float32) / scale_of,
                               np.asarray(r, np.float32) / scale_of, **tol)


def _flax_bn_reference(groups):
  return lambda x, scale, bias: _flax_bn_per_group(x, scale, bias, groups)


@pytest.mark.parametrize("dtype,x_dtype", [(None, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                           (None, jnp.float32), (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("use_running_average", [False, True])
def test_group_batch_norm_has_flax_batchnorm_dtypes(dtype, x_dtype, use_running_average):
  """groups=1 is a drop-in for nn.BatchNorm, dtypes included: a bf16 input without ``dtype``
  gave bf16 (flax: float32, promoted with the parameters), and ``dtype=bf16`` on a float32
  input took its statistics from the rounded input (flax: from the input as given)."""
  import flax.linen as nn
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 5, 5, 6)) * 3 + 5, x_dtype)
  variables = {"params": {"scale": jnp.linspace(0.5, 1.5, 6), "bias": jnp.linspace(-1, 1, 6)},
               "batch_stats": {"mean": jnp.linspace(0, 1, 6), "var": jnp.linspace(1, 2, 6)}}
  kw = dict(use_running_average=use_running_average, momentum=0.9, epsilon=1e-5, dtype=dtype)
  want, want_stats = nn.BatchNorm(**kw).apply(variables, x, mutable=["batch_stats"])
  got, got_stats = models.GroupBatchNorm(groups=1, **kw).apply(variables, x,
                                                               mutable=["batch_stats"])
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  for k in ("mean", "var"):
    np.testing.assert_allclose(got_stats["batch_stats"][k], want_stats["batch_stats"][k],
                               rtol=1e-6, atol=1e-6)
  if not use_running_average:  # the input's cotangent comes back in the input's dtype
    gx = jax.grad(lambda x: jnp.sum(models.GroupBatchNorm(groups=1, **kw).apply(
        variables, x, mutable=["batch_stats"])[0].astype(jnp.float32) ** 2))(x)
    assert gx.dtype == x_dtype


def test_resnet_with_bn_groups_is_the_per_group_model():
  """A two-stage ResNet (stem BN, residual BNs, a projection shortcut's BN) with bn_groups=4
  on 16 examples = the bn_groups=1 model applied to 4 groups of 4 under vmap (the
  worker-stacked layout): logits, new running statistics (G, C) and the gradient of the mean
  loss; evaluation mode uses each group's running statistics."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 8, 8, 3)), jnp.float32)
  one = models.ResNet(stage_sizes=(1, 1), num_classes=5, width=4)
  grouped = one.clone(bn_groups=4)
  params, state = models.init_model(one, jax.random.PRNGKey(0), x[:4])
  stacked = jax.tree.map(lambda a: jnp.stack([a + 0.1 * i for i in range(4)]), state)

  def loss_grouped(p):
    logits, new = models.apply_model(grouped, p, stacked, x, train=True)
    return jnp.mean(logits ** 2), (logits, new)

  def loss_vmapped(p):
    logits, new = jax.vmap(lambda s, xg: models.apply_model(one, p, s, xg, train=True))(
        stacked, x.reshape(4, 4, 8, 8, 3))
    return jnp.mean(logits ** 2), (logits.reshape(16, 5), new)

  # jitted: op-by-op dispatch of the ResNet's forward and backward took longer than compiling
  (_, (lg, ng)), gg = jax.jit(jax.value_and_grad(loss_grouped, has_aux=True))(params)
  (_, (lv, nv)), gv = jax.jit(jax.value_and_grad(loss_vmapped, has_aux=True))(params)
  np.testing.assert_allclose(lg, lv, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(ng), jax.tree.leaves(nv)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gv)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * float(jnp.abs(b).max()) + 1e-7)
  eval_g = jax.jit(lambda: models.apply_model(grouped, params, stacked, x, train=False)[0])()
  eval_v = jax.jit(jax.vmap(lambda s, xg: models.apply_model(one, params, s, xg, train=False)[0]))(
      stacked, x.reshape(4, 4, 8, 8, 3)).reshape(16, 5)
  np.testing.assert_allclose(eval_g, eval_v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_bn_impl_mfopt_is_flax_batchnorm_with_a_hand_written_backward(name):
  """bn_impl="mfopt" (GroupBatchNorm, one group) is a drop-in for flax's BatchNorm: the same
  parameter and statistics trees, and the same logits, new statistics and gradients in
  training mode, and the same logits in evaluation mode."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(8, 8, 8, 3)) + 2.0, jnp.float32)
  kw = dict(num_classes=5, width=4) if name == "resnet18" else dict(features=(4, 8),
                                                                       num_classes=5)
  flax_model = models.get_model(name, **kw)
  mine = models.get_model(name, bn_impl="mfopt", **kw)
  params, state = models.init_model(flax_model, jax.random.PRNGKey(0), x)
  params2, state2 = models.init_model(mine, jax.random.PRNGKey(0), x)
  assert jax.tree.structure(params) == jax.tree.structure(params2)
  assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, state2)

  # jitted (the model static): op-by-op dispatch of the ResNet took longer than compiling it
  @functools.partial(jax.jit, static_argnums=0)
  def run(model):
    def loss(p):
      logits, new = models.apply_model(model, p, state, x, train=True)
      return jnp.mean(logits ** 2), (logits, new)
    (_, (logits, new)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, new, grads, models.apply_model(model, params, new, x, train=False)[0]

  for a, b in zip(jax.tree.leaves(run(flax_model)), jax.tree.leaves(run(mine))):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * float(jnp.abs(a).max()) + 1e-7)


def test_bn_groups_validation():
  with pytest.raises(ValueError, match=r"bn_groups must be a positive integer, got 0"):
    models.get_model("cnn", bn_groups=0)
  with pytest.raises(ValueError, match=r"bn_groups=2 .* bn_axis_name='w' .* exclude each other"):
    models.get_model("resnet18", bn_groups=2, bn_axis_name="w")
  with pytest.raises(ValueError, match=r"bn_impl must be one of \('flax', 'mfopt'\), got 'x'"):
    models.get_model("cnn", bn_impl="x")
  with pytest.raises(ValueError, match=r"bn_impl='mfopt' has no synchronised BN"):
    models.get_model("cnn", bn_impl="mfopt", bn_axis_name="w")
  model = models.get_model("cnn", features=(4,), num_classes=3, bn_groups=3)
  with pytest.raises(ValueError, match=r"multiple of groups=3, got input shape \(4, 8, 8, 4\)"):
    models.init_model(model, jax.random.PRNGKey(0), jnp.zeros((4, 8, 8, 1)))
  # the layer used directly (a ZeroDivisionError from the modulo)
  for groups in (0, -2, 1.5):
    with pytest.raises(ValueError, match=rf"groups must be a positive integer, got {groups}"):
      models.GroupBatchNorm(groups=groups).init(jax.random.PRNGKey(0), jnp.zeros((4, 3)))


def test_batchnorm_epsilon_is_the_flax_and_pytorch_default():
  """Every model's BatchNorm adds epsilon = 1e-5 (flax's and PyTorch's default, as the papers'
  models use) to the variance: with a running variance of 1e-4 in evaluation mode bn0 scales
  its input by 1 / sqrt(1.1e-4) ~ 95; epsilon 1e-3 would give ~30, and a near-constant
  channel would be normalised differently in training too."""
  model, params, state, x = _initialized("cnn_2d")
  stats = {"bn0": {"mean": jnp.zeros(8), "var": jnp.full(8, 1e-4)}}
  state = {"batch_stats": {**state["batch_stats"], **stats}}
  _, inter = jax.jit(lambda p, s, x: model.apply(
      {"params": p, **s}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name in ("conv0", "bn0")))(params, state, x[:1])
  conv0 = np.asarray(inter["intermediates"]["conv0"]["__call__"][0], np.float64)
  bn0 = np.asarray(inter["intermediates"]["bn0"]["__call__"][0], np.float64)
  bn = params["bn0"]
  want = conv0 / np.sqrt(1e-4 + 1e-5) * np.asarray(bn["scale"]) + np.asarray(bn["bias"])
  np.testing.assert_allclose(bn0, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_basic_block_downsamples_in_its_first_conv():
  """A downsampling BasicBlock strides in conv1, as ResNet-18 (He et al.; torchvision) does: on
  the 1-D ResNet-18 (length 16 into stage 2) conv1 and conv2 both give length 8. Striding in
  conv2 keeps the block's output shape but runs conv1 at full resolution (another network)."""
  m, p, s, x = _initialized("resnet18_1d")
  _, inter = jax.eval_shape(lambda p, s, x: m.apply(
      {"params": p, **s}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name in ("conv1", "conv2")), p, s, x)
  block = inter["intermediates"]["stage2_block0"]
  assert x.shape[1] == 16
  assert block["conv1"]["__call__"][0].shape[1] == 8
  assert block["conv2"]["__call__"][0].shape[1] == 8


def test_group_batch_norm_running_statistics_start_as_flax_batchnorms():
  """GroupBatchNorm's running statistics start at mean 0 and variance 1 (flax's nn.BatchNorm,
  the identity normalisation): an initial variance of 0 would make evaluation before or early
  in training divide by sqrt(epsilon), scaling activations ~300-fold."""
  x = jnp.ones((4, 3, 2))
  bn = models.GroupBatchNorm(groups=2, use_running_average=True)  # (no eager training pass)
  variables = bn.init(KEY, x)
  np.testing.assert_array_equal(np.asarray(variables["batch_stats"]["mean"]), np.zeros((2, 2)))
  np.testing.assert_array_equal(np.asarray(variables["batch_stats"]["var"]), np.ones((2, 2)))
  y = bn.apply(variables, x)  # scale 1, bias 0: x / sqrt(1 + eps)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) / np.sqrt(1 + 1e-5), rtol=1e-6)


def test_projection_shortcut_is_a_conv_and_a_batchnorm():
  """Where a residual block changes shape its shortcut is a 1x1 conv followed by BatchNorm
  (ResNet option B, torchvision's downsample), an ordinary BN (scale 1) with its own running
  statistics: without it the shortcut adds an unnormalised conv output to the branch."""
  for case in ("resnet18_2d", "resnet50_2d"):
    _, params, state, _ = _initialized(case)
    flat, stats = _flat(params), _flat(state["batch_stats"])
    convs = sorted(k[: -len("/proj_conv/kernel")] for k in flat if k.endswith("proj_conv/kernel"))
    assert len(convs) == (3 if "18" in case else 4)
    for block in convs:
      width = flat[f"{block}/proj_conv/kernel"].shape[-1]
      np.testing.assert_array_equal(np.asarray(flat[f"{block}/proj_bn/scale"]), np.ones(width))
      assert stats[f"{block}/proj_bn/var"].shape == (width,)


def test_mlp_is_dense_relu_layers_then_a_dense_head():
  """The MLP computes relu(x W0 + b0) -> relu(. W1 + b1) -> . W2 + b2 on the flattened input
  (NumPy forward pass in float64 with the model's own parameters); a missing activation makes
  it a linear model whatever its depth."""
  model, params, state, x = _initialized("mlp_1d")
  logits, _ = apply_jit(model, params, state, x, True)  # (train is ignored; compiled above)
  h = np.asarray(x, np.float64).reshape(x.shape[0], -1)
  for name in ("dense0", "dense1", "head"):
    h = h @ np.asarray(params[name]["kernel"], np.float64) + np.asarray(params[name]["bias"])
    h = np.maximum(h, 0.0) if name != "head" else h
  np.testing.assert_allclose(np.asarray(logits), h, rtol=1e-4, atol=1e-5 * np.abs(h).max())


def test_cnn_head_reads_the_global_average_of_the_last_block():
  """The CNN's head sees the spatial mean of its last block's output (global average pooling):
  NumPy relu -> 2x2 max-pool -> mean over positions -> head from the captured bn1 output (4x4
  for an 8x8 input). Pooling by max instead changes every logit."""
  model, params, state, x = _initialized("cnn_2d")
  logits, inter = jax.jit(lambda p, s, x: model.apply(
      {"params": p, **s}, x, train=False, mutable=["intermediates"],
      capture_intermediates=lambda mdl, _: mdl.name == "bn1"))(params, state, x)
  h = np.maximum(np.asarray(inter["intermediates"]["bn1"]["__call__"][0], np.float64), 0.0)
  n, _, _, c = h.shape
  pooled = h.reshape(n, 2, 2, 2, 2, c).max(axis=(2, 4)).mean(axis=(1, 2))
  want = pooled @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"])
  np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
