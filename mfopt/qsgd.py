"""QSGD: stochastic, unbiased gradient quantization exchanged with ``all_gather``.

Alistarh et al. 2017 ("QSGD", seed 001's baseline [14]), with ``s = 2^(bits-1) - 1``
levels per sign and bucketing: the flattened gradient is cut into buckets of
``bucket_size`` values; bucket ``v`` is sent as its norm ``||v||_2`` (float32) and
the signed integer levels

.. math::

   q_i = \\mathrm{sign}(v_i)\\,\\big(\\ell_i + \\mathrm{Bernoulli}(s|v_i|/\\|v\\| - \\ell_i)\\big),
   \\qquad \\ell_i = \\lfloor s|v_i|/\\|v\\| \\rfloor,

so that :math:`E[\\|v\\| q_i / s] = v_i` (unbiased). Every worker all-gathers
the int8 levels and the scales of all workers (in one int8 buffer, the scales' bytes
appended: one ``all_gather`` per step), dequantizes and averages them
(integers must not be summed in an all-reduce: the sum would overflow int8 and
the scales differ per worker). The result is identical on every worker.

Payload per worker per step (what :class:`mfopt.comm.CommStats` counts):
``n`` int8 values + ``ceil(n / bucket_size)`` float32 scales for ``n``
parameters, about 1/4 of a float32 exchange for 8 bits. The values are held in
int8 for every ``bits`` in [2, 8] (not bit-packed), so ``bits < 8`` saves no
bytes here. The cost model's wire bytes for an all-gather are ``(n_w - 1) x
payload``, which outgrow a ring all-reduce's ``2 (n_w-1)/n_w x`` fp32 payload as
workers grow (``mfopt.costmodel.wire_bytes``).

Randomness: step ``count`` and worker index are folded into ``seed``; nothing
random lives in the state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree

from mfopt import _checks
from mfopt.comm import (AxisName, CollectiveKind, CommStats, axis_tuple, check_axis_name,
                        init_comm_stats, is_floating, require_bound)

__all__ = ["QSGDState", "qsgd", "quantize", "dequantize", "qsgd_payload_bytes"]


class QSGDState(NamedTuple):
  """State of :func:`qsgd`: step count and the all-gather counter."""

  count: jax.Array
  comm: CommStats


def _levels(bits: int) -> int:
  return 2 ** (bits - 1) - 1


def qsgd_payload_bytes(num_params: int, bits: int = 8, bucket_size: int = 512) -> int:
  """Bytes one worker contributes per exchange: int8 levels + float32 bucket norms."""
  del bits  # held in int8 whatever ``bits`` (not packed)
  return num_params + 4 * (-(-num_params // bucket_size))


def quantize(v: jax.Array, key: jax.Array, bits: int = 8,
             bucket_size: int = 512) -> tuple[jax.Array, jax.Array]:
  """Quantizes a flat float vector: returns ``(int8 levels (n,), float32 norms (buckets,))``."""
  n = v.shape[0]
  nb = -(-n // bucket_size)
  s = _levels(bits)
  x = jnp.pad(v.astype(jnp.float32), (0, nb * bucket_size - n)).reshape(nb, bucket_size)
  # ||x|| as max|x| * ||x / max|x|||: squaring first overflows float32 once |x_i| > ~1.8e19,
  # and a finite gradient then came back NaN (counted as an overflow under loss scaling).
  # The divisions are done on the bucket scaled by 2^-e, 2^e just above its max |x| (exact:
  # the same quotients): XLA divides by multiplying with the reciprocal, which for a norm or
  # peak >= ~2^126 is subnormal and flushed to 0, and the bucket came back as 0. The power of
  # two goes in two factors so that neither leaves float32's normal range.
  peak = jnp.max(jnp.abs(x), axis=1)
  _, e = jnp.frexp(peak)
  half = e // 2
  one = jnp.float32(1)  # (float32 factors: a Python 1.0 is float64 under x64)
  ux = x * jnp.ldexp(one, -half)[:, None] * jnp.ldexp(one, half - e)[:, None]  # x 2^-e
  upeak = jnp.max(jnp.abs(ux), axis=1)  # peak 2^-e, exactly
  ratio = jnp.sqrt(jnp.sum(jnp.square(ux / jnp.where(upeak > 0, upeak, 1.0)[:, None]), axis=1))
  norms, unorm = peak * ratio, upeak * ratio  # unorm = norms * 2^-e
  scaled = jnp.abs(ux) / jnp.where(unorm > 0, unorm, 1.0)[:, None] * s
  low = jnp.floor(scaled)
  u = jax.random.uniform(key, scaled.shape, jnp.float32)
  level = low + (u < scaled - low).astype(jnp.float32)
  level = jnp.minimum(level, s)  # guards float rounding at |v_i| = ||v||
  q = (jnp.sign(x) * level).astype(jnp.int8).reshape(-1)[:n]
  return q, norms


def dequantize(q: jax.Array, norms: jax.Array, bits: int = 8,
               bucket_size: int = 512) -> jax.Array:
  """Inverse of :func:`quantize` (in expectation): ``norm * q / s`` per bucket."""
  n = q.shape[-1]
  nb = norms.shape[-1]
  s = _levels(bits)
  x = jnp.pad(q.astype(jnp.float32), (0, nb * bucket_size - n)).reshape(nb, bucket_size)
  return (x * (norms[:, None] / s)).reshape(-1)[:n]


def _all_gather(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """All-gather over one axis or a tuple of axes (one axis at a time, innermost first).

  A single ``all_gather`` over a tuple mixing a mesh axis and a ``vmap`` axis is
  rejected by JAX 0.10 ("axis size doesn't match"); gathering per axis gives the
  same ``(W, ...)`` result in worker order and is one logical exchange.
  """
  axes = axis_tuple(axis_name)
  for axis in reversed(axes):
    x = lax.all_gather(x, axis)
  return x.reshape((-1,) + x.shape[len(axes):])


def _pack(q: jax.Array, norms: jax.Array) -> jax.Array:
  """The int8 levels and the float32 norms' bytes in one int8 buffer, so that one all-gather
  carries both: the exchange counted by :class:`~mfopt.comm.CommStats` is then the one the
  program runs (two gathers would pay the per-collective latency twice)."""
  return jnp.concatenate([q, lax.bitcast_convert_type(norms, jnp.int8).reshape(-1)])


def _unpack(gathered: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`_pack` on a gathered ``(W, n + 4 * buckets)`` buffer."""
  norms = gathered[:, n:].reshape(gathered.shape[0], -1, 4)
  return gathered[:, :n], lax.bitcast_convert_type(norms, jnp.float32)


def qsgd(axis_name: AxisName, bits: int = 8, bucket_size: int = 512,
         seed: int = 0) -> optax.GradientTransformation:
  r"""Mean over workers of QSGD-quantized gradients (stochastic, unbiased), via ``all_gather``.

  .. math::  g \leftarrow \frac1W \sum_w Q_s(g_w), \qquad E[Q_s(g)] = g

  Put it first in a chain, like :func:`mfopt.sync_gradients`:
  ``optax.chain(mfopt.qsgd(axes), optax.sgd(lr, momentum=0.9))``.

  Args:
    axis_name: worker axes (``None``: one worker; the gradient is still
      quantized and dequantized locally, no collective).
    bits: bits per value including the sign, in [2, 8]; ``s = 2^(bits-1) - 1``
      levels (127 for 8 bits). Values travel as int8.
    bucket_size: values per bucket (one float32 norm each), >= 1.
    seed: base of the per-step, per-worker random keys.

  Returns:
    An ``optax.GradientTransformation`` whose state counts one all-gather per
    step with payload ``n + 4 * ceil(n / bucket_size)`` bytes per worker, ``n``
    the number of floating-point values. Other leaves (integer, bool, and the
    ``float0`` gradients JAX gives integer parameters) pass through unchanged
    and are not exchanged, as in :func:`mfopt.sync_gradients`.

  Example:
    >>> import jax.numpy as jnp, optax, mfopt
    >>> tx = mfopt.qsgd(None)
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> g, state = tx.update({"w": jnp.array([0.0, 0.0, -2.0])}, state)
    >>> g["w"].tolist()  # exact here: every |v_i| * s / ||v|| is an integer level
    [0.0, 0.0, -2.0]

  Seed: 001 §IV (QSGD-8bit baseline, ref. [14]).
  """
  if not _checks.is_int(bits) or not 2 <= bits <= 8:
    raise ValueError(f"bits must be an integer in [2, 8], got {bits!r}{_checks._array_hint(bits)}")
  _checks.positive_int("bucket_size", bucket_size)
  _checks.nonnegative_int("seed", seed)
  if seed >= 2**32:  # PRNGKey keeps 32 bits without x64: 2**32 would be seed 0's noise
    raise ValueError(f"seed must be below 2**32, got {seed!r}")
  axis_name = check_axis_name(axis_name)

  def init_fn(params):
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params) if is_floating(x))
    payload = 0 if axis_name is None else qsgd_payload_bytes(n, bits, bucket_size)
    return QSGDState(count=jnp.zeros([], jnp.int32),
                     comm=init_comm_stats(payload, CollectiveKind.ALL_GATHER))

  def update_fn(updates, state, params=None):
    del params
    require_bound(axis_name, "qsgd")
    leaves, treedef = jax.tree.flatten(updates)
    floating = [i for i, x in enumerate(leaves) if is_floating(x)]
    flat, unravel = ravel_pytree([leaves[i] for i in floating])
    if flat.size == 0:  # no float values (an empty optax.masked / multi_transform group)
      return updates, QSGDState(count=optax.safe_increment(state.count),
                                comm=state.comm)  # nothing exchanged
    dtype = flat.dtype
    key = jax.random.fold_in(jax.random.PRNGKey(seed), state.count)
    if axis_name is not None:
      key = jax.random.fold_in(key, lax.axis_index(axis_name))
    q, norms = quantize(flat, key, bits, bucket_size)
    if axis_name is None:
      mean = dequantize(q, norms, bits, bucket_size)
      comm = state.comm
    else:
      all_q, all_norms = _unpack(_all_gather(_pack(q, norms), axis_name), q.shape[0])
      deq = jax.vmap(lambda a, b: dequantize(a, b, bits, bucket_size))(all_q, all_norms)
      mean = jnp.mean(deq, axis=0)
      comm = state.comm._replace(count=state.comm.count + 1)
    for i, x in zip(floating, unravel(mean.astype(dtype))):
      leaves[i] = x
    return (jax.tree.unflatten(treedef, leaves),
            QSGDState(count=optax.safe_increment(state.count), comm=comm))

  return optax.GradientTransformation(init_fn, update_fn)
