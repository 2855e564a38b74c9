"""Models for the mfopt experiments (flax.linen): MLP, small CNN, ResNet-18/50, LSTM LM.

Every model is called as ``model.apply(variables, x, train=...)`` and returns float32 logits.

Conventions shared by all models
--------------------------------
* ``dtype`` is the *computation* dtype (default float32). Parameters are always created in
  float32 (``param_dtype=jnp.float32``), so mixed precision (seed 004 §2.2.2: bf16/fp16 compute,
  fp32 master weights) is ``Model(..., dtype=jnp.bfloat16)``; the final logits are cast to float32
  so that softmax / cross-entropy run in float32.
* Models with BatchNorm keep their statistics in the ``batch_stats`` collection (apply with
  ``mutable=["batch_stats"]`` in training; :func:`apply_model` does this). BN uses momentum 0.9
  and eps 1e-5 and ``use_running_average=not train``.
* ``bn_axis_name`` is passed to ``nn.BatchNorm(axis_name=...)``. ``None`` (default) gives
  per-worker statistics, the strategy of seed 004 §2.2.3 ("the mean and variance of BN are
  calculated in the batch of each GPU respectively"); a vmap/shard_map axis name (or a tuple of
  names) gives cross-worker synchronised BN. flax skips the collective while initialising, so
  :func:`init_model` works outside any named axis even when ``bn_axis_name`` is set.
* ``bn_momentum`` (default 0.9) is exposed because seed 004 §2.2.3 keeps no moving average:
  ``bn_momentum=0.0`` makes the stored statistics those of the last training batch, which a
  training loop can then all-reduce (in fp32) to obtain the population statistics.

BatchNorm statistics under bf16 (checked against flax 0.12.8 ``flax/linen/normalization.py``)
---------------------------------------------------------------------------------------------
``nn.BatchNorm(dtype=bf16, param_dtype=float32)`` with its default
``force_float32_reductions=True`` casts the input to ``promote_types(dtype, float32)`` = float32
before reducing (``_compute_stats``), so the batch mean and variance -- and the ``pmean`` over
``axis_name`` -- are float32; the running ``mean``/``var`` variables are created in float32; the
normalisation ``(x - mean) * rsqrt(var + eps) * scale + bias`` is evaluated in float32 and only
the result is cast to bf16. Two further flax facts worth knowing: the variance is the biased
(population, 1/N) variance, also in the running average (PyTorch stores the unbiased one), and
flax uses the one-pass form ``E[x^2] - E[x]^2`` (``use_fast_variance=True``, clipped at 0), which
lets synchronised BN exchange mean and second moment in one collective.

Initialisation
--------------
Convolutions use Kaiming-normal init with **fan_in**,
``nn.initializers.variance_scaling(2.0, "fan_in", "normal")`` i.e. ``N(0, 2/fan_in)`` with
``fan_in = prod(kernel_size) * in_channels``: seed 004 §2.2.3 prints ``std = sqrt(2/fan_in)``
(torchvision's ResNet uses fan_out instead; we follow the seed). Dense layers, the embedding and
the LSTM keep flax's defaults (lecun-normal kernels, zero biases, orthogonal recurrent kernels).
In every residual block the scale (gamma) of the last BN of the residual branch is initialised
to 0 (seed 004 §2.2.3, Goyal et al. 2017), so each block starts as its shortcut.

Dimension-generic convolutions
------------------------------
The CNN and the ResNets read the number of spatial dimensions from the input: ``(N, L, C)``
gets 1-D convolutions (kernel ``(3,)``), ``(N, H, W, C)`` 2-D ones (``(3, 3)``), and so on;
kernel sizes, strides, paddings and pooling windows are built as ``(k,) * num_spatial_dims``.

Seeds: 000 §4.4.2 (3-layer MLP on MNIST), §4.4.3 (LSTM LM on PTB), ResNet-50 on CIFAR-10
throughout seed 000; 004 §2.2.3 (BN strategy, Kaiming init, zero-init last BN scale).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from mfopt.models import apply_model, get_model, init_model
  >>> model = get_model("resnet18", num_classes=10, width=4)
  >>> x = jnp.zeros((2, 8, 8, 3))
  >>> params, state = init_model(model, jax.random.key(0), x)
  >>> logits, state = apply_model(model, params, state, x, train=True)
  >>> logits.shape, logits.dtype
  ((2, 10), dtype('float32'))
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mfopt import _checks

__all__ = [
    "BN_EPSILON",
    "BN_MOMENTUM",
    "MLP",
    "CNN",
    "BasicBlock",
    "BottleneckBlock",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "LSTMLM",
    "MODELS",
    "get_model",
    "init_model",
    "apply_model",
    "conv_kernel_init",
    "CONV_IMPLS",
    "gemm_conv_general_dilated",
    "GroupBatchNorm",
    "group_batch_norm",
    "BN_IMPLS",
]

BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5

#: Kaiming-normal with fan_in, N(0, 2 / (prod(kernel_size) * in_channels)) (seed 004 §2.2.3).
conv_kernel_init = nn.initializers.variance_scaling(2.0, "fan_in", "normal")

#: How CNN / ResNet convolutions are computed: ``"xla"`` (``lax.conv_general_dilated``) or
#: ``"gemm"`` (:func:`gemm_conv_general_dilated`). Same parameters, same function.
CONV_IMPLS = ("xla", "gemm")

#: How CNN / ResNet BatchNorms are computed: ``"flax"`` (``nn.BatchNorm``, the default) or
#: ``"mfopt"`` (:class:`GroupBatchNorm` with one group: the same parameters, statistics and
#: function, with a hand-written backward pass; reverse mode only, so ``jax.jvp`` / ``jacfwd``
#: need ``"flax"``).
BN_IMPLS = ("flax", "mfopt")


def gemm_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                              rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                              precision=None, preferred_element_type=None):
  """``lax.conv_general_dilated`` computed as patches times a matrix (im2col + one matmul).

  Why: under ``jax.vmap`` over *per-worker weights* (the virtual workers of a local
  algorithm), XLA lowers a convolution to a grouped convolution, which GPU libraries run far
  below their dense speed at many groups (issue 8, target 4). Here the weights only enter a
  ``dot_general``, whose ``vmap`` is a *batched GEMM*, while the patch extraction (strided
  slices, :func:`_patches`) involves no weights and folds the worker axis into its batch. The
  cost is memory: the patches are ``prod(kernel)`` times the input (kept for the backward
  pass). 1x1 kernels skip the patches (a strided slice is enough). Measured on CPU
  (BENCHMARKS.md, target 4): slower than ``vmap``'s grouped convolutions at 4-8 workers per
  device, the fastest lowering at 32. Measured on an H100 (session 6, ResNet-18 CIFAR, bf16):
  never the best, 0.21-0.29x one replica against ``vmap``'s 0.35-0.41x at every shape tried,
  so on GPUs it does not pay; ``lowering="auto"`` times it and picks something else there.

  Accepts flax ``nn.Conv``'s call (channels-last input, kernel ``(*spatial, in, out)``) and
  falls back to ``lax.conv_general_dilated`` for anything else (feature groups, input
  dilation, other layouts). Equal to it up to float rounding (``tests/test_models.py``).
  """
  nd = rhs.ndim - 2
  lhs_dilated = lhs_dilation is not None and any(d != 1 for d in lhs_dilation)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  flax_layout = (dn.lhs_spec == (0, nd + 1, *range(1, nd + 1)) and dn.out_spec == dn.lhs_spec
                 and dn.rhs_spec == (nd + 1, nd, *range(nd)))
  if feature_group_count != 1 or lhs_dilated or not flax_layout:
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation,
                                    rhs_dilation, dimension_numbers, feature_group_count,
                                    precision=precision,
                                    preferred_element_type=preferred_element_type)
  kernel = rhs.shape[:nd]
  in_features, out_features = rhs.shape[nd], rhs.shape[nd + 1]
  unpadded = padding == "VALID" or (not isinstance(padding, str)
                                    and all(tuple(p) == (0, 0) for p in padding))
  if all(k == 1 for k in kernel) and (unpadded or padding == "SAME"):
    index = (slice(None),) + tuple(slice(None, None, s) for s in window_strides) + (slice(None),)
    patches = lhs[index]  # a 1x1 kernel sees one pixel; "SAME" pads nothing for it
  else:
    patches = _patches(lhs, kernel, window_strides, padding,
                       rhs_dilation if rhs_dilation is not None else (1,) * nd)
  # patch features are ordered (in_features, *kernel): the kernel matrix matches that order
  matrix = jnp.moveaxis(rhs, nd, 0).reshape(in_features * math.prod(kernel), out_features)
  # The barrier keeps XLA:GPU from fusing the patch extraction into a Triton GEMM: in the
  # XLA of JAX 0.10.2 that fusion aborts the process (CHECK failure in
  # triton_tiling_propagation.cc, "subdim_size_accumulator == dim_size") for every ResNet-18
  # step of this lowering tried for an H100 (deviceless compilation,
  # experiments/bench_gpu_hlo.py). The patches are a residual of the backward pass either
  # way; on XLA:CPU the compiled step's cost estimate is identical with and without it.
  patches = lax.optimization_barrier(patches)
  return lax.dot_general(patches, matrix.astype(patches.dtype),
                         (((patches.ndim - 1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=preferred_element_type)


def _patches(x, kernel, strides, padding, dilation):
  """im2col by ``prod(kernel)`` strided slices of the padded input, features ordered
  ``(in_features, *kernel)`` as ``lax.conv_general_dilated_patches`` orders them.

  ``conv_general_dilated_patches`` computes the same with a convolution by one-hot filters
  (``in_features`` groups), which is itself a grouped convolution; slices are plain copies and
  their gradient a padded sum."""
  nd = len(kernel)
  dilated = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
  pads = (lax.padtype_to_pads(x.shape[1:nd + 1], dilated, strides, padding)
          if isinstance(padding, str) else [tuple(p) for p in padding])
  x = jnp.pad(x, [(0, 0)] + list(pads) + [(0, 0)])
  out = [(x.shape[1 + i] - dilated[i]) // strides[i] + 1 for i in range(nd)]
  cols = []
  for offset in itertools.product(*(range(k) for k in kernel)):
    start = [o * d for o, d in zip(offset, dilation)]
    limit = [s + (n - 1) * st + 1 for s, n, st in zip(start, out, strides)]
    cols.append(lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]),
                          (1, *strides, 1)))
  return jnp.stack(cols, axis=-1).reshape(x.shape[0], *out, x.shape[-1] * len(cols))


def _conv_fn(owner: str, impl: str):
  if impl not in CONV_IMPLS:
    raise ValueError(f"{owner}: conv_impl must be one of {CONV_IMPLS}, got {impl!r}")
  return gemm_conv_general_dilated if impl == "gemm" else None

Dtype = Any
ModuleDef = Any
AxisName = str | tuple[str, ...] | None


# ----------------------------------------------------------------------------- validation


def _check_positive_ints(owner: str, field: str, values: Any, allow_empty: bool) -> None:
  if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
    raise ValueError(f"{owner}: {field} must be a sequence of positive integers, got {values!r}")
  if not allow_empty and len(values) == 0:
    raise ValueError(f"{owner}: {field} must not be empty, got {values!r}")
  for v in values:
    if not _checks.is_int(v) or v <= 0:
      raise ValueError(f"{owner}: {field} must contain positive integers, got {values!r}")


def _check_float_dtype(owner: str, dtype: Any) -> None:
  try:
    ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{owner}: dtype must be a floating dtype, got {dtype!r}")


def _check_bn(owner: str, momentum: Any, axis_name: Any, groups: Any = 1,
              impl: Any = "flax") -> None:
  if not (_checks.is_real(momentum) and 0.0 <= momentum < 1.0):  # (np.float32 too; no bool)
    raise ValueError(f"{owner}: bn_momentum must be in [0, 1), got {momentum!r}")
  _checks.positive_int("bn_groups", groups, owner=owner)
  if groups > 1 and axis_name is not None:
    raise ValueError(f"{owner}: bn_groups={groups} (statistics per group of the batch) and "
                     f"bn_axis_name={axis_name!r} (statistics over all workers) exclude each "
                     "other")
  if impl not in BN_IMPLS:
    raise ValueError(f"{owner}: bn_impl must be one of {BN_IMPLS}, got {impl!r}")
  if impl == "mfopt" and axis_name is not None:
    raise ValueError(f"{owner}: bn_impl='mfopt' has no synchronised BN; got "
                     f"bn_axis_name={axis_name!r} (use bn_impl='flax')")
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is not None and not all(isinstance(n, str) and n for n in names):
    raise ValueError(
        f"{owner}: bn_axis_name must be None, a str or a tuple of str, got {axis_name!r}")


def _num_spatial_dims(owner: str, x: jax.Array) -> int:
  """Spatial rank of a channels-last batch ``(N, *spatial, C)``; at least 1."""
  if x.ndim < 3:
    raise ValueError(
        f"{owner}: input must be (N, L, C), (N, H, W, C), ... (channels last), got shape "
        f"{tuple(x.shape)}")
  return x.ndim - 2


def _batch_norm(train: bool, momentum: float, axis_name: AxisName, dtype: Dtype,
                groups: int = 1, impl: str = "flax") -> ModuleDef:
  """The one BatchNorm configuration used by every model here (see module docstring):
  flax's ``nn.BatchNorm``, or :class:`GroupBatchNorm` with ``groups > 1`` or
  ``impl="mfopt"``."""
  if groups > 1 or impl == "mfopt":
    return functools.partial(GroupBatchNorm, groups=groups, use_running_average=not train,
                             momentum=momentum, epsilon=BN_EPSILON, dtype=dtype)
  return functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=momentum,
      epsilon=BN_EPSILON,
      dtype=dtype,
      param_dtype=jnp.float32,
      axis_name=axis_name,
  )


def _global_avg_pool(x: jax.Array) -> jax.Array:
  return jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))


# ----------------------------------------------------------------------------- grouped BatchNorm


def _per_example(v: jax.Array, like: jax.Array) -> jax.Array:
  """``(groups, C)`` -> ``(N, 1, ..., 1, C)``: each group's row for its examples, broadcastable
  against ``like`` (``(N, *spatial, C)``)."""
  groups, c = v.shape
  n = like.shape[0]
  rows = jnp.broadcast_to(v[:, None, :], (groups, n // groups, c)).reshape(n, c)
  return rows.reshape((n,) + (1,) * (like.ndim - 2) + (c,))


def _group_sums(a: jax.Array, b: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
  """Sums ``(groups, C)`` of two float32 ``(N, *spatial, C)`` arrays over each group's
  examples and positions, as ONE variadic reduction of their ``(groups, -1, C)`` views: XLA
  then reads both in one kernel and writes only the sums (two separate sums let XLA:GPU
  materialise a float32 product for the second one)."""
  c = a.shape[-1]
  zero = jnp.zeros((), jnp.float32)
  return lax.reduce((a.reshape(groups, -1, c), b.reshape(groups, -1, c)), (zero, zero),
                    lambda u, v: (u[0] + v[0], u[1] + v[1]), (1,))


def _group_stats(x: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
  """Per-group mean and biased variance ``(groups, C)`` of ``x`` in float32 (flax's one-pass
  ``E[x^2] - E[x]^2``, clipped at 0)."""
  xf = x.astype(jnp.float32)
  s1, s2 = _group_sums(xf, jnp.square(xf), groups)
  count = x.size // x.shape[-1] // groups
  mean = s1 / count
  return mean, jnp.maximum(s2 / count - jnp.square(mean), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def group_batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float,
                     groups: int, out_dtype: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""Training-mode BatchNorm with statistics per group of ``N / groups`` consecutive examples.

  ``y[n] = (x[n] - mean_g) * rsqrt(var_g + epsilon) * scale + bias`` for the group ``g`` of
  example ``n``, computed in float32 and returned in ``out_dtype`` (default ``x.dtype``);
  also returns the per-group
  ``mean`` and ``var`` ``(groups, C)`` (for running averages: not differentiated, their
  cotangents are ignored). ``x`` is ``(N, *spatial, C)``, ``scale``/``bias`` ``(C,)``.

  Why a hand-written VJP (``jax.custom_vjp``): this is what makes W synchronous virtual workers
  cost one replica (issue 8, target 4a; :mod:`mfopt.fastpath`). The same statistics taken by
  ``jax.vmap`` of flax's BatchNorm over a ``(G, N/G, ...)`` view leave XLA with 5-D
  tensors and autodiff's several reductions per layer, and XLA:GPU then writes extra
  activation-sized tensors (some in float32): in the deviceless H100 compile of ResNet-18 at
  16 x 64, 7,054 MB per step against 6,391 MB for one replica with flax's BN. Here every
  elementwise tensor stays ``(N, *spatial, C)``, the two sums a pass needs are one variadic
  reduction of a ``(G, -1, C)`` view, and the backward pass is the closed form

  .. math::
     \partial x = s\,r \Big(\partial y - \frac{\sum_g \partial y}{m}
                 - \hat x \frac{\sum_g \partial y\,\hat x}{m}\Big), \quad
     \partial s = \sum_g \sum \partial y\,\hat x, \quad \partial b = \sum_g \sum \partial y

  (``r = rsqrt(var_g + eps)``, ``\hat x = (x - mean_g) r``, ``m = N/G x spatial size``).
  The fast path then writes 6,060 MB and launches 364 kernels per step (one replica with
  flax's BN: 6,391 MB, 398; ``python -m experiments.bench_gpu_hlo --workers 16 --batch 64``,
  a traffic model of the compiled program, not a timing). ``tests/test_models.py`` checks
  values and gradients against flax's BatchNorm applied group by group.
  """
  return _gbn_fwd(x, scale, bias, epsilon, groups, out_dtype)[0]


def _gbn_fwd(x, scale, bias, epsilon, groups, out_dtype=None):
  mean, var = _group_stats(x, groups)
  rstd = lax.rsqrt(var + epsilon)
  y = ((x.astype(jnp.float32) - _per_example(mean, x)) * _per_example(rstd * scale, x)
       + bias).astype(out_dtype or x.dtype)
  return (y, mean, var), (x, mean, rstd, scale)


def _gbn_bwd(epsilon, groups, out_dtype, res, cotangents):
  del epsilon, out_dtype
  x, mean, rstd, scale = res
  dy = cotangents[0].astype(jnp.float32)
  centered = x.astype(jnp.float32) - _per_example(mean, x)
  dbias, s_dyc = _group_sums(dy, dy * centered, groups)  # sums of dy, dy * (x - mean)
  count = x.size // x.shape[-1] // groups
  dscale = rstd * s_dyc                                   # sum of dy * xhat per group
  dx = _per_example(scale * rstd, x) * (
      dy - _per_example(dbias / count, x)
      - centered * _per_example(rstd * dscale / count, x))
  return dx.astype(x.dtype), dscale.sum(0), dbias.sum(0)


group_batch_norm.defvjp(_gbn_fwd, _gbn_bwd)


class GroupBatchNorm(nn.Module):
  """BatchNorm with statistics per group of ``N / groups`` consecutive examples of the batch.

  The model of ``groups`` workers with per-worker BN run as one replica on their concatenated
  batch (:mod:`mfopt.fastpath`): same parameters as ``nn.BatchNorm`` (``scale``, ``bias``
  ``(C,)``, float32), running statistics per group (``batch_stats`` ``mean``/``var`` of shape
  ``(groups, C)``, i.e. the worker-stacked statistics of ``groups`` flax BatchNorms), and
  flax's arithmetic (float32 statistics, biased one-pass variance, momentum average). In
  evaluation mode each group is normalised with its own running statistics. Training mode
  runs :func:`group_batch_norm`. Models build it through ``bn_groups`` (CNN, ResNets).

  With ``groups=1`` the statistics are ``(C,)``, flax's layout, so it is a drop-in for
  ``nn.BatchNorm`` with a hand-written backward pass (models: ``bn_impl="mfopt"``) in reverse
  mode (``jax.grad``; Hessian-vector products as ``jax.jvp`` of ``jax.grad`` work too); forward
  mode through the layer itself (``jax.jvp``, ``jax.jacfwd`` of the loss) is not defined, as for any
  ``jax.custom_vjp``: use flax's BatchNorm (``bn_impl="flax"``, ``bn_groups=1``). Dtypes as
  flax's: the statistics come from the input as given (in float32), and the output is in
  ``dtype``, or without one in the promotion of the input and ``param_dtype`` (a bf16 input
  with float32 parameters gives float32).
  """

  groups: int
  use_running_average: bool = False
  momentum: float = BN_MOMENTUM
  epsilon: float = BN_EPSILON
  dtype: Dtype = None
  param_dtype: Dtype = jnp.float32
  scale_init: Callable[..., jax.Array] = nn.initializers.ones
  bias_init: Callable[..., jax.Array] = nn.initializers.zeros

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if not _checks.is_int(self.groups) or self.groups < 1:  # (0: ZeroDivisionError)
      raise ValueError(f"GroupBatchNorm: groups must be a positive integer, got {self.groups!r}")
    if x.ndim < 2 or x.shape[0] % self.groups:
      raise ValueError(f"GroupBatchNorm: the batch (first) dimension must be a multiple of "
                       f"groups={self.groups}, got input shape {tuple(x.shape)}")
    c = x.shape[-1]
    scale = self.param("scale", self.scale_init, (c,), self.param_dtype)
    bias = self.param("bias", self.bias_init, (c,), self.param_dtype)
    shape = (self.groups, c) if self.groups > 1 else (c,)  # one group: flax's layout
    ra_mean = self.variable("batch_stats", "mean", jnp.zeros, shape, jnp.float32)
    ra_var = self.variable("batch_stats", "var", jnp.ones, shape, jnp.float32)
    out_dtype = jnp.dtype(self.dtype or jnp.promote_types(x.dtype, self.param_dtype))
    if self.use_running_average:
      mean, var = (v.reshape(self.groups, c) for v in (ra_mean.value, ra_var.value))
      y = ((x.astype(jnp.float32) - _per_example(mean, x))
           * _per_example(lax.rsqrt(var + self.epsilon) * scale, x) + bias)
      return y.astype(out_dtype)
    y, mean, var = group_batch_norm(x, scale, bias, self.epsilon, self.groups, out_dtype)
    if not self.is_initializing():
      m = self.momentum
      ra_mean.value = m * ra_mean.value + (1 - m) * lax.stop_gradient(mean).reshape(shape)
      ra_var.value = m * ra_var.value + (1 - m) * lax.stop_gradient(var).reshape(shape)
    return y


# ----------------------------------------------------------------------------- MLP


class MLP(nn.Module):
  """Multilayer perceptron: flatten, ``len(hidden)`` Dense+ReLU layers, Dense logits.

  With the default two hidden layers it is the 3-layer MLP of seed 000 §4.4.2 ("three fully
  connected layers, two activation layers and a softmax layer"; the softmax lives in the loss).

  Attributes:
    hidden: widths of the hidden layers.
    num_classes: number of output logits.
    dtype: computation dtype; parameters are float32, logits are cast to float32.
  """

  hidden: Sequence[int] = (256, 256)
  num_classes: int = 10
  dtype: Dtype = jnp.float32

  def __post_init__(self):
    _check_positive_ints("MLP", "hidden", self.hidden, allow_empty=True)
    _checks.positive_int("num_classes", self.num_classes, owner="MLP")
    _check_float_dtype("MLP", self.dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train  # no train-dependent layers
    x = x.reshape((x.shape[0], -1))
    for i, width in enumerate(self.hidden):
      x = nn.Dense(width, dtype=self.dtype, param_dtype=jnp.float32, name=f"dense{i}")(x)
      x = nn.relu(x)
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return x.astype(jnp.float32)


# ----------------------------------------------------------------------------- CNN


class CNN(nn.Module):
  """Small conv net: [conv3 -> BN -> ReLU -> max-pool 2] per entry of ``features``, GAP, Dense.

  Convolution rank follows the input: ``(N, L, C)`` -> 1-D, ``(N, H, W, C)`` -> 2-D. Pooling uses
  "SAME" padding so any spatial size works (a size-1 axis stays size 1).

  Attributes:
    features: output channels of each conv block.
    num_classes: number of output logits.
    use_bn: BatchNorm after each conv (the conv then has no bias).
    dtype: computation dtype.
    bn_axis_name: ``None`` for per-worker BN statistics, an axis name for synchronised BN.
    bn_momentum: BN running-average momentum.
    conv_impl: ``"xla"`` or ``"gemm"`` (:data:`CONV_IMPLS`; same parameters and function).
    bn_groups: BN statistics per group of ``N / bn_groups`` consecutive examples
      (:class:`GroupBatchNorm`, running statistics ``(bn_groups, C)``); 1: one group.
    bn_impl: with one group, ``"flax"`` (``nn.BatchNorm``) or ``"mfopt"``
      (:class:`GroupBatchNorm`: the same variables and function, a hand-written backward
      pass; :data:`BN_IMPLS`).
  """

  features: Sequence[int] = (32, 64)
  num_classes: int = 10
  use_bn: bool = True
  dtype: Dtype = jnp.float32
  bn_axis_name: AxisName = None
  bn_momentum: float = BN_MOMENTUM
  conv_impl: str = "xla"
  bn_groups: int = 1
  bn_impl: str = "flax"

  def __post_init__(self):
    _check_positive_ints("CNN", "features", self.features, allow_empty=False)
    _checks.positive_int("num_classes", self.num_classes, owner="CNN")
    _check_float_dtype("CNN", self.dtype)
    _check_bn("CNN", self.bn_momentum, self.bn_axis_name, self.bn_groups, self.bn_impl)
    _conv_fn("CNN", self.conv_impl)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    nd = _num_spatial_dims("CNN", x)
    norm = _batch_norm(train, self.bn_momentum, self.bn_axis_name, self.dtype, self.bn_groups,
                       self.bn_impl)
    for i, f in enumerate(self.features):
      x = nn.Conv(f, (3,) * nd, padding="SAME", use_bias=not self.use_bn,
                  kernel_init=conv_kernel_init, dtype=self.dtype, param_dtype=jnp.float32,
                  conv_general_dilated=_conv_fn("CNN", self.conv_impl), name=f"conv{i}")(x)
      if self.use_bn:
        x = norm(name=f"bn{i}")(x)
      x = nn.relu(x)
      x = nn.max_pool(x, (2,) * nd, strides=(2,) * nd, padding="SAME")
    x = _global_avg_pool(x)
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return x.astype(jnp.float32)


# ----------------------------------------------------------------------------- ResNets


class BasicBlock(nn.Module):
  """ResNet basic block: conv3-BN-ReLU-conv3-BN (+ shortcut), ReLU. ``bn2`` scale starts at 0.

  The shortcut is the identity, or a 1x1 conv (stride ``strides``) + BN when the shape changes.
  """

  features: int
  strides: int
  conv: ModuleDef
  norm: ModuleDef

  expansion = 1  # output channels = features * expansion

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    nd = x.ndim - 2
    out_features = self.features * self.expansion
    y = self.conv(self.features, (3,) * nd, (self.strides,) * nd, padding=[(1, 1)] * nd,
                  name="conv1")(x)
    y = nn.relu(self.norm(name="bn1")(y))
    y = self.conv(self.features, (3,) * nd, padding=[(1, 1)] * nd, name="conv2")(y)
    y = self.norm(scale_init=nn.initializers.zeros, name="bn2")(y)
    return nn.relu(y + _shortcut(self, x, out_features, nd))


class BottleneckBlock(nn.Module):
  """ResNet bottleneck (v1.5, stride on the 3x3 conv as torchvision): 1x1-3x3-1x1, x4 channels.

  conv1x1-BN-ReLU-conv3-BN-ReLU-conv1x1(4*features)-BN (+ shortcut), ReLU. ``bn3`` scale starts
  at 0. The shortcut is a 1x1 conv + BN when stride or channel count changes.
  """

  features: int
  strides: int
  conv: ModuleDef
  norm: ModuleDef

  expansion = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    nd = x.ndim - 2
    out_features = self.features * self.expansion
    y = self.conv(self.features, (1,) * nd, name="conv1")(x)
    y = nn.relu(self.norm(name="bn1")(y))
    y = self.conv(self.features, (3,) * nd, (self.strides,) * nd, padding=[(1, 1)] * nd,
                  name="conv2")(y)
    y = nn.relu(self.norm(name="bn2")(y))
    y = self.conv(out_features, (1,) * nd, name="conv3")(y)
    y = self.norm(scale_init=nn.initializers.zeros, name="bn3")(y)
    return nn.relu(y + _shortcut(self, x, out_features, nd))


def _shortcut(block: nn.Module, x: jax.Array, out_features: int, nd: int) -> jax.Array:
  """Identity, or projection (1x1 conv with the block's stride + BN) when the shape changes."""
  if block.strides == 1 and x.shape[-1] == out_features:
    return x
  x = block.conv(out_features, (1,) * nd, (block.strides,) * nd, name="proj_conv")(x)
  return block.norm(name="proj_bn")(x)


class ResNet(nn.Module):
  """ResNet v1.5 for channels-last inputs of any spatial rank; see :class:`ResNet18`/``50``.

  Stage ``i`` has ``stage_sizes[i]`` blocks of ``width * 2**i`` features (times the block's
  expansion); the first block of every stage but the first has stride 2.

  Attributes:
    stage_sizes: number of blocks per stage.
    block_cls: :class:`BasicBlock` or :class:`BottleneckBlock`.
    stem: ``"cifar"`` (3x3 stride-1 conv, no pooling) or ``"imagenet"`` (7x7 stride-2 conv +
      3x3 stride-2 max-pool).
    num_classes: number of output logits.
    width: channels of the stem and the first stage (64 in the papers; small for tests).
    dtype: computation dtype.
    bn_axis_name: ``None`` for per-worker BN statistics, an axis name for synchronised BN.
    bn_momentum: BN running-average momentum.
    conv_impl: ``"xla"`` or ``"gemm"`` (:data:`CONV_IMPLS`; same parameters and function).
    bn_groups: BN statistics per group of ``N / bn_groups`` consecutive examples
      (:class:`GroupBatchNorm`, running statistics ``(bn_groups, C)``); 1: one group.
    bn_impl: with one group, ``"flax"`` (``nn.BatchNorm``) or ``"mfopt"``
      (:class:`GroupBatchNorm`: the same variables and function, a hand-written backward
      pass; :data:`BN_IMPLS`).
  """

  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  block_cls: ModuleDef = BasicBlock
  stem: str = "cifar"
  num_classes: int = 10
  width: int = 64
  dtype: Dtype = jnp.float32
  bn_axis_name: AxisName = None
  bn_momentum: float = BN_MOMENTUM
  conv_impl: str = "xla"
  bn_groups: int = 1
  bn_impl: str = "flax"

  def __post_init__(self):
    owner = type(self).__name__
    _check_positive_ints(owner, "stage_sizes", self.stage_sizes, allow_empty=False)
    if self.block_cls not in (BasicBlock, BottleneckBlock):
      raise ValueError(f"{owner}: block_cls must be BasicBlock or BottleneckBlock, got "
                       f"{self.block_cls!r}")
    if self.stem not in ("cifar", "imagenet"):
      raise ValueError(f"{owner}: stem must be 'cifar' or 'imagenet', got {self.stem!r}")
    _checks.positive_int("num_classes", self.num_classes, owner=owner)
    _checks.positive_int("width", self.width, owner=owner)
    _check_float_dtype(owner, self.dtype)
    _check_bn(owner, self.bn_momentum, self.bn_axis_name, self.bn_groups, self.bn_impl)
    _conv_fn(owner, self.conv_impl)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    nd = _num_spatial_dims(type(self).__name__, x)
    conv = functools.partial(nn.Conv, use_bias=False, kernel_init=conv_kernel_init,
                             dtype=self.dtype, param_dtype=jnp.float32,
                             conv_general_dilated=_conv_fn(type(self).__name__, self.conv_impl))
    norm = _batch_norm(train, self.bn_momentum, self.bn_axis_name, self.dtype, self.bn_groups,
                       self.bn_impl)

    if self.stem == "imagenet":
      x = conv(self.width, (7,) * nd, (2,) * nd, padding=[(3, 3)] * nd, name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))
      x = nn.max_pool(x, (3,) * nd, strides=(2,) * nd, padding=[(1, 1)] * nd)
    else:
      x = conv(self.width, (3,) * nd, padding=[(1, 1)] * nd, name="stem_conv")(x)
      x = nn.relu(norm(name="stem_bn")(x))

    for i, num_blocks in enumerate(self.stage_sizes):
      for j in range(num_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = self.block_cls(self.width * 2**i, strides, conv=conv, norm=norm,
                           name=f"stage{i + 1}_block{j}")(x)
    x = _global_avg_pool(x)
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return x.astype(jnp.float32)


class ResNet18(ResNet):
  """ResNet-18, CIFAR variant: 3x3/1 stem, no max-pool, BasicBlocks [2, 2, 2, 2].

  >>> from mfopt.models import ResNet18
  >>> ResNet18(num_classes=10, width=8)  # tiny variant for tests  # doctest: +ELLIPSIS
  ResNet18(...)
  """

  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  block_cls: ModuleDef = BasicBlock
  stem: str = "cifar"


class ResNet50(ResNet):
  """ResNet-50, ImageNet variant: 7x7/2 stem + 3x3/2 max-pool, Bottlenecks [3, 4, 6, 3]."""

  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  block_cls: ModuleDef = BottleneckBlock
  stem: str = "imagenet"


# ----------------------------------------------------------------------------- LSTM LM


class LSTMLM(nn.Module):
  """LSTM language model (seed 000 §4.4.3): embedding -> stacked LSTM -> Dense over the vocab.

  Input int tokens ``(N, L)``; output logits ``(N, L, vocab_size)`` where position ``t`` depends
  only on tokens ``<= t`` (unidirectional, scan-based ``nn.RNN(nn.OptimizedLSTMCell)``). No
  dropout (the seed gives none), so ``train`` is accepted and ignored. The LSTM carry is float32
  (flax creates it in ``param_dtype``); gate matmuls run in ``dtype``.

  Attributes:
    vocab_size: vocabulary size (embedding rows and output logits).
    embed_dim: embedding width.
    hidden: LSTM hidden size (all layers).
    num_layers: number of stacked LSTM layers.
    dtype: computation dtype.
  """

  vocab_size: int
  embed_dim: int = 128
  hidden: int = 256
  num_layers: int = 2
  dtype: Dtype = jnp.float32

  def __post_init__(self):
    for field in ("vocab_size", "embed_dim", "hidden", "num_layers"):
      _checks.positive_int(field, getattr(self, field), owner="LSTMLM")
    _check_float_dtype("LSTMLM", self.dtype)
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
    del train
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"LSTMLM: tokens must be integer (N, L), got {tokens.dtype}"
                       f"{list(tokens.shape)}")
    x = nn.Embed(self.vocab_size, self.embed_dim, dtype=self.dtype, param_dtype=jnp.float32,
                 name="embed")(tokens)
    for i in range(self.num_layers):
      cell = nn.OptimizedLSTMCell(self.hidden, dtype=self.dtype, param_dtype=jnp.float32)
      x = nn.RNN(cell, name=f"lstm{i}")(x)
    x = nn.Dense(self.vocab_size, dtype=self.dtype, param_dtype=jnp.float32, name="head")(x)
    return x.astype(jnp.float32)


# ----------------------------------------------------------------------------- registry/helpers

#: name -> model class; :func:`get_model` forwards its keyword arguments to the constructor.
#: :func:`register` adds to it.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "resnet18": ResNet18,
    "resnet50": ResNet50,
    "lstm_lm": LSTMLM,
}
#: The built-in models that classify (logits per example); ``lstm_lm`` predicts tokens.
#: :func:`classifiers` adds the ones registered since.
CLASSIFIERS = tuple(n for n in MODELS if n != "lstm_lm")
_REGISTERED_CLASSIFIERS: list[str] = []


def register(name: str, builder: Callable[..., nn.Module], *, classifier: bool = True) -> None:
  """Adds a model of your own under ``name``: ``builder(num_classes=..., **kwargs)`` returns
  a flax module (its class, or a function). A classifier (logits per example) can then be
  named where the experiments take a model (``model=``, ``models=``, ``pairs=``), which get
  the names from :func:`classifiers` when they check a config; they pass it
  ``num_classes`` only (the built-in models' own settings, an MLP's widths or a CNN's BN
  strategy, go to those). The seed-004 experiments also set its compute dtype, so there it
  needs a ``dtype`` field used by its layers (they refuse a model without one).
  ``python -m experiments --import yourmodule`` runs your module (and so its ``register``
  calls) before the config is checked.

  Raises:
    ValueError: ``name`` is taken or not a non-empty string, or ``builder`` is not callable.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"name must be a non-empty string, got {name!r}")
  if name in MODELS:
    raise ValueError(f"model name {name!r} is taken; known models: {sorted(MODELS)}")
  if not callable(builder):
    raise ValueError(f"builder must be callable (a flax module class or a function), "
                     f"got {builder!r}")
  MODELS[name] = builder
  if classifier:
    _REGISTERED_CLASSIFIERS.append(name)


def classifiers() -> tuple[str, ...]:
  """The classifier names: the built-in :data:`CLASSIFIERS` and those :func:`register` added."""
  return CLASSIFIERS + tuple(_REGISTERED_CLASSIFIERS)


def get_model(name: str, **kwargs: Any) -> nn.Module:
  """Builds the model registered under ``name`` with ``kwargs``.

  Args:
    name: one of ``MODELS`` ("mlp", "cnn", "resnet18", "resnet50", "lstm_lm").
    **kwargs: constructor arguments (e.g. ``num_classes``, ``dtype``, ``bn_axis_name``).

  Returns:
    The (unbound) flax module.

  Raises:
    ValueError: unknown ``name`` (the message lists the known names) or invalid arguments.

  >>> from mfopt.models import get_model
  >>> get_model("mlp", hidden=(32,), num_classes=3)
  MLP(
      # attributes
      hidden = (32,)
      num_classes = 3
      dtype = float32
  )
  """
  try:
    cls = MODELS[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown model {name!r}; known models: {sorted(MODELS)}") from None
  return cls(**kwargs)


def init_model(model: nn.Module, rng: jax.Array, example_x: jax.Array
               ) -> tuple[Any, dict[str, Any]]:
  """Initialises ``model`` on ``example_x``.

  Args:
    model: a module from this file (any module with ``__call__(x, train)``).
    rng: PRNG key.
    example_x: an example batch (only its shape and dtype matter).

  Returns:
    ``(params, model_state)``: the ``params`` collection and a dict of every other collection
    (``{"batch_stats": ...}`` for BN models, ``{}`` otherwise).
  """
  variables = model.init(rng, example_x, train=False)
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"}
  return params, model_state


def apply_model(model: nn.Module, params: Any, model_state: Mapping[str, Any], x: jax.Array,
                train: bool) -> tuple[jax.Array, dict[str, Any]]:
  """Runs ``model``; in training the state collections (``batch_stats``) are updated.

  Pure and jit/vmap friendly; ``model`` and ``train`` must be static (Python values).

  Args:
    model: the module.
    params: the ``params`` collection.
    model_state: the non-param collections from :func:`init_model` (possibly empty).
    x: input batch.
    train: training mode (batch statistics, running averages updated) or evaluation mode
      (running averages used, state returned unchanged).

  Returns:
    ``(logits, new_model_state)``; logits are float32. ``new_model_state`` equals
    ``model_state`` (a new dict, same leaves) in evaluation mode or when the model has no state.
  """
  variables = {"params": params, **model_state}
  if train and model_state:
    logits, new_state = model.apply(variables, x, train=True, mutable=list(model_state))
    return logits, dict(new_state)
  return model.apply(variables, x, train=train), dict(model_state)
