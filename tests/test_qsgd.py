"""QSGD: unbiased quantization, exchanged as int8 + scales with all_gather, counted bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mfopt
from mfopt import costmodel, parallel
from mfopt.comm import CollectiveKind
from mfopt.qsgd import dequantize, qsgd_payload_bytes, quantize


def test_quantization_is_unbiased_statistically():
  """Mean of T independent quantizations -> v; tolerance 5 standard errors per coordinate.

  Var[Q(v)_i] = (||v_b|| / s)^2 p (1 - p) <= (||v_b|| / s)^2 / 4, so the standard error of
  the mean of T draws is at most ||v_b|| / (2 s sqrt(T)). bits=4 (s = 7) makes the levels
  coarse, so a biased rounding would miss by far more than the tolerance (checked below).
  """
  rng = np.random.default_rng(0)
  n, bucket, bits, draws = 1000, 128, 4, 4000
  v = jnp.asarray((rng.normal(size=n) * rng.uniform(0.01, 3.0, size=n)).astype(np.float32))
  keys = jax.random.split(jax.random.PRNGKey(1), draws)
  q_and_norms = jax.jit(jax.vmap(lambda k: quantize(v, k, bits, bucket)))(keys)
  deq = jax.jit(jax.vmap(lambda q, s: dequantize(q, s, bits, bucket)))(*q_and_norms)
  mean = np.asarray(deq).mean(0)
  norms = np.asarray(q_and_norms[1][0])
  s = 2 ** (bits - 1) - 1
  # The scale is the bucket's L2 norm (QSGD), recomputed here from v, not taken on trust.
  buckets = np.pad(np.asarray(v, np.float64), (0, -n % bucket)).reshape(-1, bucket)
  np.testing.assert_allclose(norms, np.linalg.norm(buckets, axis=1), rtol=1e-6)
  # Every draw rounds |v_i| / ||v_b|| * s to one of its two neighbouring levels.
  ideal = np.abs(np.asarray(v)) / np.repeat(norms, bucket)[:n] * s
  levels = np.abs(np.asarray(q_and_norms[0][:8], np.float64))
  assert np.all((levels >= np.floor(ideal) - 1e-6) & (levels <= np.floor(ideal) + 1 + 1e-6))
  se = np.repeat(norms, bucket)[:n] / (2 * s * np.sqrt(draws))
  assert np.all(np.abs(mean - np.asarray(v)) <= 5 * se)
  # Power: deterministic (floor) rounding is biased by far more than the tolerance.
  floor = np.floor(np.abs(np.asarray(v)) / np.repeat(norms, bucket)[:n] * s) * np.sign(v) \
      * np.repeat(norms, bucket)[:n] / s
  assert np.max(np.abs(floor - np.asarray(v)) / se) > 20
  # Each draw is a valid code: |q| <= s, int8.
  assert q_and_norms[0].dtype == jnp.int8 and int(jnp.abs(q_and_norms[0]).max()) <= s


def test_payload_bytes_are_int8_plus_scales_about_a_quarter_of_fp32():
  params = {"a": jnp.zeros((10, 100)), "b": jnp.zeros(300)}  # 1300 parameters
  n = 1300
  assert qsgd_payload_bytes(n, 8, 512) == n + 4 * 3
  state = mfopt.qsgd(mfopt.WORKER_AXES).init(params)
  assert int(state.comm.payload_bytes) == n + 12
  assert int(state.comm.kind) == CollectiveKind.ALL_GATHER
  ratio = (n + 12) / (4 * n)
  assert 0.25 < ratio < 0.26


def test_all_gather_wire_bytes_overtake_ring_all_reduce_as_workers_grow():
  n = 1_000_000
  q = qsgd_payload_bytes(n)
  f = 4 * n

  def ratio(workers):
    return (costmodel.wire_bytes(q, workers, CollectiveKind.ALL_GATHER)
            / costmodel.wire_bytes(f, workers, CollectiveKind.ALL_REDUCE))

  # (w-1) q vs 2 (w-1)/w f: equal at w = 2 f / q = 7.93...
  assert ratio(4) < 1 < ratio(8) < ratio(16) < ratio(32)
  np.testing.assert_allclose(ratio(16), 15 * q / (2 * 15 / 16 * f))


def test_distributed_qsgd_equals_mean_of_per_worker_quantizations_w16():
  workers = 16
  mesh = parallel.make_mesh()
  tx = optax.chain(mfopt.qsgd(mfopt.WORKER_AXES, bits=8, bucket_size=64, seed=3), optax.sgd(1.0))
  rng = np.random.default_rng(2)
  grads = {"a": rng.normal(size=(workers, 50)).astype(np.float32),
           "b": rng.normal(size=(workers, 5, 6)).astype(np.float32)}
  params = jax.tree.map(np.zeros_like, grads)

  def step(p, g):
    state = tx.init(p)
    updates, state = tx.update(g, state, p)
    return updates, state

  fn = jax.jit(parallel.per_worker(step, mesh, workers))
  updates, state = fn(parallel.shard_workers(params, mesh), parallel.shard_workers(grads, mesh))
  lowered = jax.jit(parallel.per_worker(step, mesh, workers)).lower(
      parallel.shard_workers(params, mesh), parallel.shard_workers(grads, mesh))
  text = lowered.compile().as_text()
  assert re.search(r"s8\[[^\]]*\]\S* all-gather", text)
  assert not re.search(r"s8\[[^\]]*\]\S* all-reduce", text)
  # One all-gather per step, levels and norms together (the counter's one exchange): the norms
  # travelled in a second, float32 all-gather before they were packed into the int8 buffer.
  gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
  assert gathers == ["s8[8,2,88]{2,1,0}"], gathers  # 8 devices x 2 local x (80 + 4 x 2) bytes
  # Reference: dequantize each worker's code (same keys) and average.
  deq = []
  for w in range(workers):
    flat = np.concatenate([grads["a"][w].reshape(-1), grads["b"][w].reshape(-1)])
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), 0), w)
    q, s = quantize(jnp.asarray(flat), key, 8, 64)
    deq.append(np.asarray(dequantize(q, s, 8, 64)))
  want = -np.mean(deq, axis=0)
  got = jax.device_get(updates)
  for w in range(workers):
    flat = np.concatenate([got["a"][w].reshape(-1), got["b"][w].reshape(-1)])
    np.testing.assert_allclose(flat, want, rtol=1e-6, atol=1e-7)
  exact = -np.concatenate([grads["a"].mean(0), grads["b"].reshape(workers, -1).mean(0)])
  assert np.abs(want - exact).max() > 0  # it is a quantized, not exact, mean
  np.testing.assert_allclose(want, exact, atol=0.05)
  totals = mfopt.comm_totals(state)
  assert totals["all_gathers"] == 1 and totals["all_gather_bytes"] == 80 + 4 * 2


@pytest.mark.parametrize("exchange", [lambda: mfopt.qsgd("w"), lambda: mfopt.sync_gradients("w")],
                         ids=["qsgd", "sync_gradients"])
def test_a_group_without_parameters_exchanges_nothing(exchange):
  """An optax.multi_transform group holding no parameters gave qsgd an empty tree: the gather's
  reshape divided by zero. It is a no-op now, with no exchange counted (sync_gradients counted
  an all-reduce of 0 bytes)."""
  tx = optax.multi_transform(
      {"q": optax.chain(exchange(), optax.sgd(1.0)), "plain": optax.sgd(1.0)}, {"a": "plain"})
  params = {"a": jnp.zeros((2, 3))}
  grads = {"a": jnp.ones((2, 3))}

  def step(p, g):
    updates, state = tx.update(g, tx.init(p), p)
    return updates, state

  updates, state = jax.vmap(step, axis_name="w")(params, grads)
  np.testing.assert_array_equal(np.asarray(updates["a"]), -np.ones((2, 3)))
  totals = mfopt.comm_totals(state)
  assert totals["all_gathers"] == totals["all_reduces"] == 0


def test_integer_and_float0_leaves_pass_through_and_are_not_sent():
  """Integer parameters (a step counter) get ``float0`` gradients from ``jax.grad(allow_int=True)``:
  ravelling them with the floats raised JAX's dtype error, and an int leaf would have been
  quantized. Only the float leaves are exchanged, with the same values as a float-only tree."""
  workers = 4
  rng = np.random.default_rng(5)
  floats = {"a": rng.normal(size=(workers, 7)).astype(np.float32),
            "b": rng.normal(size=(workers, 3)).astype(np.float32)}
  mixed = dict(floats, n=np.arange(workers, dtype=np.int32))

  def run(tree):
    tx = mfopt.qsgd("w", bucket_size=4, seed=1)
    return jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="w"))(tree)

  want, want_state = run(floats)
  got, state = run(mixed)
  for k in floats:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
  np.testing.assert_array_equal(np.asarray(got["n"]), mixed["n"])
  assert got["n"].dtype == jnp.int32
  assert int(state.comm.payload_bytes[0]) == qsgd_payload_bytes(10, 8, 4) == 10 + 4 * 3
  assert int(state.comm.payload_bytes[0]) == int(want_state.comm.payload_bytes[0])
  # One worker, a float0 gradient of an integer parameter, through jax.grad.
  params = {"w": jnp.array([0.0, -4.0]), "step": jnp.array(2, jnp.int32)}
  grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
  tx = mfopt.qsgd(None, bucket_size=2)
  out, _ = jax.jit(tx.update)(grads, tx.init(params))
  assert out["step"].dtype == jax.dtypes.float0
  np.testing.assert_allclose(np.asarray(out["w"]), [0.0, -8.0])  # each |g_i| s / ||g|| a level


@pytest.mark.parametrize("kw,match", [({"bits": 1}, r"bits must be an integer in \[2, 8\], got 1"),
                                      ({"bits": 9}, r"got 9"),
                                      ({"bucket_size": 0}, r"bucket_size must be a positive"),
                                      # PRNGKey keeps 32 bits: 2**32 drew seed 0's noise
                                      ({"seed": 2**32}, r"seed must be below 2\*\*32, got 4294967296")])
def test_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    mfopt.qsgd(None, **kw)


def test_a_huge_finite_gradient_stays_finite():
  """The bucket norm is max|x| * ||x / max|x||| : squaring first overflowed float32 at
  |x_i| ~ 1.8e19 and a finite gradient came back NaN."""
  v = jnp.asarray([3e19, 1.0, 0.0, -2e19], jnp.float32)
  q, norms = quantize(v, jax.random.key(0), bits=8, bucket_size=4)
  np.testing.assert_allclose(np.asarray(norms), [np.hypot(3e19, 2e19)], rtol=1e-6)
  out = np.asarray(dequantize(q, norms, bits=8, bucket_size=4))
  assert np.isfinite(out).all() and out[2] == 0.0
  np.testing.assert_allclose(out[[0, 3]], [3e19, -2e19], rtol=0.01)  # 127 levels of the norm
  # an ordinary vector's norms are unchanged (to float32 rounding)
  w = jax.random.normal(jax.random.key(1), (1000,))
  _, n = quantize(w, jax.random.key(2), bucket_size=512)
  want = [np.linalg.norm(np.asarray(w[:512], np.float64)), np.linalg.norm(np.asarray(w[512:], np.float64))]
  np.testing.assert_allclose(np.asarray(n), want, rtol=1e-6)


@pytest.mark.parametrize("big", [8e37, 1e38, 2.5e38])
def test_a_bucket_near_float32s_top_is_quantized_not_zeroed(big):
  """A bucket whose norm is >= ~2^126 came back as zeros: XLA divides by multiplying with the
  reciprocal, which is subnormal there and flushed to 0 (all levels 0 at 8e37; at 1e38 the
  norm itself was 0). Each value must round to a neighbouring level of its own norm, which
  is float64's (2.5e38: the norm 2.86e38 is still finite)."""
  v = np.asarray([big, 1.0, -0.5 * big, 0.25 * big], np.float32)
  q, norms = jax.jit(lambda v: quantize(v, jax.random.key(0), 8, 4))(jnp.asarray(v))
  norm = np.linalg.norm(v.astype(np.float64))
  np.testing.assert_allclose(float(norms[0]), norm, rtol=1e-6)
  out = np.asarray(dequantize(q, norms, 8, 4), np.float64)
  assert np.all(np.abs(out - v) <= norm / 127 * (1 + 1e-5)), (out, v)
  assert np.all(np.sign(out[[0, 2, 3]]) == [1, -1, 1])


def test_under_x64_the_norms_stay_float32_and_the_exchange_is_the_same():
  """The norms travel as 4 bytes each inside the int8 buffer: float64 norms (jax_enable_x64
  turns Python-float constants into float64) were packed as 8 bytes and unpacked as two
  float32s each, and the mean came back as garbage (-619.6 for -1) without an error."""
  v = jnp.asarray(np.linspace(-1.0, 1.0, 8), jnp.float32)
  g = {"a": jnp.stack([v, -v, 2 * v])}

  def exchange():  # jitted: op by op, every operation compiles again under x64 (5 s)
    tx = mfopt.qsgd("w", 8, 4)
    return jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="w"))(g)

  want = exchange()
  with jax.enable_x64(True):
    assert quantize(v, jax.random.key(0), 8, 4)[1].dtype == jnp.float32
    got = exchange()
  np.testing.assert_array_equal(np.asarray(got["a"]), np.asarray(want["a"]))
  np.testing.assert_allclose(np.asarray(want["a"][0]), np.asarray(2 * v / 3), atol=0.05)


def test_a_nonfinite_gradient_through_qsgd_is_a_reverted_step_under_loss_scaling():
  from mfopt import precision
  tx = precision.dynamic_loss_scale(optax.chain(mfopt.qsgd(None), optax.sgd(0.1, momentum=0.9)),
                                    init_scale=2.0 ** 10)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  u, state = tx.update({"w": jnp.array([1.0, 2.0, 3.0, 4.0])}, state, params)  # a finite step
  for bad in (jnp.inf, jnp.nan):
    u2, s2 = tx.update({"w": jnp.array([1.0, bad, 3.0, 4.0])}, state, params)
    np.testing.assert_array_equal(np.asarray(u2["w"]), np.zeros(4))
    assert not bool(s2.finite) and int(s2.overflows) == int(state.overflows) + 1
    assert float(s2.dynamic_scale.scale) == float(state.dynamic_scale.scale) / 2
    for a, b in zip(jax.tree.leaves(s2.inner_state), jax.tree.leaves(state.inner_state)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # momentum, key: unchanged


def test_an_all_zero_bucket_is_sent_as_zeros():
  """A bucket of zeros (a frozen layer's gradient, the padding of a short vector) has norm 0:
  it must code as level 0 with norm 0 and decode to exact zeros, not 0/0 = NaN, while the
  other buckets keep their L2 norm."""
  v = jnp.asarray([0.0, 0.0, 0.0, 0.0, 3.0, -4.0, 0.0, 0.0], jnp.float32)
  q, norms = jax.jit(lambda v, k: quantize(v, k, bits=8, bucket_size=4))(v, jax.random.key(0))
  np.testing.assert_allclose(np.asarray(norms), [0.0, 5.0], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(q[:4]), 0)
  out = np.asarray(jax.jit(lambda q, n: dequantize(q, n, bits=8, bucket_size=4))(q, norms))
  np.testing.assert_array_equal(out[[0, 1, 2, 3, 6, 7]], 0.0)
  # 3/5 * 127 = 76.2 and 4/5 * 127 = 101.6: each rounds to a neighbouring level
  assert abs(out[4] - 3.0) <= 5.0 / 127 + 1e-6 and abs(out[5] + 4.0) <= 5.0 / 127 + 1e-6
  tx = mfopt.qsgd(None)
  g, _ = jax.jit(tx.update)({"w": jnp.zeros(5)}, tx.init({"w": jnp.zeros(5)}))
  np.testing.assert_array_equal(np.asarray(g["w"]), np.zeros(5))


def test_a_bfloat16_gradient_comes_back_in_bfloat16():
  """The dequantized mean is float32 arithmetic; the exchanged gradient must return in the
  gradient's own dtype (a float32 update of a bf16 parameter promotes it). Values where every
  |v_i| s / ||v|| is an integer level are exact."""
  tx = mfopt.qsgd(None)
  g = {"w": jnp.asarray([0.0, 0.0, -2.0], jnp.bfloat16)}
  out, _ = jax.jit(tx.update)(g, tx.init(g))
  assert out["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), [0.0, 0.0, -2.0])


def test_a_bucket_with_one_nonzero_entry_codes_it_as_exactly_s():
  """|v_i| = ||v||: the level is exactly s (no randomness), for every draw. In float32 the
  quotient |v_i| / ||v|| * s can come out a rounding error above s (5.427619 is such a value),
  and a random draw could then round it up to s + 1, outside the code's range (7 bits: 64 > 63,
  a biased value). 2**20 independent draws, one per bucket."""
  bits = 7
  s = 2 ** (bits - 1) - 1
  v = jnp.tile(jnp.asarray([5.427619, 0.0], jnp.float32), 1 << 20)
  q, norms = jax.jit(lambda v: quantize(v, jax.random.key(7), bits, 2))(v)
  q = np.asarray(q)
  np.testing.assert_array_equal(q[0::2], s)
  np.testing.assert_array_equal(q[1::2], 0)
  np.testing.assert_allclose(np.asarray(norms), 5.427619, rtol=1e-6)
