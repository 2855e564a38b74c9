"""Communication as Optax transforms, and how it is counted.

Every mfopt transform that communicates owns its collectives: it is given an
``axis_name`` (a mesh axis, a ``vmap`` axis, or a tuple of both; ``None`` means a
single worker and no communication) and calls ``lax.pmean``/``lax.all_gather`` on
it itself, the way ``optax.contrib.sam(batch_axis_name=...)`` does. The train step
never calls a collective for the algorithm.

Counting. Each communicating transform keeps one :class:`CommStats` per kind of
logical exchange in its state. ``count`` is the number of logical collectives
executed so far (a parameter exchange of a whole tree counts once, however XLA
splits or combines it into HLO ops); ``payload_bytes`` is what one worker
contributes to one such collective, in the dtype the program exchanges (SPEC.md:
"payload"). Totals are ``count * payload_bytes``, formed on the host with Python
integers, so they never overflow an int32 however long the run.
:func:`comm_totals` collects them from any optimizer state.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from mfopt import _checks

AxisName = str | tuple[str, ...] | None


class CollectiveKind(enum.IntEnum):
  """The collective a :class:`CommStats` counts; decides the cost model's wire bytes."""

  ALL_REDUCE = 0
  ALL_GATHER = 1


class CommStats(NamedTuple):
  """Counter of one kind of logical exchange, carried in a transform's state.

  Attributes:
    count: int32 scalar, logical collectives executed so far.
    payload_bytes: int32 scalar, bytes one worker contributes to one such
      collective (constant over a run; held as a leaf so it lives with the state).
      A payload of 2**31 bytes or more (about 540M float32 parameters) is an int32
      pair ``divmod(bytes, 2**30)``; read it with :func:`payload_of`.
    kind: int32 scalar, a :class:`CollectiveKind`.
  """

  count: jax.Array
  payload_bytes: jax.Array
  kind: jax.Array



_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32",
                  "f32": "float32"}


def check_axis_name(axis_name: Any, *, name: str = "axis_name") -> AxisName:
  """``axis_name`` if it is ``None``, a string or a non-empty tuple/list of strings (as a
  tuple), else ``ValueError`` naming it: caught where the transform is built, not inside the
  first traced update."""
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if (isinstance(axis_name, (tuple, list)) and axis_name
      and all(isinstance(a, str) for a in axis_name)):
    if len(set(axis_name)) < len(axis_name):  # (psum failed inside the trace; qsgd gathered twice)
      raise ValueError(f"{name} names an axis twice: {axis_name!r}")
    return tuple(axis_name)
  raise ValueError(f"{name} must be None (one worker), an axis name (str) or a tuple of axis "
                   f"names, e.g. mfopt.WORKER_AXES; got {axis_name!r}")


def comm_dtype_of(comm_dtype: Any) -> jnp.dtype | None:
  """``comm_dtype`` as a floating ``jnp.dtype`` (``None`` stays ``None``); accepts dtypes, their
  names and the policy names ``"bf16"``/``"fp16"``/``"fp32"``; else ``ValueError`` naming it.
  JAX's canonical dtype: ``float64`` without ``jax_enable_x64`` is ``float32`` (what is sent and
  counted)."""
  if comm_dtype is None:
    return None
  try:
    dtype = jnp.dtype(_DTYPE_ALIASES.get(comm_dtype, comm_dtype)
                      if isinstance(comm_dtype, str) else comm_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"comm_dtype must be a floating dtype (jnp.bfloat16, 'bfloat16', 'bf16', "
                     f"jnp.float16, ...), got {comm_dtype!r}")
  # float64 without jax_enable_x64 runs as float32 (JAX only warns): the exchange's dtype is
  # the canonical one, and so is what the counters charge (they charged 8 bytes a value).
  return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))


def axis_tuple(axis_name: AxisName) -> tuple[str, ...]:
  """``axis_name`` as a tuple of names: ``None`` -> ``()``, ``"x"`` -> ``("x",)``."""
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _vmap_axes(axis_name: AxisName) -> tuple[str, ...]:
  """The axes of ``axis_name`` that are not manual mesh axes (i.e. ``vmap`` axes)."""
  mesh = jax.sharding.get_abstract_mesh()
  mesh_axes = set(getattr(mesh, "manual_axes", ()) or ()) | set(
      () if mesh.empty else mesh.axis_names)
  return tuple(a for a in axis_tuple(axis_name) if a not in mesh_axes)


def _is_bound(name: str) -> bool:
  try:
    lax.axis_size(name)
  except NameError:
    return False
  return True


def require_bound(axis_name: AxisName, owner: str) -> None:
  """Raises ``ValueError`` naming ``owner`` and the axis when a name of ``axis_name`` is not
  bound where the update is traced (JAX's own ``NameError`` speaks of ``psum`` and names no
  transform). Called at the top of every communicating transform's update."""
  if axis_name is None:
    return
  missing = [a for a in axis_tuple(axis_name) if not _is_bound(a)]
  if missing:
    raise ValueError(
        f"{owner}: axis_name={axis_name!r}, but {', '.join(map(repr, missing))} is not bound "
        "where its update runs. Call the update inside jax.shard_map / jax.vmap(..., "
        "axis_name=...) over those axes (mfopt.parallel.per_worker and mfopt.train.fit bind "
        "mfopt.WORKER_AXES), or build it with axis_name=None for a single worker.")


def unbatched(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """``x`` (a scalar identical on all workers) made unbatched under ``vmap``, without communication.

  Under the worker ``vmap`` a step count or a "sync now" predicate held in every worker's
  state is *batched*, so a ``lax.cond`` on it lowers to a ``select`` that runs both branches
  (and their collectives) on every step, and a ``lax.while_loop`` with a batched trip count
  runs its body for all workers while any needs it, then selects. A ``pmax`` over a ``vmap``
  axis is a local reduction over the stacked axis whose batching rule returns an unmapped
  value, which keeps the ``cond`` a ``conditional`` (and a loop's trip count one number);
  mesh (``shard_map``) axes need no reduction and get none, so nothing crosses a device;
  names that are not bound at all (the transform used outside the worker ``vmap``) are
  skipped. Bool inputs give bool, integer inputs their own dtype. Only correct for values
  that really are equal on every worker (counts, schedules).
  """
  axes = tuple(a for a in _vmap_axes(axis_name) if _is_bound(a))
  if not axes:
    return x
  try:
    if x.dtype == jnp.bool_:
      return lax.pmax(x.astype(jnp.int32), axes) > 0
    return lax.pmax(x, axes)
  except AssertionError as e:  # JAX 0.10's pvary asserts, with no message
    if not _manual_axes():
      raise
    raise ValueError(
        f"a collective over the vmap axes {axes} inside jax.shard_map failed JAX's varying-"
        "axes check: with a vmap axis in a transform's axis_name, pass check_vma=False to "
        "jax.shard_map (mfopt.parallel.per_worker does)") from e


#: Name scope of :func:`gated` loops. XLA keeps it in the ``op_name`` metadata of the compiled
#: ``while``, which is how the HLO checks of the benchmarks and tests find them.
GATE_SCOPE = "mfopt_gate"


def gated(pred: jax.Array, fn: Any, carry: Any, operands: tuple = (), *,
          owner: HostSchedule | None = None) -> Any:
  """``fn(carry, *operands)`` where the scalar ``pred`` holds, else ``carry``, as a
  ``lax.while_loop`` of 0 or 1 trips (named :data:`GATE_SCOPE`) instead of a ``lax.cond``.

  Two measured reasons (issue 8, BENCHMARKS.md):

  * XLA updates a loop's carried buffers in place. A ``conditional``'s results are fresh
    buffers that XLA does not alias with a step's donated state, so parameter-sized results
    were copied or re-added into place on every step (periodic averaging's local step: 508
    kernel launches against 406 for the step without averaging, in the deviceless XLA:GPU
    compilation for an H100; 36 B/param of update traffic against 24 on XLA:CPU).
  * XLA:GPU turns a ``conditional`` whose branches look cheap into a ``select`` and runs both
    branches every step. The hybrid's LARS norms (two reductions per tensor) then read the
    parameters and gradients again during the AdaBound warmup: 36 B/param against
    ``optax.adam``'s 28. It does not do that to a loop.

  ``operands`` are values ``fn`` reads that do not change in the loop (e.g. the parameters).
  Pass them here rather than closing over them: inside the loop they go through an
  ``optimization_barrier`` together with the trip counter, so work that depends only on them
  is not loop-invariant. Closed over, XLA:CPU's loop-invariant code motion hoisted such work
  (the hybrid's norm reductions) out of the loop and ran it every step: 64 B/param against
  44 in the AdaBound warmup (``tests/test_adabound.py``).

  Derivatives: JAX cannot differentiate a ``while_loop`` in reverse mode, so the loop is a
  ``jax.custom_jvp`` whose rule differentiates ``where(pred, fn(carry, *operands), carry)``
  (the tangents going into ``fn`` are zeroed where the gate is shut, so an infinite
  derivative of the untaken branch, e.g. ``sqrt`` at 0, cannot turn the gradient into NaN).
  ``jax.grad`` through a gated update therefore works, and evaluates ``fn`` on every step;
  :func:`differentiable_gates` makes it a ``lax.cond`` instead. Values ``fn`` closes over
  are hoisted into arguments (as ``jax.closure_convert`` does) so they get their derivatives
  too. The undifferentiated program is the loop, unchanged. ``pred`` is taken as a bool
  (nonzero opens the gate once).

  ``pred`` must be unbatched under the worker ``vmap`` (:func:`unbatched`); batched, the loop
  runs ``fn`` for every worker while any needs it and selects (still correct, not cheaper).
  ``fn`` must return a value of ``carry``'s structure, shapes and dtypes.

  ``owner``: the :class:`HostSchedule` that predicts this gate (the transform's
  ``update.host_schedule``). Under :func:`static_gates` for another schedule the gate stays on
  the device: ``periodic_averaging(hybrid_adabound_lars(...))`` forced the hybrid's LARS gate
  to the averaging schedule's decision, so after the switch a local step ran with the trust
  ratio's norms left at zero. A gate without an owner (a user's transform) is decided by
  whatever schedule is active, as before owners existed.
  """
  pred = jnp.asarray(pred)
  if pred.dtype != jnp.bool_:  # (an int 2 ran the loop twice while the derivative took 1 trip)
    pred = pred != 0
  static = _STATIC_GATE.get()
  if static is not None and (static.owner is None or owner is None or owner is static.owner):
    # the host decided: no control flow
    static.preds.append(pred)
    with jax.named_scope(GATE_SCOPE):
      return fn(carry, *operands) if static.open else carry
  operands = tuple(operands)
  manual = bool(_manual_axes())
  paxes = _varying_axes(pred) if manual else frozenset()
  if paxes:  # a predicate that varies over mesh axes makes the result vary over them too
    # (typed invariant, an invariant carry's tangent could not be masked by a varying where,
    # and JAX's lax.cond gave wrong gradients, then hung in an all-reduce)
    carry, operands = jax.tree.map(lambda x: _as_varying(x, _varying_axes(x) | paxes),
                                   (carry, operands))
  if operands and manual:  # the loop's optimization_barrier types every operand with
    # the union of their varying axes; fn is traced once below, so it must see those types
    axes = frozenset().union(*map(_varying_axes, jax.tree.leaves(operands)))
    operands = jax.tree.map(lambda x: _as_varying(x, axes), operands)
  carry, _ = _vma_consistent(carry, lambda c: fn(c, *operands))
  target = jax.tree.map(_varying_axes, carry)

  def branch(c, ops):  # fn, its results cast to the carry's varying axes (shard_map)
    return jax.tree.map(_as_varying, fn(c, *ops), target)

  # The closed-over values that a derivative can flow through become explicit arguments, so
  # that the custom JVP rule below sees (and differentiates with respect to) them.
  branch, consts = _closure_convert(branch, carry, operands)
  if _DIFFERENTIABLE_GATE.get():  # traced under differentiable_gates: a lax.cond
    if any(isinstance(x, jax.core.Tracer) and not paxes <= _varying_axes(x) for x in consts):
      # JAX's lax.cond under shard_map gave a wrong gradient for such a value, then hung in
      # an all-reduce (the loop's custom JVP differentiates it correctly)
      raise ValueError(
          f"gated: under differentiable_gates, fn closes over a value that does not vary over "
          f"the mesh axes {sorted(paxes)} its predicate varies over; pass it in operands "
          "(they are cast), or trace without differentiable_gates")
    with jax.named_scope(GATE_SCOPE):
      return lax.cond(pred, lambda a: branch(a[0], a[1], *a[2]), lambda a: a[0],
                      (carry, operands, tuple(consts)))
  return _gate_loop(branch, pred, carry, operands, tuple(consts))


def _closure_convert(fn: Callable[..., Any], *args: Any) -> tuple[Callable[..., Any], list]:
  """``jax.closure_convert`` without its cache: ``(converted, consts)`` where
  ``converted(*args, *consts) == fn(*args)`` and ``consts`` are the floating-point values
  ``fn`` closes over (the ones a derivative can flow through; tracers or arrays).

  Deviation from JAX's own function, which :func:`gated` used at first: it is cached on the
  function object (4096 entries), and ``gated`` makes a new closure per call, so eager calls
  (``tx.update`` outside ``jit``, as flax.nnx.Optimizer does) never hit the cache and kept
  every closed-over array alive: 20 eager block_momentum steps on 4 MB of parameters held
  126 MiB of arrays against 11 MiB before the custom JVP (a review's measurement)."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  consts = list(closed.consts)
  hoisted = [i for i, c in enumerate(consts) if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
  out_tree, n_args = jax.tree.structure(out_shape), len(args)

  def converted(*args_and_consts):
    merged = list(consts)
    for i, value in zip(hoisted, args_and_consts[n_args:]):
      merged[i] = value
    out = jax.core.eval_jaxpr(closed.jaxpr, merged, *jax.tree.leaves(args_and_consts[:n_args]))
    return jax.tree.unflatten(out_tree, out)

  return converted, [consts[i] for i in hoisted]


def _gate_loop_impl(conv, pred, carry, operands, consts):
  trips = pred.astype(jnp.int32)

  def body(loop):
    trip, c = loop
    ops = operands
    if operands:  # the counter is always used (the next trip test), so the barrier stays
      ops, trip = lax.optimization_barrier((operands, trip))
    return trip + 1, conv(c, ops, *consts)

  init = (jnp.zeros([], jnp.int32), carry)
  init, body = _vma_consistent(init, body)
  with jax.named_scope(GATE_SCOPE):
    _, out = lax.while_loop(lambda loop: loop[0] < trips, body, init)
  return out


_gate_loop = jax.custom_jvp(_gate_loop_impl, nondiff_argnums=(0,))


@_gate_loop.defjvp
def _gate_loop_jvp(conv, primals, tangents):
  pred, carry, operands, consts = primals
  _, t_carry, t_operands, t_consts = tangents
  paxes = _varying_axes(pred)

  def keep(t):  # zeroed where shut; a tangent typed less varying than pred (a closed-over
    # value under shard_map) is passed as is: the result's where below still selects
    return jnp.where(pred, t, jnp.zeros_like(t)) if paxes <= _varying_axes(t) else t

  out, t_out = jax.jvp(lambda c, ops, cs: conv(c, ops, *cs), (carry, operands, consts),
                       jax.tree.map(keep, (t_carry, t_operands, t_consts)))
  pick = lambda a, b: jnp.where(pred, a, b)  # noqa: E731
  return jax.tree.map(pick, out, carry), jax.tree.map(pick, t_out, t_carry)


def _varying_axes(x: Any) -> frozenset:
  """The manual mesh axes a value (or an abstract value) varies over under ``shard_map`` with
  ``check_vma=True``; empty elsewhere. (JAX 0.10 calls the type ``manual_axis_type``, earlier and
  later versions ``vma``.)"""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()) or ())
  return frozenset(getattr(aval, "vma", ()) or ())


def _as_varying(x: Any, axes: frozenset) -> Any:
  missing = tuple(sorted(axes - _varying_axes(x)))
  if not missing:
    return x
  pcast = getattr(lax, "pcast", None)
  return pcast(x, missing, to="varying") if pcast is not None else lax.pvary(x, missing)


def _vma_consistent(init: Any, body: Callable[[Any], Any]) -> tuple[Any, Callable[[Any], Any]]:
  """``(init, body)`` of a ``while_loop`` whose carry types agree under ``shard_map``'s
  ``check_vma=True`` (JAX's default): a leaf the body makes varying over a mesh axis (an
  average is invariant, a value mixed with this device's gradient is varying) is cast to
  varying on the way in and out (``lax.pcast``, no runtime cost). Found by a fixpoint over
  ``jax.eval_shape`` of the body. Outside ``shard_map``, or with ``check_vma=False`` (the
  library's own steps), nothing varies and both are returned unchanged."""
  if not _manual_axes():
    return init, body
  target = jax.tree.map(_varying_axes, init)
  for _ in range(8):  # each round only adds axes; a handful of mesh axes bounds it
    cast = jax.tree.map(_as_varying, init, target)
    out = jax.eval_shape(body, cast)
    new = jax.tree.map(lambda t, o: t | _varying_axes(o), target, out)
    if new == target:
      break
    target = new
  if not any(jax.tree.leaves(target, is_leaf=lambda t: isinstance(t, frozenset))):
    return init, body

  def consistent_body(loop):
    return jax.tree.map(_as_varying, body(loop), target)

  return jax.tree.map(_as_varying, init, target), consistent_body


def _manual_axes() -> tuple[str, ...]:
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(getattr(mesh, "manual_axes", ()) or ())


class HostSchedule(NamedTuple):
  """The host-side copy of a transform's gate decisions (:func:`static_gates`).

  A transform whose :func:`gated` predicate the host can predict exposes one as
  ``tx.update.host_schedule``; :func:`mfopt.train.make_train_step` then runs a step compiled
  with the gate open or shut, chosen on the host, instead of the device-side loop.

  The transform's :func:`gated` calls name it (``gated(..., owner=schedule)``) so that a host
  decision applies to its own gates only, not to those of a gated transform nested in it; a
  gate without an owner follows whichever schedule is active.

  Attributes:
    read: ``opt_state -> h``: the schedule's host state, read from the transform's state
      (one device-to-host transfer; worker 0 of a stacked state). Called on the first step
      and whenever the caller passes a state that is not the last step's output.
    next: ``h -> (open, h)``: whether the next update's gate opens, and the host state after.
    reread_after_open: read the state again after a step whose gate opened (one transfer per
      opening: an adaptive period changes only at a sync, from values only the device has).
  """

  read: Callable[[Any], Any]
  next: Callable[[Any], tuple[bool, Any]]
  reread_after_open: bool = False


def chain(*transforms: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(*transforms)`` that keeps a member's ``update.host_schedule``.

  ``optax.chain`` returns a new ``update`` function, so a gated transform inside it (e.g.
  ``optax.chain(sync_gradients(axes), hybrid_adabound_lars(...))``, the synchronous hybrid)
  lost its host schedule and ran with the device-side gate that XLA:GPU blocks the host on
  (:func:`static_gates`). Each schedule reads its state wherever it sits in the chain's state
  (:func:`states_of`). At most one member may carry one: a host gate is one decision per step.
  (:func:`mfopt.precision.dynamic_loss_scale` keeps no schedule on purpose: a skipped
  non-finite step does not advance the inner state, which the host cannot foresee.)

  Example:
    >>> import mfopt
    >>> hybrid = mfopt.hybrid_adabound_lars(num_workers=8, steps_per_epoch=10, warmup_epochs=1)
    >>> tx = mfopt.chain(mfopt.sync_gradients(mfopt.WORKER_AXES), hybrid)
    >>> tx.update.host_schedule is hybrid.update.host_schedule
    True
  """
  tx = optax.chain(*transforms)
  schedules = [s for t in transforms
               if (s := getattr(t.update, "host_schedule", None)) is not None]
  if len(schedules) > 1:
    raise ValueError(f"chain: {len(schedules)} transforms carry a host_schedule; a step has one "
                     "host gate decision, so at most one gated transform may be chained")
  if not schedules:
    return tx
  inner_update = tx.update

  def update_fn(updates, state, params=None, **extra_args):
    return inner_update(updates, state, params, **extra_args)

  update_fn.host_schedule = schedules[0]
  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def host_scalar(x: Any) -> int:
  """A Python int from an int scalar that is equal on every worker (worker 0 of a stacked
  array; the first local shard of a multi-process one, so no process waits on another)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_shards[0].data
  return int(np.asarray(jax.device_get(x)).reshape(-1)[0])


class _StaticGate(NamedTuple):
  open: bool
  preds: list
  owner: HostSchedule | None  # None: every gate (a benchmark's choice)


_STATIC_GATE: contextvars.ContextVar[_StaticGate | None] = contextvars.ContextVar(
    "mfopt_static_gate", default=None)


@contextlib.contextmanager
def static_gates(open_: bool, owner: HostSchedule | None = None) -> Iterator[list]:
  """Trace :func:`gated` calls with the gate decided by the host: ``fn`` runs iff ``open_``.

  ``owner``: only the gates of that schedule (``gated(..., owner=owner)``) are decided; any
  other gate in the step (a transform nested in another) stays on the device. ``None``: all.

  The measured reason (issue 8, BENCHMARKS.md, H100 + JAX 0.11.2): XLA:GPU runs a ``while``
  (and a ``conditional``) whose trip count is data by copying the predicate to the host and
  blocking the host on it, once per step. The host then stops queueing work until the
  device has caught up, so the GPU idles while the rest of the step is launched: a periodic
  averaging local step of ResNet-18 (bf16, batch 512) took 9.06 ms against 7.19 ms for the
  same step without averaging (1.26x), and ``hybrid_adabound_lars``'s LARS phase on the
  ResNet-50 tree 1.63x ``optax.lars``. A step compiled for "gate shut" is the
  no-communication program; one for "gate open" runs the body unconditionally.

  Yields the list of the traced predicates (device values): the caller turns them into a
  mismatch count (``gate_mismatch`` in the train step's metrics) so a host schedule that
  disagrees with the device is detected, never silently wrong.
  """
  token = _STATIC_GATE.set(_StaticGate(bool(open_), [], owner))
  try:
    yield _STATIC_GATE.get().preds
  finally:
    _STATIC_GATE.reset(token)


_DIFFERENTIABLE_GATE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mfopt_differentiable_gate", default=False)


@contextlib.contextmanager
def differentiable_gates() -> Iterator[None]:
  """Trace :func:`gated` calls as ``lax.cond`` instead of a 0-or-1-trip ``lax.while_loop``.

  Not needed for correctness: ``jax.grad`` (and ``jax.jvp``) through the update of
  :func:`mfopt.periodic_averaging`, :func:`mfopt.block_momentum` or
  :func:`mfopt.hybrid_adabound_lars` (meta-learning a learning rate, say) works without it,
  through the loop's custom JVP (:func:`gated`), which evaluates the branch on every step
  and selects. Inside this context the differentiated program is a ``lax.cond`` instead,
  which skips the branch (its collectives included) when the gate is shut and the predicate
  is unbatched: the same values and gradients (``tests/test_comm_gated.py``). What is given
  up is :func:`gated`'s measured in-place update (a ``conditional``'s results are fresh
  buffers), so use it for differentiated programs only. It acts when the update is *traced*:
  enter it before the first call of a jitted function that differentiates through the update
  (a function jitted and traced outside it keeps its loops)::

    with mfopt.differentiable_gates():
      meta_grad = jax.grad(loss_after_updates)(learning_rate)
  """
  token = _DIFFERENTIABLE_GATE.set(True)
  try:
    yield
  finally:
    _DIFFERENTIABLE_GATE.reset(token)


_PAYLOAD_UNIT = 2**30  # the high word of a split payload counts GiB


def init_comm_stats(payload_bytes: int, kind: CollectiveKind) -> CommStats:
  """A zeroed counter for exchanges of ``payload_bytes`` bytes per worker.

  The byte count only feeds reports, so it never limits the model size: a payload that an
  int32 cannot hold (>= 2 GiB; JAX has no int64 without ``jax_enable_x64``) is stored as the
  pair ``divmod(payload_bytes, 2**30)`` (it used to be refused, stopping ``tx.init`` for
  models of ~540M float32 parameters).
  """
  if not _checks.is_int(payload_bytes) or payload_bytes < 0:
    raise ValueError(f"payload_bytes must be a non-negative integer, got {payload_bytes!r}")
  payload_bytes = int(payload_bytes)
  if payload_bytes < 2**31:
    leaf = jnp.asarray(payload_bytes, jnp.int32)
  else:
    high, low = divmod(payload_bytes, _PAYLOAD_UNIT)
    if high >= 2**31:
      raise ValueError(f"payload_bytes must be < 2**61, got {payload_bytes}")
    leaf = jnp.asarray([high, low], jnp.int32)
  return CommStats(count=jnp.zeros([], jnp.int32), payload_bytes=leaf,
                   kind=jnp.asarray(int(kind), jnp.int32))


def payload_of(stats: CommStats) -> int:
  """Bytes per exchange of a :class:`CommStats` (worker 0's, if worker-stacked), on the host."""
  count = np.asarray(jax.device_get(stats.count))
  payload = np.asarray(jax.device_get(stats.payload_bytes))
  if payload.ndim > count.ndim:  # the split form: (..., 2) = (GiB, remainder)
    high, low = payload.reshape(-1, 2)[0]
    return int(high) * _PAYLOAD_UNIT + int(low)
  return int(payload.reshape(-1)[0])


def tree_payload_bytes(tree: Any, dtype: Any = None) -> int:
  """Bytes of all leaves of ``tree``, each counted in ``dtype`` if given."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    itemsize = jnp.dtype(dtype if dtype is not None else leaf.dtype).itemsize
    total += int(np.prod(leaf.shape)) * itemsize
  return total


def states_of(tree: Any, cls: type) -> list[Any]:
  """Every node of type ``cls`` (e.g. a transform's state NamedTuple) in ``tree``, in order."""
  return [s for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
          if isinstance(s, cls)]


def comm_totals(state: Any) -> dict[str, int]:
  """Sums every :class:`CommStats` found in an (optimizer) state.

  Works on a single worker's state or on a worker-stacked one (it reads worker 0:
  the counters of all workers are identical by construction).

  Returns:
    ``{"collectives": ..., "payload_bytes": ..., "all_reduces": ...,
    "all_gathers": ..., "all_reduce_bytes": ..., "all_gather_bytes": ...}``,
    all Python ints, per worker.
  """
  stats = states_of(state, CommStats)
  out = {"collectives": 0, "payload_bytes": 0, "all_reduces": 0, "all_gathers": 0,
         "all_reduce_bytes": 0, "all_gather_bytes": 0}
  for s in jax.device_get(stats):  # one transfer for all counters
    count, kind = (int(np.asarray(a).reshape(-1)[0]) for a in (s.count, s.kind))
    size = payload_of(s)
    name = "all_reduce" if kind == CollectiveKind.ALL_REDUCE else "all_gather"
    out["collectives"] += count
    out["payload_bytes"] += count * size
    out[name + "s"] += count
    out[name + "_bytes"] += count * size
  return out


def pmean_tree(tree: Any, axis_name: AxisName, comm_dtype: Any = None, *,
               predivide: bool = False) -> Any:
  """All-reduce mean of every leaf over ``axis_name``, optionally in ``comm_dtype``.

  The exchange runs in ``comm_dtype`` (e.g. bf16 halves the bytes) and the result
  is cast back to each leaf's dtype. On XLA:CPU a bf16 all-reduce is computed in
  f32 after compilation; the lowered program still asks for bf16.

  ``predivide`` (float16 exchanges only, ``comm_dtype`` float16 or a float16 leaf with
  ``comm_dtype=None``; :func:`sync_gradients` asks for it): divide by the worker count
  before the sum (:func:`pmean_tree_scaled` with scale 1), so the sum overflows only where
  the mean would (``lax.pmean`` sums first: 8 workers' gradients of 1e4 came back ``inf``).
  The price is precision for small values, which the division pushes into fp16's subnormals
  (a reviewer's W = 8: 1.4% relative error of the mean at 1e-5 against 0.5% summing first),
  so parameter averaging's small deltas keep the sum-first order.
  """
  if axis_name is None:
    return tree
  return _pmean_leaves(tree, axis_name, comm_dtype, predivide=predivide, scale=None)


def _pmean_leaves(tree: Any, axis_name: AxisName, comm_dtype: Any, *, predivide: bool,
                  scale: jax.Array | None, floats_only: bool = False) -> Any:
  """Per leaf: a float16 exchange (``comm_dtype``, or the leaf's own dtype when it is None)
  with ``predivide`` goes through :func:`pmean_tree_scaled`'s formula (``scale``, or 1);
  every other leaf is ``lax.pmean`` in the exchanged dtype. (The choice was made on
  ``comm_dtype`` alone: float16 gradients exchanged in their own dtype summed first, and 8
  workers' 1e4 came back inf.) ``floats_only``: other leaves are returned as they are."""
  w = _num_workers(axis_name) if predivide else 1
  scale = jnp.asarray(1.0 if scale is None else scale, jnp.float32)

  def one(x):
    if floats_only and not is_floating(x):
      return x
    sent = jnp.dtype(x.dtype if comm_dtype is None else comm_dtype)
    if predivide and sent == jnp.float16:
      return _scaled_leaf(x, axis_name, sent, scale, w)
    if comm_dtype is None:
      return lax.pmean(x, axis_name)
    return lax.pmean(x.astype(comm_dtype), axis_name).astype(x.dtype)

  return jax.tree.map(one, tree)


def is_floating(x: Any) -> bool:
  """Whether ``x`` is an array of a floating dtype (the leaves the transforms exchange)."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _num_workers(axis_name: AxisName) -> int:
  """The product of the bound axes' sizes (inside the transform's vmap/shard_map)."""
  return math.prod(lax.axis_size(name) for name in axis_tuple(axis_name))


def _scaled_leaf(x: jax.Array, axis_name: AxisName, comm_dtype: Any, scale: jax.Array,
                 w: int) -> jax.Array:
  sent = (x.astype(jnp.float32) * (scale / w)).astype(comm_dtype)
  return (lax.psum(sent, axis_name).astype(jnp.float32) / scale).astype(x.dtype)


def pmean_tree_scaled(tree: Any, axis_name: AxisName, comm_dtype: Any, scale: jax.Array) -> Any:
  """:func:`pmean_tree` of a loss-scaled exchange: ``psum((x * scale / W) as comm_dtype) / scale``.

  For an fp16 gradient all-reduce under dynamic loss scaling (seed 004 §2.2.2, the way
  mixed-precision data parallelism exchanges gradients): the values cross the wire scaled,
  so gradients below fp16's smallest subnormal (6e-8) are not flushed to zero, and divided by
  the worker count ``W`` before the sum (apex's gradient pre-division), so the sum overflows
  only where the mean would. An overflow gives ``inf`` on every worker, which
  :func:`mfopt.precision.dynamic_loss_scale` reverts and backs off from. ``scale`` must be
  the same on every worker (true under ``dynamic_loss_scale`` with a synchronous chain: every
  worker sees the same all-reduced finiteness, so the scales move together).
  """
  if axis_name is None:
    return tree
  w, scale = _num_workers(axis_name), jnp.asarray(scale, jnp.float32)
  return jax.tree.map(lambda x: _scaled_leaf(x, axis_name, comm_dtype, scale, w), tree)


class SyncGradientsState(NamedTuple):
  """State of :func:`sync_gradients`: only its communication counter."""

  comm: CommStats


def sync_gradients(axis_name: AxisName, comm_dtype: Any = None) -> optax.GradientTransformation:
  r"""Mean of the gradients over all workers, every step (FULLSGD / BSP).

  .. math::  g \leftarrow \frac{1}{W} \sum_{w=1}^{W} g_w

  Put it first in a chain: ``optax.chain(mfopt.sync_gradients(axes), optax.sgd(lr))``
  is synchronous data-parallel SGD. With worker-stacked state every worker then
  applies the same update and the replicas stay identical.

  Seeds: 001 (FULLSGD baseline), 004 §2.2.2 (half-precision all-reduce).

  Args:
    axis_name: the worker axis (or tuple of axes: mesh axis and virtual-worker
      ``vmap`` axis) to average over; ``None`` for one worker (no collective).
    comm_dtype: dtype the all-reduce runs in (``jnp.bfloat16`` or ``jnp.float16``
      halve the bytes); the result is cast back to the gradient's dtype.
      ``None`` exchanges in the gradient's own dtype. An fp16 exchange inside
      :func:`mfopt.precision.dynamic_loss_scale` sends the gradients loss-scaled
      (:func:`pmean_tree_scaled`): that transform passes its scale as the extra
      argument ``loss_scale``, which ``optax.chain`` forwards. Outside it
      (``optax.chain(sync_gradients(axes, jnp.float16), dynamic_loss_scale(opt))``) the
      exchange gets no scale and sends the unscaled gradients, which fp16 may flush to zero:
      put the loss scaling outermost.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state counts one all-reduce per
    step and its payload (floating parameters x exchanged dtype size, per worker; other
    leaves are not exchanged and stay each worker's own). Its update
    takes an optional keyword ``loss_scale`` (used by an fp16 exchange only).

  Example:
    >>> import jax, jax.numpy as jnp, optax, mfopt
    >>> tx = optax.chain(mfopt.sync_gradients(None), optax.sgd(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
    >>> updates["w"]
    Array([-0.1, -0.1, -0.1], dtype=float32)
  """
  axis_name = check_axis_name(axis_name)
  comm_dtype = comm_dtype_of(comm_dtype)

  def init_fn(params):
    payload = 0 if axis_name is None else tree_payload_bytes(
        [x for x in jax.tree.leaves(params) if is_floating(x)], comm_dtype)
    return SyncGradientsState(comm=init_comm_stats(payload, CollectiveKind.ALL_REDUCE))

  def update_fn(updates, state, params=None, *, loss_scale=None, **extra_args):
    del params, extra_args
    if axis_name is None:
      return updates, state
    require_bound(axis_name, "sync_gradients")
    if not any(x.size for x in jax.tree.leaves(updates)):  # an empty group: nothing to exchange
      return updates, state
    # every leaf that crosses the wire in float16 (comm_dtype, or its own dtype) is divided
    # first and, inside dynamic_loss_scale, sent loss-scaled; the others are a plain pmean
    # (non-float leaves, e.g. float0 gradients of integer parameters, stay each worker's own,
    # as periodic_averaging keeps integer leaves: an int mean became a float, float0 crashed)
    updates = _pmean_leaves(updates, axis_name, comm_dtype, predivide=True, scale=loss_scale,
                            floats_only=True)
    comm = state.comm._replace(count=state.comm.count + 1)
    return updates, SyncGradientsState(comm=comm)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
