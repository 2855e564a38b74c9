r"""Mixed precision (seed 004 §2.2.2): a dtype policy, and dynamic loss scaling for fp16.

**Policy.** ``get_policy("params=float32,compute=bfloat16,output=float32")`` (or the shorthands
``"fp32"``, ``"bf16"``, ``"fp16"``) names three dtypes; :func:`apply_policy` sets the model's
``dtype`` attribute (its *compute* dtype). The mfopt models always create float32 parameters
(the fp32 master weights; the optimizer state follows the parameters, so it is float32 too),
cast them to the compute dtype inside each layer, keep BatchNorm statistics and reductions in
float32, and return float32 logits, so softmax, cross-entropy, ``exp`` and ``log`` run in
float32 (``mfopt.train.classification_loss``) -- the operators the seed says must avoid fp16.
Hence ``params`` and ``output`` must be float32 here; only ``compute`` varies.

**Dynamic loss scaling** (fp16 only; bf16 has float32's range and needs none). Wrap the whole
optimizer, communication included: ``tx = mfopt.precision.dynamic_loss_scale(tx)``.
``mfopt.train.make_train_step`` sees the :class:`LossScaleState` in the optimizer state and
computes gradients with flax's ``DynamicScale.value_and_grad`` (loss multiplied by the current
scale, backward pass in fp16, gradients cast to float32 and divided by the scale). The wrapper
then runs the inner transform and decides, per worker, from two flags and *no extra
collective*:

* ``local_finite``: this worker's unscaled gradient is finite;
* ``updates_finite``: the inner transform's updates are finite.

``overflow = not (local_finite and updates_finite)`` backs the scale off (x ``backoff_factor``)
and resets the growth counter; ``updates_finite == False`` *reverts* the step: zero updates, the
inner state kept (its communication counters excepted: the collective did run), BatchNorm
statistics kept (done by the train step).

* **Synchronous algorithms** (``chain(sync_gradients(axes), opt)``): a non-finite gradient on any
  worker makes the all-reduced mean non-finite on *every* worker (inf/NaN survive a sum), so the
  flag rides the existing gradient all-reduce: all workers revert and halve their scales
  together, and the replicas and their scales stay identical.
* **Local algorithms** (``periodic_averaging(inner, ...)``, block momentum): put
  :func:`skip_nonfinite` *inside*, around the local optimizer:
  ``dynamic_loss_scale(periodic_averaging(skip_nonfinite(optax.sgd(...)), axes, period))``.
  An overflowing worker then skips only its own local step (zero local update, local optimizer
  state unchanged) and halves only its own scale (scales are per worker), while the averaging
  transform still counts the step, so a due averaging happens on schedule with the worker's
  unchanged parameters; its updates are finite, so the wrapper does not revert the controller.
  No collective is added to local steps.

The scale update is flax's rule (``DynamicScale.value_and_grad``, flax 0.12.8), restated in
:func:`next_dynamic_scale` because flax applies it only to the finiteness of the local
gradient it computes itself, while the synchronous decision needs the all-reduced one; a test
checks the two agree. Reused from flax: the ``DynamicScale`` state and hyperparameters, and
``value_and_grad`` for the scaling and unscaling.

**In your own train step** (not :func:`mfopt.train.make_train_step`), three calls do what
that step does; leave out the last and an overflowing step's inf/NaN batch statistics stay in
that worker's BatchNorm moving averages for good (a user review found them NaN)::

  ds = precision.loss_scale_of(opt_state)            # None: tx has no loss scaling (then
                                                     # jax.value_and_grad, no finish_step)
  (loss, (new_model_state, logits)), grads = precision.scaled_value_and_grad(
      loss_fn, ds)(params)                           # loss_fn: params -> (loss, aux), aux
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)      # zero updates on an overflow
  model_state, metrics = precision.finish_step(      # keeps the old BN statistics on
      opt_state, new_model_state, model_state)       # overflow; loss_scale, overflow

A step reverted on overflow is not counted by the transforms inside (their step counters
stay), so schedules counted in steps (the hybrid's switch epoch, learning-rate decays) move
later by the number of overflows.

fp16 all-reduce: the train step's gradients are unscaled float32, and
:func:`dynamic_loss_scale` passes its scale to ``inner`` as the optax extra argument
``loss_scale``; ``sync_gradients(axes, comm_dtype=jnp.float16)`` then exchanges them scaled
again and pre-divided by the worker count (:func:`mfopt.comm.pmean_tree_scaled`), so small
gradients survive the fp16 wire and an overflowing sum is an overflowing step (reverted, scale
backed off, on every worker alike). Other transforms ignore the argument; a bf16 exchange
needs no scale (float32's range).

Seed: 004 §2.2.2 (items 1-3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax.training.dynamic_scale import DynamicScale

from mfopt import _checks
from mfopt.comm import CommStats, payload_of, states_of

__all__ = [
    "Policy",
    "get_policy",
    "apply_policy",
    "LossScaleState",
    "dynamic_loss_scale",
    "skip_nonfinite",
    "next_dynamic_scale",
    "loss_scale_of",
    "scaled_value_and_grad",
    "finish_step",
    "with_policy",
]

_ALIASES = {
    "float32": jnp.float32, "fp32": jnp.float32, "f32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16, "f16": jnp.float16, "half": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class Policy:
  """Dtypes of a mixed-precision run: parameters (master weights), computation, model output."""

  params: Any = jnp.float32
  compute: Any = jnp.float32
  output: Any = jnp.float32

  @property
  def name(self) -> str:
    return f"params={jnp.dtype(self.params).name},compute={jnp.dtype(self.compute).name}," \
           f"output={jnp.dtype(self.output).name}"

  @property
  def needs_loss_scaling(self) -> bool:
    """True for float16 computation (its range needs a dynamic loss scale)."""
    return jnp.dtype(self.compute) == jnp.float16


def _dtype(field: str, text: str):
  key = text.strip().lower()
  if key not in _ALIASES:
    raise ValueError(f"{field} must be one of {sorted(set(_ALIASES))}, got {text!r}")
  return _ALIASES[key]


def _dtype_object(field: str, value: Any):
  """A dtype given as an object (``jnp.bfloat16``, ``np.dtype``): one of the float dtypes of
  :data:`_ALIASES`; ``compute=jnp.int8`` or ``5`` was accepted, as its string was not."""
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in _ALIASES:
    raise ValueError(f"{field} must be one of {sorted(set(_ALIASES))}, got {value!r}")
  return _ALIASES[dtype.name]


def get_policy(spec: str | Policy) -> Policy:
  """Parses ``"params=float32,compute=bfloat16,output=float32"`` (missing fields: float32).

  A bare dtype (``"bf16"``, ``"fp16"``, ``"float32"``) sets ``compute`` only.

  Raises:
    ValueError: unknown field or dtype, or ``params``/``output`` other than float32 (the
      models keep float32 master weights and float32 logits; see the module docstring).

  >>> from mfopt.precision import get_policy
  >>> get_policy("compute=bf16").name
  'params=float32,compute=bfloat16,output=float32'
  """
  if isinstance(spec, Policy):  # (its fields may be the parser's names: "bf16", "fp16")
    policy = Policy(**{f: _dtype(f, v) if isinstance(v, str) else _dtype_object(f, v)
                       for f, v in dataclasses.asdict(spec).items()})
  elif isinstance(spec, str):
    fields = {}
    if "=" not in spec:
      fields["compute"] = _dtype("policy", spec)
    else:
      for part in spec.split(","):
        if "=" not in part:
          raise ValueError(f"policy must look like 'params=float32,compute=bfloat16', got {spec!r}")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in ("params", "compute", "output"):
          raise ValueError(f"policy field must be params, compute or output, got {key!r} in {spec!r}")
        fields[key] = _dtype(key, value)
    policy = Policy(**fields)
  else:
    raise ValueError(f"policy must be a string or a Policy, got {spec!r}")
  for field in ("params", "output"):
    if jnp.dtype(getattr(policy, field)) != jnp.float32:
      raise ValueError(f"{field} must be float32 (fp32 master weights and fp32 loss, seed 004 "
                       f"§2.2.2), got {jnp.dtype(getattr(policy, field)).name!r}")
  return policy


def apply_policy(model, policy: str | Policy):
  """The model with its ``dtype`` (computation dtype) set to the policy's ``compute``."""
  policy = get_policy(policy)
  if not hasattr(model, "dtype"):
    raise ValueError(f"model must have a 'dtype' attribute (the compute dtype), got {model!r}")
  return model.clone(dtype=policy.compute)


# ----------------------------------------------------------------------------- loss scaling


class LossScaleState(NamedTuple):
  """State of :func:`dynamic_loss_scale`.

  Attributes:
    dynamic_scale: flax ``DynamicScale`` (``scale`` float32, ``fin_steps`` int32).
    inner_state: the wrapped transform's state.
    finite: bool, whether the last step was free of overflow on this worker.
    overflows: int32, steps with an overflow so far on this worker.
  """

  dynamic_scale: DynamicScale
  inner_state: Any
  finite: jax.Array
  overflows: jax.Array


def next_dynamic_scale(ds: DynamicScale, finite: jax.Array) -> DynamicScale:
  """flax's ``DynamicScale`` update for a given finiteness flag (see module docstring)."""
  grow = ds.fin_steps == ds.growth_interval
  fin_scale = jnp.where(grow & finite,
                        jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max),
                        ds.scale)
  inf_scale = ds.scale * ds.backoff_factor
  if ds.minimum_scale is not None:
    inf_scale = jnp.maximum(inf_scale, ds.minimum_scale)
  new_scale = jnp.where(finite, fin_scale, inf_scale)
  new_fin_steps = jnp.where(grow | (~finite), 0, ds.fin_steps + 1)
  return ds.replace(fin_steps=new_fin_steps.astype(jnp.int32),
                    scale=new_scale.astype(jnp.float32))


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _is_comm(x) -> bool:
  return isinstance(x, CommStats)


def _keep_old_state(revert, new, old):
  """``old`` where ``revert``, except communication counters (the collective did run)."""
  def pick(n, o):
    if isinstance(n, CommStats):
      return n
    return jnp.where(revert, o, n)
  return jax.tree.map(pick, new, old, is_leaf=_is_comm)


def dynamic_loss_scale(inner: optax.GradientTransformation, *, init_scale: float = 2.0 ** 15,
                       growth_factor: float = 2.0, backoff_factor: float = 0.5,
                       growth_interval: int = 2000) -> optax.GradientTransformation:
  """Wraps ``inner`` (communication included) with a per-worker dynamic fp16 loss scale.

  The train step scales the loss by ``state.dynamic_scale.scale`` and passes unscaled
  float32 gradients; this transform runs ``inner``, reverts the step where the updates are
  not finite, and updates the scale (module docstring: synchronous vs local semantics).

  Args:
    inner: any optax transform, e.g. ``chain(sync_gradients(axes), opt)``.
    init_scale: initial loss scale (flax's default is 2**16; 2**15 leaves one halving of
      headroom below fp16's max 65504).
    growth_factor, backoff_factor, growth_interval: flax ``DynamicScale`` hyperparameters;
      ``growth_factor >= 1`` (1: the scale never grows) and ``backoff_factor`` in (0, 1) (since
      2026-11-25; flax accepts any, and a growth factor below 1 shrank the scale).

  Returns:
    An ``optax.GradientTransformation`` with :class:`LossScaleState`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from mfopt.precision import dynamic_loss_scale
    >>> tx = dynamic_loss_scale(optax.sgd(0.1))
    >>> s = tx.init({"w": jnp.ones(2)})
    >>> u, s = tx.update({"w": jnp.array([1.0, jnp.inf])}, s, {"w": jnp.ones(2)})
    >>> u["w"], float(s.dynamic_scale.scale), bool(s.finite)
    (Array([0., 0.], dtype=float32), 16384.0, False)
  """
  _checks.transformation("inner", inner, owner="dynamic_loss_scale")
  _checks.positive_number("init_scale", init_scale)
  tiny, big = float(jnp.finfo(jnp.float32).tiny), float(jnp.finfo(jnp.float32).max)
  if not tiny <= float(init_scale) <= big:  # (1e39 became inf: every step reverted, for good)
    raise ValueError(f"init_scale must be a normal float32 number, in [{tiny:.3g}, {big:.4g}], "
                     f"got {init_scale!r}")
  # growth >= 1 (1: never grows) and backoff in (0, 1): a "growth" of 0.5 shrank the scale
  # after every run of finite steps. Python floats: DynamicScale holds them as static fields.
  _checks.number_where("growth_factor", growth_factor, lambda v: v >= 1, ">= 1")
  _checks.number_where("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
  growth_factor, backoff_factor = (float(_checks.real_scalar(v)[1])
                                   for v in (growth_factor, backoff_factor))
  _checks.positive_int("growth_interval", growth_interval)

  def init_fn(params):
    ds = DynamicScale(growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, fin_steps=jnp.zeros([], jnp.int32),
                      # a copy (jnp.asarray kept the caller's array; a donated step deleted it)
                      scale=jnp.array(init_scale, jnp.float32, copy=True))
    inner_state = inner.init(params)
    if states_of(inner_state, LossScaleState):  # (update failed with a TypeError about kwargs)
      raise ValueError("dynamic_loss_scale must not wrap another dynamic_loss_scale (one loss "
                       "scale per optimizer; with_policy adds it for fp16), got one inside inner")
    _check_local_steps_skip(inner_state)
    return LossScaleState(dynamic_scale=ds, inner_state=inner_state,
                          finite=jnp.array(True), overflows=jnp.zeros([], jnp.int32))

  inner_x = optax.with_extra_args_support(inner)  # plain transforms ignore loss_scale

  def update_fn(updates, state, params=None, **extra_args):
    local_finite = _all_finite(updates)
    new_updates, new_inner = inner_x.update(updates, state.inner_state, params,
                                            loss_scale=state.dynamic_scale.scale, **extra_args)
    updates_finite = _all_finite(new_updates)
    finite = local_finite & updates_finite
    revert = ~updates_finite
    new_updates = jax.tree.map(lambda u: jnp.where(revert, jnp.zeros_like(u), u), new_updates)
    new_inner = _keep_old_state(revert, new_inner, state.inner_state)
    return new_updates, LossScaleState(
        dynamic_scale=next_dynamic_scale(state.dynamic_scale, finite), inner_state=new_inner,
        finite=finite, overflows=state.overflows + (~finite).astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_local_steps_skip(inner_state: Any) -> None:
  """Refuses a local algorithm whose local optimizer does not skip non-finite steps.

  Without :func:`skip_nonfinite`, one worker's overflowing gradient makes only its update
  non-finite, :func:`dynamic_loss_scale` reverts that worker's whole state, its averaging
  step counter falls one behind the others', and from then on the workers disagree on when
  to average (across devices the collective then waits for a worker that does not come).
  """
  from mfopt.averaging import PeriodicAveragingState  # noqa: PLC0415 (averaging -> comm only)
  for s in states_of(inner_state, optax.ApplyIfFiniteState):  # optax.apply_if_finite(comm)
    _refuse_communicating(s.inner_state, "optax.apply_if_finite")
  for s in states_of(inner_state, PeriodicAveragingState):
    if not states_of(s.inner_state, SkipNonfiniteState):
      raise ValueError(
          "dynamic_loss_scale (with_policy's fp16) around periodic_averaging or block_momentum "
          "needs their local optimizer wrapped in mfopt.precision.skip_nonfinite: "
          "periodic_averaging(skip_nonfinite(inner), axis_name, period). Otherwise a worker "
          "whose gradient overflowed is reverted alone, its step counter falls behind the "
          "others' and the workers stop agreeing on when to average (optax.apply_if_finite "
          "is not enough: after max_consecutive_errors it lets a non-finite update through)")


def _payload_or_unknown(stats: CommStats) -> int | None:
  try:
    return payload_of(stats)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None  # (init under jit: the payload is a tracer; counted as communicating)


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optax.apply_if_finite`` that never gives up: a non-finite gradient is a skipped step.

  For the *local* optimizer of a local algorithm under :func:`dynamic_loss_scale`: the
  worker's local update is zero and its local optimizer state unchanged when its own gradient
  overflowed: ``periodic_averaging(skip_nonfinite(inner), axes, period)``.

  Do not use it, or ``optax.apply_if_finite``, around a communicating transform: the check is
  per worker, so a skipping worker keeps its old step counter, the workers disagree on when
  to average, and across devices the collective waits forever for the one that did not join.
  """
  _checks.transformation("inner", inner, owner="skip_nonfinite")
  tx = optax.apply_if_finite(inner, max_consecutive_errors=2 ** 31 - 1)

  def init_fn(params):
    state = tx.init(params)
    _refuse_communicating(state.inner_state, "skip_nonfinite")  # (it was only documented)
    return SkipNonfiniteState(*state)

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = tx.update(updates, state, params, **extra_args)
    return new_updates, SkipNonfiniteState(*new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SkipNonfiniteState(optax.ApplyIfFiniteState):
  """State of :func:`skip_nonfinite`: optax's ``ApplyIfFiniteState``, marked as one that never
  gives up. :func:`dynamic_loss_scale` requires this type inside a local algorithm:
  ``optax.apply_if_finite`` with a finite ``max_consecutive_errors`` lets a non-finite update
  through after that many, and the workers then fall out of step (it was accepted)."""

  __slots__ = ()


def _refuse_communicating(state: Any, wrapper: str) -> None:
  """ValueError if ``state`` holds a counter with a payload: a transform built with
  ``axis_name=None`` (one worker) counts nothing and may be wrapped."""
  found = [c for c in states_of(state, CommStats) if _payload_or_unknown(c) != 0]
  if found:
    raise ValueError(
        f"{wrapper} must wrap a local optimizer, got one that communicates ({len(found)} "
        "communication counter(s) in its state): it decides per worker, so a skipping worker "
        "falls out of step with the others (a periodic average then comes at different steps, "
        "and across devices a collective waits for a worker that does not join). Wrap the "
        "inner optimizer instead: periodic_averaging(skip_nonfinite(inner), axis_name, period)")


def with_policy(tx: optax.GradientTransformation, policy: str | Policy,
                **loss_scale_kwargs) -> optax.GradientTransformation:
  """``dynamic_loss_scale(tx)`` if the policy computes in float16, else ``tx`` unchanged.

  For a local algorithm, wrap its local optimizer in :func:`skip_nonfinite` first
  (``periodic_averaging(skip_nonfinite(inner), ...)``); ``init`` refuses it otherwise.
  ``loss_scale_kwargs`` are checked whatever the policy (a misspelt or invalid one passed
  silently until the policy became fp16).
  """
  scaled = dynamic_loss_scale(tx, **loss_scale_kwargs)  # (validates; builds nothing to compile)
  return scaled if get_policy(policy).needs_loss_scaling else tx


# ----------------------------------------------------------------------------- train-step hooks


def loss_scale_of(opt_state: Any) -> DynamicScale | None:
  """The ``DynamicScale`` of the :class:`LossScaleState` in ``opt_state`` (top level or in a
  chain), or ``None`` when the optimizer has no loss scaling. Used by the train step at trace
  time, so optimizers without it compile exactly as before."""
  found = states_of(opt_state, LossScaleState)
  if len(found) > 1:
    raise ValueError(f"optimizer state must hold at most one LossScaleState, got {len(found)}")
  return found[0].dynamic_scale if found else None


def _loss_scale_state(opt_state: Any) -> LossScaleState:
  return states_of(opt_state, LossScaleState)[0]


def scaled_value_and_grad(fun: Callable[..., Any], dynamic_scale: DynamicScale):
  """``jax.value_and_grad(fun, has_aux=True)`` with the loss scaled by ``dynamic_scale``.

  flax's ``DynamicScale.value_and_grad``: the returned loss and float32 gradients are
  unscaled. Its own finiteness flag and next scale are discarded here; the
  :func:`dynamic_loss_scale` transform decides after the inner transform has run.
  """
  grad_fn = dynamic_scale.value_and_grad(fun, has_aux=True)

  def wrapped(params):
    result = grad_fn(params)
    return result.aux, result.grad

  return wrapped


def finish_step(opt_state: Any, new_model_state: Any, old_model_state: Any
                ) -> tuple[Any, Mapping[str, jax.Array]]:
  """After the update: keep the old model state (BN statistics) on overflow; extra metrics."""
  state = _loss_scale_state(opt_state)
  model_state = jax.tree.map(lambda n, o: jnp.where(state.finite, n, o),
                             new_model_state, old_model_state)
  return model_state, {"loss_scale": state.dynamic_scale.scale,
                       "overflow": (~state.finite).astype(jnp.float32)}
