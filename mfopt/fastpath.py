r"""Fast path for synchronous workers: one replica per device on the concatenated batch.

Why it is exact. In a synchronous algorithm (``optax.chain(sync_gradients(WORKER_AXES),
inner)``) all ``W`` worker replicas start equal and apply the same averaged gradient,
so they stay equal (a test of ``mfopt.train`` proves it). The only per-worker
quantities left are the BatchNorm statistics: with per-worker BN (``bn_axis_name=None``,
seed 004 §2.2.3) worker ``w`` normalises its ``B`` examples with *their* mean and
variance, and keeps its own running averages. Hence ``W`` virtual workers are
mathematically **one** replica run on the global batch of ``W*B`` examples in which
every BatchNorm computes its statistics per *group* of ``B`` examples (the group of
one worker), with the loss

.. math::  L(\theta) = \frac{1}{W}\sum_{w=1}^{W} \frac{1}{B}\sum_{b=1}^{B} \ell(x_{wb}; \theta),

whose gradient is exactly :math:`\frac1W\sum_w g_w`, the all-reduced gradient of
``sync_gradients``. The running BN statistics stay per worker (``W`` small vectors).

How. For mfopt's models (those with a ``bn_groups`` field: the CNN and the ResNets) the
model runs on the flat batch of ``W*B`` examples as ``model.clone(bn_groups=W)`` (``W/D``
per device with ``D`` devices): every
BatchNorm is a :class:`mfopt.models.GroupBatchNorm`, whose running statistics ``(W, C)`` are
the per-worker statistics as they are stored anyway, and whose hand-written VJP keeps every
large tensor 4-D. For any other model the per-group BatchNorm is obtained without touching
it: the model is applied under ``jax.vmap`` over the group axis with the parameters
*unbatched* (closed over) and the batch ``(W, B, ...)``. JAX's batching rule for a
convolution or matmul whose weights are unbatched folds the group axis into the batch
dimension, so that program too runs one convolution over all ``W*B`` examples -- not the
grouped convolution that ``vmap`` over per-worker *weights* produces (ARCHITECTURE.md,
"Virtual workers") -- but XLA:GPU then writes extra activation-sized tensors around the
5-D per-group reductions (deviceless H100 compile, ResNet-18 16 x 64: 7,054 MB written per
step, against 6,391 MB for one replica with flax's BN and 6,060 MB with GroupBatchNorm;
BENCHMARKS.md, "Session 7").
One gradient, one optimizer update per device instead of ``W``.

Several devices. With ``D`` devices each device runs one replica on its ``W/D``
groups, and the gradient is averaged over the ``D`` replicas by
``sync_gradients(DATA_AXIS)`` (a ``D``-way all-reduce of one gradient per device,
instead of a ``W``-way one). On one device there is no collective at all, and the
counters say so: the transform is ``sync_gradients(None)``, which counts nothing.
:func:`comm_report` labels its totals ``"fast path"``.

Layout (:class:`FastPathState`): ``params`` and ``opt_state`` carry a leading axis of
size ``D`` (one replica per device), ``model_state`` a leading worker axis ``W``
(per-worker BN statistics, as in :class:`mfopt.train.TrainState`); all are sharded
over :data:`mfopt.parallel.DATA_AXIS`. Batches are the worker-stacked
``{"x": (W, B, ...), "y": (W, B, ...)}`` of :class:`mfopt.data.WorkerBatcher`, so the
fast path is a drop-in replacement of :func:`mfopt.train.make_train_step` for
synchronous algorithms, fp16 dynamic loss scaling included (``inner`` wrapped in
:func:`mfopt.precision.dynamic_loss_scale`: the loss is scaled, and an overflowing step
keeps its parameters, optimizer state and BN statistics). :func:`to_train_state` converts back to the worker-stacked
:class:`mfopt.train.TrainState` (for evaluation, checkpoints or comparison).

Not for local algorithms (periodic averaging, block momentum): their replicas diverge,
so they need the worker-stacked step. Not for synchronised BN across workers
(``bn_axis_name`` set): a model with one BN over the whole global batch needs no group
axis at all (run it with ``W = D``).

Example:
  >>> import jax, numpy as np, optax, mfopt
  >>> from mfopt import fastpath, models
  >>> mesh = mfopt.make_mesh(jax.devices()[:1])
  >>> model = models.get_model("cnn", features=(4,), num_classes=3)
  >>> x = np.zeros((4, 2, 8, 8, 1), np.float32)  # W=4 workers x B=2 examples
  >>> batch = {"x": x, "y": np.zeros((4, 2), np.int32)}
  >>> state = fastpath.init_train_state(model, optax.sgd(0.1, momentum=0.9), x[0],
  ...                                   num_workers=4, mesh=mesh)
  >>> step = fastpath.make_train_step(model, optax.sgd(0.1, momentum=0.9), mesh=mesh,
  ...                                 num_workers=4)
  >>> state, metrics = step(state, batch)
  >>> metrics["loss"].shape, fastpath.comm_report(state)["collectives"]
  ((4,), 0)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from mfopt import _checks
from mfopt import comm as comm_lib
from mfopt import models as models_lib
from mfopt import parallel
from mfopt import precision as precision_lib
from mfopt import train as train_lib

#: How reports name runs of this step (the issue's requirement: the fast path is labelled).
LABEL = "fast path"


class FastPathState(NamedTuple):
  """State of the fast path.

  Attributes:
    params: one replica per device, leading axis ``D``.
    model_state: per-worker BN statistics, leading axis ``W``.
    opt_state: state of ``optax.chain(sync_gradients(...), inner)``, leading axis ``D``.
  """

  params: Any
  model_state: Any
  opt_state: Any


def _num_devices(mesh) -> int:
  return mesh.shape[parallel.DATA_AXIS]


def sync_transform(inner: optax.GradientTransformation, mesh,
                   comm_dtype: Any = None) -> optax.GradientTransformation:
  """``optax.chain(sync_gradients(axis), inner)`` with the collectives the fast path needs.

  ``axis`` is :data:`mfopt.parallel.DATA_AXIS` on a mesh of several devices and ``None``
  (no collective, nothing counted) on one device. The chain has the structure of the
  worker-stacked step's ``optax.chain(sync_gradients(WORKER_AXES), inner)``, so the two
  optimizer states compare leaf by leaf.
  """
  axis = parallel.DATA_AXIS if _num_devices(mesh) > 1 else None
  sync = comm_lib.sync_gradients(axis, comm_dtype)
  chained = optax.chain(sync, inner)
  inner_x = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    sync_state, inner_state = state
    _check_inner(inner_state)
    # The stacked step's exchange sits inside dynamic_loss_scale(chain(sync_gradients, ...)),
    # which hands it the loss scale, so an fp16 exchange sends scaled values; here the loss
    # scaling is inside ``inner``, so the scale is handed over from its state. (Without it
    # the fp16 exchange sent unscaled gradients: below fp16's range, 0, and training stopped
    # without an overflow on 2+ devices.)
    scale = precision_lib.loss_scale_of(inner_state)
    updates, sync_state = sync.update(
        updates, sync_state, params, **({} if scale is None else {"loss_scale": scale.scale}))
    if axis is not None and params is not None:
      # The counter reports the bytes this step exchanges: comm_dtype is given to both
      # init_train_state and make_train_step, and a state made with another one counted the
      # other dtype's bytes (236 B per step reported for a bf16 exchange of 118 B). This
      # step's own init gives the count (a trace-time constant).
      sent = sync.init(params).comm.payload_bytes
      if sent.shape == jnp.shape(sync_state.comm.payload_bytes):
        sync_state = sync_state._replace(comm=sync_state.comm._replace(payload_bytes=sent))
    updates, inner_state = inner_x.update(updates, inner_state, params, **extra_args)
    return updates, (sync_state, inner_state)

  return optax.GradientTransformationExtraArgs(chained.init, update_fn)


def _check_inner(inner_state: Any) -> None:
  """``inner`` must not communicate: the fast path makes the one exchange itself. (Given
  ``periodic_averaging`` it ran synchronous SGD and counted averaging all-reduces that never
  ran; given the reference chain it counted a second all-reduce per step.)"""
  found = comm_lib.states_of(inner_state, comm_lib.CommStats)
  if found:
    raise ValueError(
        f"fast path: inner must be a local optimizer (the fast path adds the gradient "
        f"exchange itself), got one whose state holds {len(found)} communication counter(s); "
        "pass e.g. optax.sgd(...), not a chain with sync_gradients, periodic_averaging or qsgd")


def _check_model(model) -> None:
  axis = getattr(model, "bn_axis_name", None)
  if axis is not None:
    raise ValueError(
        "fast path needs per-worker BatchNorm (bn_axis_name=None); a model with synchronised "
        f"BN over all workers is one replica already; got bn_axis_name={axis!r}")


def init_train_state(model, inner: optax.GradientTransformation, example_x, *, num_workers: int,
                     mesh, seed: int = 0, comm_dtype: Any = None) -> FastPathState:
  """The fast path's initial state: the same initial point as :func:`mfopt.train.init_train_state`.

  Args:
    model: a flax module with per-worker BN (``bn_axis_name=None``).
    inner: the optimizer applied after gradient averaging (e.g. ``optax.sgd(lr, momentum=0.9)``).
    example_x: one worker's example batch (shape and dtype only).
    num_workers: ``W``, a multiple of the device count.
    mesh: from :func:`mfopt.make_mesh`.
    seed: model initialisation seed (same model init as the worker-stacked step).
    comm_dtype: dtype of the cross-device gradient all-reduce (``None``: gradient dtype).

  Returns:
    A :class:`FastPathState` sharded over the mesh.
  """
  _check_model(model)
  per_device = parallel.local_workers(num_workers, mesh)
  params, model_state = models_lib.init_model(model, jax.random.PRNGKey(seed), example_x)
  opt_state = sync_transform(inner, mesh, comm_dtype).init(params)
  _check_inner(opt_state[1])
  rows = parallel.process_worker_slice(num_workers, mesh)
  local_workers = rows.stop - rows.start
  local_devices = local_workers // per_device
  host = jax.device_get((params, model_state, opt_state))
  return FastPathState(
      params=parallel.shard_workers(parallel.stack_workers(host[0], local_devices), mesh),
      model_state=parallel.shard_workers(parallel.stack_workers(host[1], local_workers), mesh),
      opt_state=parallel.shard_workers(parallel.stack_workers(host[2], local_devices), mesh))


def _grouped_model(model, groups: int, group_bn: bool | None):
  """``model.clone(bn_groups=groups)`` where the fast path runs the model on the flat batch,
  else ``None`` (the ``vmap``-over-groups path)."""
  group_bn = _checks.flag("group_bn", group_bn, allow_none=True)  # a bool, not 0/1
  has_field = "bn_groups" in getattr(type(model), "__dataclass_fields__", {})
  if group_bn and not has_field:
    raise ValueError(f"group_bn=True needs a model with a bn_groups field (mfopt's CNN and "
                     f"ResNets), got {type(model).__name__}")
  if group_bn is False or not has_field:
    return None
  if model.bn_groups != 1:
    raise ValueError(f"fast path: give the model with bn_groups=1 (one worker's model); the "
                     f"fast path sets the groups itself, got bn_groups={model.bn_groups}")
  return model.clone(bn_groups=groups) if groups > 1 else model


def make_train_step(model, inner: optax.GradientTransformation, *, mesh, num_workers: int,
                    loss_fn: train_lib.LossFn = train_lib.classification_loss,
                    comm_dtype: Any = None, donate: bool = True, update_in_place: bool = True,
                    group_bn: bool | None = None):
  """Jitted ``(FastPathState, batch) -> (FastPathState, metrics)``: synchronous SGD, fast.

  Equals :func:`mfopt.train.make_train_step` with
  ``optax.chain(mfopt.sync_gradients(WORKER_AXES, comm_dtype), inner)`` on the same
  worker-stacked batches (for ``inner = dynamic_loss_scale(opt)``: with
  ``dynamic_loss_scale(optax.chain(sync_gradients(WORKER_AXES, comm_dtype), opt))``, whose
  fp16 exchange is loss-scaled; the chain the other way round sends unscaled fp16 gradients)
  (see the module docstring for the proof; ``tests/test_fastpath.py``
  checks parameters, optimizer state and BN running statistics with ``allclose``), up to the
  exchange's rounding when ``comm_dtype`` is set: the stacked step rounds each worker's
  gradient to it, the fast path the ``D`` device means (on one device: nothing is exchanged,
  nothing rounded).

  Args:
    model: a flax module with per-worker BN (``bn_axis_name=None``).
    inner: the optimizer applied to the averaged gradient.
    mesh: from :func:`mfopt.make_mesh`; one replica runs per device.
    num_workers: ``W`` (BN groups), a multiple of the device count.
    loss_fn: per-worker ``(logits, labels) -> (loss, aux)``; the objective is the mean
      over workers of the per-worker losses.
    comm_dtype: dtype of the cross-device gradient all-reduce.
    donate: donate the state buffers.
    update_in_place: write the new parameters and optimizer state into the donated buffers
      (default). ``False`` restores the earlier layout, in which XLA:CPU copies each updated
      buffer into the output (fewer bytes in XLA's estimate, yet 0-5% slower on a 2-core CPU,
      equal on one core). On XLA:GPU the in-place step launches fewer kernels: 364-380
      against 366-401 over the five shapes of target 4 (deviceless H100 compilation,
      ResNet-18, GroupBatchNorm; ``benchmarks/cpu_2026-11-25/bench_gpu_hlo_aot_*.json`` and
      ``cpu_2026-11-24/bench_gpu_hlo_aot_16x256.json``). The two compute the same numbers.
    group_bn: run the model on the flat batch with :class:`mfopt.models.GroupBatchNorm`
      (``model.clone(bn_groups=W/D)``; see the module docstring). ``None`` (default): where
      the model has a ``bn_groups`` field; ``False``: the ``vmap``-over-groups path (any model;
      the two agree to float rounding, ``tests/test_fastpath.py``).

  Returns:
    The jitted step. ``batch`` is ``{"x": (W, B, ...), "y": (W, B, ...)}`` sharded over
    workers; ``metrics`` maps names to ``(W,)`` arrays (per-worker loss and ``aux``;
    ``update_norm`` is the one replica's, repeated per worker), left on device.
  """
  _check_model(model)
  groups_per_device = parallel.local_workers(num_workers, mesh)  # validates before tracing
  grouped = _grouped_model(model, groups_per_device, group_bn)
  tx = sync_transform(inner, mesh, comm_dtype)
  fuse_norm = train_lib._fuse_norm(mesh, 1)  # one replica per device

  def update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            train_lib.tree_norm(updates, fuse_norm))

  def device_step(params, model_state, opt_state, batch):
    # ``params`` and ``opt_state`` carry this device's axis (size 1). The update runs under a
    # size-1 ``vmap`` over it rather than on ``a[0]`` with ``a[None]`` put back: through the
    # slice XLA cannot alias the donated buffers and copies every updated parameter and
    # optimizer buffer into the output (42 parameter-sized copies per ResNet-18 step; 0 this
    # way, tests/test_fastpath.py). The axis is named LOCAL_AXIS, as in mfopt.train's update,
    # so transforms given ``axis_name=WORKER_AXES`` keep their conditionals unbatched.
    groups = batch["x"].shape[0]

    def loss_of(p):
      if grouped is not None:  # one replica on the flat batch, BN statistics per group
        x = batch["x"].reshape((-1,) + batch["x"].shape[2:])
        ms = model_state if groups > 1 else jax.tree.map(lambda a: a[0], model_state)
        logits, new_model_state = models_lib.apply_model(grouped, p, ms, x, train=True)
        if groups == 1:  # flax's BN (W = D): its statistics are (C,), stored as (1, C)
          new_model_state = jax.tree.map(lambda a: a[None], new_model_state)
        logits = logits.reshape((groups, -1) + logits.shape[1:])
        losses, aux = jax.vmap(loss_fn)(logits, batch["y"])
        return jnp.mean(losses), (losses, aux, new_model_state)

      def one_group(ms, x, y):  # p is closed over (unbatched): no grouped convolutions
        logits, new_ms = models_lib.apply_model(model, p, ms, x, train=True)
        loss, aux = loss_fn(logits, y)
        return loss, aux, new_ms

      losses, aux, new_model_state = jax.vmap(one_group)(model_state, batch["x"], batch["y"])
      return jnp.mean(losses), (losses, aux, new_model_state)

    dynamic_scale = precision_lib.loss_scale_of(opt_state)  # fp16: scale the loss
    if dynamic_scale is None:
      grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    else:
      grad_fn = precision_lib.scaled_value_and_grad(
          loss_of, jax.tree.map(lambda a: a[0], dynamic_scale))
    (_, (losses, aux, new_model_state)), grads = grad_fn(jax.tree.map(lambda a: a[0], params))
    if update_in_place:
      params, opt_state, norm = jax.vmap(update, axis_name=parallel.LOCAL_AXIS)(
          jax.tree.map(lambda g: g[None], grads), opt_state, params)
    else:
      params, opt_state, norm = jax.tree.map(lambda a: a[None], update(
          grads, *jax.tree.map(lambda a: a[0], (opt_state, params))))
    metrics = {"loss": losses, **aux, "update_norm": jnp.broadcast_to(norm[0], (groups,))}
    if dynamic_scale is not None:
      # overflow (decided after the all-reduce, so on every device alike): BN statistics kept
      new_model_state, extra = precision_lib.finish_step(
          jax.tree.map(lambda a: a[0], opt_state), new_model_state, model_state)
      metrics.update({k: jnp.broadcast_to(v, (groups,)) for k, v in extra.items()})
    return params, new_model_state, opt_state, metrics

  mapped = jax.shard_map(device_step, mesh=mesh, in_specs=P(parallel.DATA_AXIS),
                         out_specs=P(parallel.DATA_AXIS), check_vma=False)

  def step(state: FastPathState, batch):
    params, model_state, opt_state, metrics = mapped(
        state.params, state.model_state, state.opt_state, batch)
    return FastPathState(params, model_state, opt_state), metrics

  return jax.jit(step, donate_argnums=(0,) if donate else ())


def to_train_state(state: FastPathState, *, num_workers: int, mesh) -> train_lib.TrainState:
  """The worker-stacked :class:`mfopt.train.TrainState` the fast path stands for.

  Each device's replica (parameters and optimizer state) is repeated for its ``W/D``
  workers; BN statistics are already per worker. Use it for evaluation
  (:func:`mfopt.train.averaged_model`) or to continue with the generic step.
  """
  out = _expand_fn(mesh, parallel.local_workers(num_workers, mesh))(*state)
  return train_lib.TrainState(*out)


@functools.lru_cache(maxsize=None)
def _expand_fn(mesh, per_device: int):
  """:func:`to_train_state`'s program, one per (mesh, W/D): a fresh closure per call compiled
  again at every evaluation or checkpoint that called it."""

  def expand(params, model_state, opt_state):
    params, opt_state = jax.tree.map(
        lambda a: jnp.broadcast_to(a, (per_device,) + a.shape[1:]), (params, opt_state))
    return params, model_state, opt_state

  return jax.jit(jax.shard_map(expand, mesh=mesh, in_specs=P(parallel.DATA_AXIS),
                               out_specs=P(parallel.DATA_AXIS), check_vma=False))


def comm_report(state: FastPathState) -> dict[str, Any]:
  """Communication totals of the collectives the fast path actually ran, labelled.

  Returns:
    :func:`mfopt.comm.comm_totals` of the optimizer state (per device replica: zero on
    one device; one ``D``-way gradient all-reduce per step otherwise) plus
    ``"path": "fast path"``.
  """
  return {**comm_lib.comm_totals(state.opt_state), "path": LABEL}
