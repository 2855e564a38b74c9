"""Periodic parameter averaging (CPSGD, ADPSGD, K-AVG) and block momentum (M-AVG).

Every worker runs an ``inner`` Optax optimizer on its own data; when the period
controller says so, the workers replace their parameters with the all-worker
mean (seed 001 Alg. 1/2, seed 003 Alg. 1 with ``momentum=0``). With an
``outer`` optimizer the mean is not adopted directly: the difference between the
anchor ``w~`` (the parameters at the last synchronisation) and the mean ``a`` is
a pseudo-gradient for ``outer`` (block momentum, seed 003 Alg. 1; DiLoCo's sign
convention):

.. math::

   g = \\tilde w - a, \\qquad \\tilde w \\leftarrow \\tilde w + \\mathrm{outer}(g)

and ``outer = optax.sgd(1.0, momentum=mu)`` is exactly ``v = mu v + (a - w~);
w~ += v``.

**Local steps run no collective.** The train step maps workers with
``shard_map(vmap(step, axis_name="local"), P("data"))``, so every state leaf,
the controller's counters included, is *batched* under ``vmap``. The sync is a
``lax.while_loop`` of 0 or 1 trips (:func:`mfopt.comm.gated`, named ``mfopt_gate`` in the
HLO metadata) rather than a ``lax.cond``: XLA updates a loop's carried buffers in
place, where a conditional's results are fresh buffers that must be copied (or
re-added) into the step's donated parameters on every local step (see the comment
in :func:`periodic_averaging`). Its trip count must be *unbatched*: a batched one
would make the loop run its body, collectives included, for every worker whenever
any worker syncs and select the results. The counters are identical on all workers
by construction, so the trip count is made unbatched with a ``lax.pmax`` over the
*vmap* axes of ``axis_name`` only: under ``vmap`` that is a plain local reduction
over the stacked workers of one device (no communication), and across the mesh axes
(the ``shard_map`` axes, found from ``jax.sharding.get_abstract_mesh()``) nothing is
needed because a ``shard_map`` body is a per-device program. The compiled HLO then
holds every parameter collective (and ADPSGD's scalar one) inside the body of the
sync loop and none outside it (``tests/test_averaging_hlo.py`` checks W = 8, 16, 32
on 8 devices). The period is held in the state, so neither a change of period by
ADPSGD nor a different constant period recompiles.

Communication is counted in the state (:class:`mfopt.comm.CommStats`): the
parameter exchange once per synchronisation (``param_comm``), the scalar S_k
all-reduce separately (``scalar_comm``). The optional per-step variance
diagnostic (eq. 7 of seed 001) costs two extra all-reduces per step; it is a
measurement, not part of the algorithm, so it is counted apart
(``AveragingDiagnostics.variance_exchanges``) and not in
:func:`mfopt.comm_totals`.

Seeds: ``seeds/001_9b502fe67641284d.txt`` (ADPSGD: Alg. 1, Alg. 2, eqs. 7, 11,
16) and ``seeds/003_d45cb4f33beceb9d.txt`` (M-AVG, Alg. 1); SPEC.md "Seed 001"
and "Seed 003".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from mfopt import _checks
from mfopt import checkpoint as checkpoint_lib
from mfopt.comm import (AxisName, CollectiveKind, CommStats, HostSchedule, check_axis_name,
                        comm_dtype_of, gated, host_scalar,
                        init_comm_stats, is_floating, pmean_tree, require_bound, states_of,
                        tree_payload_bytes)
from mfopt.comm import unbatched as _unbatched

__all__ = [
    "PeriodState", "PeriodController", "constant_period", "adpsgd_period", "scheduled_period",
    "AveragingDiagnostics", "PeriodicAveragingState", "periodic_averaging", "block_momentum",
    "find_averaging_state", "averaging_metrics", "sync_trace", "parameter_variance",
]


# ----------------------------------------------------------------------------- controllers


class PeriodState(NamedTuple):
  """State of a period controller (identical on all workers).

  Attributes:
    count: int32, local steps taken so far (the 0-based index ``k`` of the next step).
    cnt: int32, local steps since the last synchronisation (Alg. 2's ``cnt``).
    period: int32, the current averaging period ``p``.
    c2_sum: float32, sum of the sampled ``S_k / lr_k`` (ADPSGD's ``C2`` numerator).
    c2_count: int32, number of samples in ``c2_sum``; ``C2 = c2_sum / c2_count``.
  """

  count: jax.Array
  cnt: jax.Array
  period: jax.Array
  c2_sum: jax.Array
  c2_count: jax.Array


class PeriodController(NamedTuple):
  """When to synchronise, as three pure functions of a :class:`PeriodState`.

  Attributes:
    init: ``() -> PeriodState``.
    advance: ``state -> (state, due)``: one local step was taken; ``due`` (bool
      scalar) says whether this step ends with an averaging.
    on_sync: ``(state, k, s_k) -> state``: called inside the sync loop's body after
      the averaging of step ``k`` (0-based) with that step's parameter variance
      ``S_k``; resets ``cnt`` and adapts the period.
    uses_variance: whether ``on_sync`` needs ``S_k`` (one scalar all-reduce per sync).
    variance_from: the first step ``k`` at whose sync ``on_sync`` reads ``S_k`` (ADPSGD:
      its warm-up's end). Earlier syncs skip the scalar all-reduce and record ``S_k = NaN``,
      unless the transform was asked for it (``sync_variance=True``).
    name: for reports.
    learning_rate: the schedule the controller reads (``None`` if it reads none);
      recorded in the sync trace.
    host_period: ``(count, period) -> (period in force, period kept)``, in Python ints:
      ``advance``'s period rule, so the host can predict each step's ``due`` from the state
      read once (:class:`mfopt.comm.HostSchedule`); ``None``: not predictable, the train
      step keeps the device-side gate. An adaptive controller (``uses_variance``) changes
      the period only in ``on_sync``; the host re-reads the state after each sync.
  """

  init: Callable[[], PeriodState]
  advance: Callable[[PeriodState], tuple[PeriodState, jax.Array]]
  on_sync: Callable[[PeriodState, jax.Array, jax.Array], PeriodState]
  uses_variance: bool
  name: str
  learning_rate: Callable[[Any], Any] | None = None
  host_period: Callable[[int, int], tuple[int, int]] | None = None
  variance_from: int = 0


def _init_period_state(p: int) -> PeriodState:
  return PeriodState(count=jnp.zeros([], jnp.int32), cnt=jnp.zeros([], jnp.int32),
                     period=jnp.asarray(p, jnp.int32), c2_sum=jnp.zeros([], jnp.float32),
                     c2_count=jnp.zeros([], jnp.int32))


_INT32_MAX = 2**31 - 1


def _advance_with(state: PeriodState, period: jax.Array) -> tuple[PeriodState, jax.Array]:
  cnt = state.cnt + 1
  # ``>=`` rather than Alg. 2's ``==``: identical while p only changes at a sync
  # (cnt is 0 then), and safe if a user edits ``period`` in a restored state.
  # (safe_increment, as optax's counts: a plain + 1 wrapped to -2**31 after 2**31 - 1 steps,
  # and warm-up and scheduled periods started over)
  return state._replace(count=optax.safe_increment(state.count), cnt=cnt), cnt >= period


def _restart_round(state, k, s_k):
  """``on_sync`` of the fixed-schedule controllers: only the step counter of the round resets."""
  del k, s_k
  return state._replace(cnt=jnp.zeros_like(state.cnt))


def constant_period(p: int) -> PeriodController:
  """Average after every ``p`` local steps: steps p, 2p, 3p, ... counted from 1 (CPSGD, K-AVG).

  Over N steps that is exactly ``floor(N / p)`` averagings (SPEC.md, seed 001
  Alg. 1; seed 003 Alg. 1 with K = p). ``p`` is held in the state as an int32,
  so a different ``p`` does not change the compiled step; for the same reason a run resumed
  from a checkpoint keeps the checkpoint's ``p`` (``mfopt.train.fit(run_info=...)`` is how a
  changed ``p`` is refused there).

  Args:
    p: the averaging period, a positive integer (1 = average every step).

  Returns:
    A :class:`PeriodController`.

  Example:
    >>> import mfopt
    >>> ctl = mfopt.constant_period(4)
    >>> int(ctl.init().period)
    4
  """
  p = _checks.positive_int("p", p)

  def advance(state):
    return _advance_with(state, state.period)

  return PeriodController(lambda: _init_period_state(p), advance, _restart_round, False,
                          f"constant(p={p})", host_period=lambda count, period: (period, period))


def scheduled_period(periods: tuple[int, ...], boundaries: tuple[int, ...]) -> PeriodController:
  """Piecewise-constant period: ``periods[i]`` from step ``boundaries[i-1]`` on (0-based steps).

  Seed 001 §V.B's decreasing schedule is ``scheduled_period((20, 5), (K // 2,))``.
  The period in force at the step that completes a round decides it; the count of
  local steps restarts at every averaging.

  Args:
    periods: positive periods, one more than ``boundaries``.
    boundaries: strictly increasing step indices where the next period starts.

  Returns:
    A :class:`PeriodController`.

  Example:
    >>> import mfopt
    >>> ctl = mfopt.scheduled_period((20, 5), (2000,))
    >>> int(ctl.init().period)
    20
  """
  periods = tuple(_checks.positive_int(f"periods[{i}]", p) for i, p in enumerate(periods))
  boundaries = tuple(_checks.positive_int(f"boundaries[{i}]", b)
                     for i, b in enumerate(boundaries))
  if len(periods) != len(boundaries) + 1:
    raise ValueError(f"periods needs one more entry than boundaries ({len(boundaries)}), "
                     f"got {periods!r}")
  if any(b <= 0 for b in boundaries) or list(boundaries) != sorted(set(boundaries)):
    raise ValueError(f"boundaries must be strictly increasing positive steps, got {boundaries!r}")
  p_arr = np.asarray(periods, np.int32)
  b_arr = np.asarray(boundaries, np.int32)

  def period_at(k):
    return jnp.asarray(p_arr)[jnp.searchsorted(jnp.asarray(b_arr), k, side="right")]

  def advance(state):
    period = period_at(state.count)  # the step being completed has index ``count``
    state, due = _advance_with(state, period)
    return state._replace(period=period), due

  def host_period(count, period):
    del period
    now = periods[int(np.searchsorted(b_arr, count, side="right"))]
    return now, now

  return PeriodController(lambda: _init_period_state(periods[0]), advance, _restart_round, False,
                          f"scheduled({periods}, {boundaries})", host_period=host_period)


def adpsgd_period(*, learning_rate: float | optax.Schedule, sampling_steps: int, p_init: int = 4,
                  warmup_steps: int = 0, low: float = 0.7, high: float = 1.3) -> PeriodController:
  r"""ADPSGD's adaptive period (seed 001 Alg. 2, as SPEC.md reads it).

  At iteration ``k`` (0-based), after the local update with ``lr_k``: ``cnt += 1``;
  when ``cnt == p``: ``cnt = 0``, average, and with
  :math:`S_k = \frac1n \sum_j \|w' - w_j\|^2` (pre-averaging parameters):

  * if ``k < K_s`` (``sampling_steps``): ``C2`` = arithmetic mean of all samples
    :math:`S_k/\mathrm{lr}_k` so far (``p`` stays ``p_init``);
  * elif :math:`S_k < \mathrm{low}\cdot \mathrm{lr}_k C_2`: ``p += 1``;
  * elif :math:`S_k > \mathrm{high}\cdot \mathrm{lr}_k C_2`: ``p = max(1, p - 1)``.

  Choices where the paper is open: during ``warmup_steps`` the period is 1 and
  those syncs are *not* sampled for ``C2`` (the paper runs the warm-up epoch
  before starting Alg. 2), nor is a sync at ``lr_k = 0`` (``S_k / lr_k`` is undefined); ``k`` and ``K_s`` count global iterations, warm-up
  included; ``C2`` is held as ``c2_sum / c2_count`` (float32), and the tests
  are evaluated as ``S_k < (low * lr_k) * C2``. Until ``C2`` has a sample (every sampled
  sync at ``lr_k = 0``) the period stays as it is.

  Args:
    learning_rate: the *same* float or schedule the inner optimizer uses; it
      is evaluated at ``k``. The controller cannot see a learning rate changed any other
      way: with the inner optimizer under ``optax.inject_hyperparams`` and its rate cut
      during the run, pass the cut as a schedule here too, or the controller compares
      ``S_k`` with the old ``lr_k C2`` (the period then grows at every sync) and
      :func:`sync_trace` records the old rate.
    sampling_steps: ``K_s``; must leave at least one sampled sync after the
      warm-up (``sampling_steps >= warmup_steps + p_init``). Paper: 0.25 K (CIFAR).
    p_init: the period during sampling (paper: 4).
    warmup_steps: iterations with period 1 before Alg. 2 starts (paper: one epoch).
    low, high: the thresholds (paper: 0.7 and 1.3), ``0 < low <= 1 <= high``.

  Returns:
    A :class:`PeriodController` that needs ``S_k`` (one scalar all-reduce per sync after
    the warm-up; warm-up syncs average only).

  Example:
    >>> import mfopt
    >>> ctl = mfopt.adpsgd_period(learning_rate=0.1, sampling_steps=100)
    >>> int(ctl.init().period)
    4
  """
  p_init = _checks.positive_int("p_init", p_init)
  if not _checks.is_int(sampling_steps):
    raise ValueError(f"sampling_steps must be an integer, got {sampling_steps!r}")
  _checks.nonnegative_int("warmup_steps", warmup_steps)
  if sampling_steps < warmup_steps + p_init:
    raise ValueError(
        f"sampling_steps must be >= warmup_steps + p_init = {warmup_steps + p_init} (at least "
        f"one sampled sync for C2), got {sampling_steps!r}")
  _checks.number_where("low", low, lambda v: 0 < v <= 1, "in (0, 1]")
  _checks.number_where("high", high, lambda v: 1 <= v < math.inf, "a finite number >= 1")
  if not callable(learning_rate):
    _checks.finite_positive_number("learning_rate", learning_rate)
  schedule = learning_rate if callable(learning_rate) else optax.constant_schedule(learning_rate)
  low32, high32 = np.float32(low), np.float32(high)

  def advance(state):
    period = jnp.where(state.count < warmup_steps, 1, state.period)
    return _advance_with(state, period)

  def on_sync(state, k, s_k):
    lr = jnp.asarray(schedule(k), jnp.float32)
    s_k = s_k.astype(jnp.float32)
    in_warmup = k < warmup_steps
    sampling = jnp.logical_and(~in_warmup, k < sampling_steps)
    adapting = jnp.logical_and(~in_warmup, ~sampling)
    # S_k / lr_k of a sync at lr_k = 0 (a warm-up schedule starting at 0) is 0/0: skipped,
    # else one NaN sample froze the period at p_init for the rest of the run.
    sampling = jnp.logical_and(sampling, lr > 0)
    c2_sum = jnp.where(sampling, state.c2_sum + s_k / jnp.where(lr > 0, lr, 1.0), state.c2_sum)
    c2_count = jnp.where(sampling, state.c2_count + 1, state.c2_count)
    c2 = c2_sum / jnp.maximum(c2_count, 1).astype(jnp.float32)
    # No C2 sample yet (every sampled sync at lr = 0, e.g. a delayed warm-up): C2 = 0 made
    # every later sync a "shrink", and the period fell to 1 unsaid; it waits for a sample.
    adapting = jnp.logical_and(adapting, c2_count > 0)
    grow = s_k < (low32 * lr) * c2
    shrink = s_k > (high32 * lr) * c2
    period = jnp.where(grow, state.period + 1,
                       jnp.where(shrink, jnp.maximum(1, state.period - 1), state.period))
    period = jnp.where(adapting, period, state.period)
    return state._replace(cnt=jnp.zeros_like(state.cnt), period=period.astype(jnp.int32),
                          c2_sum=c2_sum, c2_count=c2_count)

  return PeriodController(lambda: _init_period_state(p_init), advance, on_sync, True,
                          f"adpsgd(p_init={p_init}, K_s={sampling_steps}, warmup={warmup_steps})",
                          schedule,
                          host_period=lambda count, period: (
                              1 if count < warmup_steps else period, period),
                          # Alg. 2 starts after the warm-up (plain period-1 averaging in the
                          # paper): warm-up syncs need no S_k, whose all-reduce used to double
                          # the collectives of every warm-up step
                          variance_from=warmup_steps)


# ----------------------------------------------------------------------------- transform


class AveragingDiagnostics(NamedTuple):
  """Seed 001's diagnostics, as plain arrays (checkpointable, read with :func:`sync_trace`).

  Attributes:
    syncs: int32, averagings so far.
    last_sync_variance: float32, ``S_k`` of the last sync (NaN unless computed).
    variance: float32, ``Var[W_k]`` (eq. 7) at the start of the last step (NaN
      unless ``track_variance``).
    variance_sum: float32, sum of ``Var[W_k]`` since the last sync.
    variance_exchanges: int32, diagnostic all-reduces run (2 per tracked step);
      not a :class:`CommStats`, so not in ``comm_totals``.
    trace_step, trace_period, trace_sync_variance, trace_mean_variance, trace_lr:
      ring buffers of length ``trace_length`` (empty tuples when it is 0): per sync, the number of steps
      done (``k + 1``), the steps since the previous sync, ``S_k``, ``V_t``
      (eq. 11: mean of ``Var[W_k]`` over those steps) and ``lr_k``.
    trace_variance: ring buffer of length ``trace_length`` (with ``track_variance``; else an
      empty tuple): per *step* ``k``, ``Var[W_k]``. Read with :func:`variance_trace`. Eq. (9)
      weights each step by its own ``lr_k``, which a round's ``V_t`` cannot give when the
      learning rate changes inside the round.
  """

  syncs: jax.Array
  last_sync_variance: jax.Array
  variance: jax.Array
  variance_sum: jax.Array
  variance_exchanges: jax.Array
  trace_step: jax.Array
  trace_period: jax.Array
  trace_sync_variance: jax.Array
  trace_mean_variance: jax.Array
  trace_lr: jax.Array
  trace_variance: jax.Array


#: :class:`AveragingDiagnostics` as checkpoints before 2026-11-26 hold it: its fields before
#: ``trace_variance``, under its name (so the tree structure is the one those recorded).
_AveragingDiagnosticsBefore = NamedTuple(  # type: ignore[misc]
    "AveragingDiagnostics",
    [(f, jax.Array) for f in
     AveragingDiagnostics._fields[:AveragingDiagnostics._fields.index("trace_variance")]])


def _layout_before_trace_variance(state: Any) -> Any:
  """``state`` with every :class:`AveragingDiagnostics` as it was saved before its
  ``trace_variance`` field existed; ``None`` if it has none, or one holds that trace (such a
  state has arrays no earlier checkpoint has)."""
  found = []

  def old(x):
    if not isinstance(x, AveragingDiagnostics):
      return x
    found.append(isinstance(x.trace_variance, tuple) and not x.trace_variance)
    return _AveragingDiagnosticsBefore(*x[:len(_AveragingDiagnosticsBefore._fields)])

  out = jax.tree.map(old, state, is_leaf=lambda x: isinstance(x, AveragingDiagnostics))
  return out if found and all(found) else None


def _layout_with_trace_variance(state: Any) -> Any:
  return jax.tree.map(lambda x: AveragingDiagnostics(*x, trace_variance=())
                      if isinstance(x, _AveragingDiagnosticsBefore) else x, state,
                      is_leaf=lambda x: isinstance(x, _AveragingDiagnosticsBefore))


# Every periodic_averaging / block_momentum checkpoint written before trace_variance was added
# (as () unless track_variance) was refused as "a different structure"; it reads as it was.
checkpoint_lib.register_migration(_layout_before_trace_variance, _layout_with_trace_variance)


class PeriodicAveragingState(NamedTuple):
  """State of :func:`periodic_averaging` (plain arrays in NamedTuples; checkpointable).

  Attributes:
    count: int32, steps taken.
    inner_state: the inner optimizer's state (local to the worker by default).
    outer_state: the outer optimizer's state (``optax.EmptyState()`` without one).
    anchor: parameters at the last sync (``w~``), held only with ``outer`` or
      ``comm_dtype``; ``()`` otherwise.
    controller: the :class:`PeriodState`.
    param_comm: :class:`CommStats` of the parameter exchange (once per sync).
    scalar_comm: :class:`CommStats` of the ``S_k`` all-reduce (4 bytes per sync).
    diagnostics: :class:`AveragingDiagnostics`.
  """

  count: jax.Array
  inner_state: Any
  outer_state: Any
  anchor: Any
  controller: PeriodState
  param_comm: CommStats
  scalar_comm: CommStats
  diagnostics: AveragingDiagnostics


def _subtract(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a - b`` for one leaf. A bool leaf (a mask kept with the parameters) has no subtraction
  and no transform here changes one: it gives ``False`` (``optax.apply_updates`` adds it:
  ``p + False == p``), where ``optax.sgd`` would give a float 0."""
  return jnp.zeros_like(a) if a.dtype == jnp.bool_ else a - b


def _sq_norm(tree: Any) -> jax.Array:
  leaves = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
  return sum(leaves, jnp.zeros([], jnp.float32))


def _pmean_floats(tree: Any, axis_name: AxisName, comm_dtype: Any = None) -> Any:
  """:func:`mfopt.comm.pmean_tree` of the floating leaves; other leaves (an integer parameter)
  stay each worker's own: their mean would be a float, which the sync loop cannot carry."""
  return jax.tree.map(lambda x: pmean_tree(x, axis_name, comm_dtype) if is_floating(x) else x, tree)


def periodic_averaging(inner: optax.GradientTransformation, axis_name: AxisName,
                       period: PeriodController | int,
                       outer: optax.GradientTransformation | None = None, *,
                       average_inner_state: bool = False, comm_dtype: Any = None,
                       sync_variance: bool | None = None, track_variance: bool = False,
                       trace_length: int = 0,
                       flat_anchor: bool | None = False) -> optax.GradientTransformation:
  r"""Local steps with ``inner``; averaging of the parameters when the controller says so.

  Per worker ``i`` at step ``k``: :math:`w_{k+1,i} = w_{k,i} + \mathrm{inner}(g_{k,i})`;
  on a sync step :math:`w_{k+1,i} \leftarrow \frac1n\sum_j w_{k+1,j}` (seed 001
  Alg. 1/2), or, with ``outer``, :math:`\tilde w \leftarrow \tilde w +
  \mathrm{outer}(\tilde w - \frac1n\sum_j w_{k+1,j})` and :math:`w_{k+1,i}
  \leftarrow \tilde w` (seed 003 Alg. 1). The returned updates are
  ``new_params - params`` (so applying them rounds: ``p + (mean - p)`` equals
  ``mean`` to within one float ulp).

  The step counter deciding when to average lives in this state, per worker, so every worker
  must update it every step: to skip non-finite local steps, wrap ``inner`` in
  :func:`mfopt.precision.skip_nonfinite`, never this transform in ``optax.apply_if_finite``
  (a worker that skips falls out of step and, across devices, the averaging all-reduce hangs).

  The sync is a 0-or-1-trip loop (:func:`mfopt.comm.gated`) with a custom JVP, so
  ``jax.grad`` through ``update`` (meta-learning a learning rate) works; the differentiated
  program runs the sync's computation every step and selects, or, traced under
  :func:`mfopt.differentiable_gates`, skips it with a ``lax.cond``.

  Args:
    inner: the local optimizer (e.g. ``optax.sgd(lr, momentum=0.9)``); its
      state stays local unless ``average_inner_state``.
    axis_name: worker axes (e.g. ``mfopt.WORKER_AXES``); ``None`` = one worker
      (the sync still runs, without collectives).
    period: a :class:`PeriodController` (:func:`constant_period`,
      :func:`adpsgd_period`, :func:`scheduled_period`) or an int ``p`` for
      ``constant_period(p)``.
    outer: optional outer optimizer fed the pseudo-gradient ``anchor - mean``.
    average_inner_state: also average the floating leaves of the inner state at
      every sync (part of the same logical exchange; its bytes are counted).
    comm_dtype: exchange the deltas ``w - anchor`` since the last sync in this
      floating dtype (e.g. ``jnp.bfloat16``); the fp32 master weights are never
      rounded: ``mean = anchor + pmean(delta.astype(comm_dtype))``. The anchor starts as
      each worker's own initial parameters, so the workers must start from the same
      parameters (``mfopt.train.init_train_state`` does): from different ones, every worker
      keeps its own offset for good (the same holds with ``outer``, as in the papers'
      ``w_1``, though there the gap shrinks by the outer momentum at each sync).
    sync_variance: compute ``S_k`` at every sync (one scalar all-reduce, counted
      in ``scalar_comm``); default: only at the syncs where the controller reads it
      (ADPSGD: after its warm-up; the warm-up syncs record NaN).
    track_variance: opt-in diagnostic ``Var[W_k]`` (eq. 7) at every step, two
      extra all-reduces per step (counted apart, see
      :class:`AveragingDiagnostics`); ``V_t`` (eq. 11) goes into the trace.
    trace_length: per-sync records kept in the state (ring buffer; 0 = none); with
      ``track_variance`` also the last ``trace_length`` steps' ``Var[W_k]``
      (:func:`variance_trace`).
    flat_anchor: hold the anchor and ``outer``'s state as one flat vector each
      (``jax.flatten_util.ravel_pytree``, the idea of ``optax.flatten``) instead of one
      array per parameter leaf. A step then passes 2 arrays instead of 2 x leaves through
      its donated state; the runtime's cost per buffer is what made block momentum's local
      step 1.11x optax's on a ResNet-50-shaped tree (BENCHMARKS.md, target 1). The sync
      pays one concatenation and one split of the parameters. ``outer`` then sees one
      vector, so use it only with an elementwise ``outer`` (SGD, momentum, Nesterov, Adam),
      not a per-layer one (LARS). ``True`` needs the parameters' floating leaves to share
      one dtype (a ``ValueError`` names them otherwise); ``None``: flat where they do.
      No effect without an anchor (no ``outer`` and no ``comm_dtype``).

  Returns:
    An ``optax.GradientTransformation`` with :class:`PeriodicAveragingState`. Its
    ``update`` also carries ``update.params_step``, which returns the new parameters
    directly: :func:`mfopt.train.apply_transform` (used by the library's train step) calls it,
    so a local step runs exactly the inner optimizer's kernels (``tx.update`` +
    ``optax.apply_updates`` gives the same result with one more kernel per leaf).

  Example:
    >>> import jax.numpy as jnp, optax, mfopt
    >>> tx = mfopt.periodic_averaging(optax.sgd(0.1), None, mfopt.constant_period(2))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> int(state.param_comm.count), int(state.controller.cnt)
    (0, 1)

  Seeds: 001 Alg. 1 (CPSGD), Alg. 2 (ADPSGD), eqs. 7, 11, 16; 003 Alg. 1 (M-AVG).
  """
  _checks.transformation("inner", inner)
  _checks.transformation("outer", outer, allow_none=True)
  if _checks.is_int(period):
    period = constant_period(_checks.positive_int("period", period))
  if not isinstance(period, PeriodController):
    raise ValueError(f"period must be a PeriodController or a positive int, got {period!r}"
                     f"{_checks._array_hint(period)}")
  # a controller of your own: its fields (uses_variance="no" was read as True and added a
  # scalar all-reduce to every sync)
  if not isinstance(period.uses_variance, bool):
    raise ValueError(f"period ({period.name}): uses_variance must be a bool, got "
                     f"{period.uses_variance!r}")
  for field in ("init", "advance", "on_sync"):
    if not callable(getattr(period, field)):
      raise ValueError(f"period ({period.name}): {field} must be callable, got "
                       f"{getattr(period, field)!r}")
  if period.host_period is not None and not callable(period.host_period):
    raise ValueError(f"period ({period.name}): host_period must be callable or None, got "
                     f"{period.host_period!r}")
  axis_name = check_axis_name(axis_name)
  comm_dtype = comm_dtype_of(comm_dtype)
  _checks.nonnegative_int("trace_length", trace_length)
  controller = period
  schedule = _host_schedule(controller) if controller.host_period is not None else None
  average_inner_state = _checks.flag("average_inner_state", average_inner_state)
  track_variance = _checks.flag("track_variance", track_variance)
  sync_variance = _checks.flag("sync_variance", sync_variance, allow_none=True)
  compute_s = controller.uses_variance if sync_variance is None else sync_variance
  # S_k only from the controller's first reading (unless asked for at every sync)
  skip_s_before = controller.variance_from if sync_variance is None else 0
  if controller.uses_variance and not compute_s:
    raise ValueError(f"sync_variance=False but the controller {controller.name} needs S_k")
  # a bool or None, not 0/1 (``0 in (None, True, False)`` is true, and ``0 is False`` is not)
  flat_anchor = _checks.flag("flat_anchor", flat_anchor, allow_none=True)
  keep_anchor = outer is not None or comm_dtype is not None
  outer_tx = outer if outer is not None else optax.identity()
  communicates = axis_name is not None

  def nan():  # a fresh array each call: a closed-over one put in the state could be donated
    return jnp.full([], jnp.nan, jnp.float32)

  def is_flat(params) -> bool:
    """Whether the anchor is one flat vector: decided from the parameters' dtypes alone, so
    ``init`` and ``update`` agree without a flag in the state."""
    if not keep_anchor or flat_anchor is False:
      return False
    dtypes = {jnp.result_type(x) for x in jax.tree.leaves(params)}
    uniform = len(dtypes) == 1 and jnp.issubdtype(next(iter(dtypes)), jnp.floating)
    if flat_anchor and not uniform:
      raise ValueError("flat_anchor=True needs parameters of one floating dtype, got "
                       f"{sorted(map(str, dtypes))}; pass flat_anchor=None or False")
    return uniform

  # The layouts (the leaves' paths, shapes and dtypes, in order) of the trees init made a flat
  # anchor for. A flat anchor cannot tell a different tree of the same size: update unravelled
  # the anchor and the outer momentum into it silently (optax's tree-shaped states raise a
  # shape error). The paths leave out flax.nnx's Variable level (a ``.value`` attribute key):
  # nnx.Optimizer inits on a State of Param variables and updates with the plain arrays (same
  # leaves, another treedef), which a treedef comparison refused. Kept on the host at trace
  # time, not in the state (a field would change every checkpoint's structure), so the check
  # is partial: a state restored without an init here is not checked, and a transform
  # initialised on two trees accepts either tree's params with either state. Values: the
  # treedef, for messages.
  flat_layouts: dict = {}

  def layout(params):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    plain = lambda path: jax.tree_util.keystr(tuple(  # noqa: E731
        k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")))
    return tuple((plain(k), tuple(x.shape), jnp.result_type(x)) for k, x in leaves), treedef

  def init_fn(params):
    inner_state = inner.init(params)
    payload = tree_payload_bytes([x for x in jax.tree.leaves(params) if is_floating(x)], comm_dtype)
    if average_inner_state:
      payload += tree_payload_bytes([x for x in jax.tree.leaves(inner_state) if is_floating(x)])
    t = int(trace_length)
    # Without a trace the fields are empty tuples, not zero-size arrays (orbax
    # refuses to checkpoint zero-size arrays).
    diag = AveragingDiagnostics(
        syncs=jnp.zeros([], jnp.int32), last_sync_variance=nan(), variance=nan(),
        variance_sum=jnp.zeros([], jnp.float32), variance_exchanges=jnp.zeros([], jnp.int32),
        trace_step=jnp.zeros([t], jnp.int32) if t else (),
        trace_period=jnp.zeros([t], jnp.int32) if t else (),
        trace_sync_variance=jnp.full([t], jnp.nan, jnp.float32) if t else (),
        trace_mean_variance=jnp.full([t], jnp.nan, jnp.float32) if t else (),
        trace_lr=jnp.full([t], jnp.nan, jnp.float32) if t else (),
        trace_variance=jnp.full([t], jnp.nan, jnp.float32) if t and track_variance else ())
    # Copies, never the caller's arrays: a train step that donates its params
    # (``donate_argnums``) must not delete the anchor (optax's states never alias params).
    if is_flat(params):
      flat_layouts.setdefault(*layout(params))
      anchor = jnp.array(ravel_pytree(params)[0], copy=True)
    else:
      anchor = jax.tree.map(lambda x: jnp.array(x, copy=True), params) if keep_anchor else ()
    return PeriodicAveragingState(
        count=jnp.zeros([], jnp.int32), inner_state=inner_state,
        outer_state=outer_tx.init(anchor if keep_anchor else params),
        anchor=anchor,
        controller=controller.init(),
        param_comm=init_comm_stats(payload if communicates else 0, CollectiveKind.ALL_REDUCE),
        scalar_comm=init_comm_stats(4 if (communicates and compute_s) else 0,
                                    CollectiveKind.ALL_REDUCE),
        diagnostics=diag)

  inner_x = optax.with_extra_args_support(inner)

  def params_step(updates, state, params, norm_fn=None, **extra_args):
    """``(grads, state, params, norm_fn) -> (new_params, new_state, norm)``; see
    :func:`mfopt.train.apply_transform`."""
    if params is None:
      raise ValueError("periodic_averaging (and block_momentum, built on it) needs params in "
                       "update(updates, state, params)")
    require_bound(axis_name, "periodic_averaging (or block_momentum, built on it)")
    k = state.count  # 0-based index of this step
    ctl, due = controller.advance(state.controller)
    due = _unbatched(due, axis_name)

    diag = state.diagnostics
    if track_variance:
      mean_now = _pmean_floats(params, axis_name)
      var_k = pmean_tree(_sq_norm(jax.tree.map(_subtract, mean_now, params)), axis_name)
      diag = diag._replace(variance=var_k, variance_sum=diag.variance_sum + var_k,
                           variance_exchanges=diag.variance_exchanges + (2 if communicates else 0))
      if trace_length:
        diag = diag._replace(trace_variance=diag.trace_variance.at[k % trace_length].set(var_k))

    # Every step: the inner step, exactly as `inner` + optax.apply_updates would do it.
    # (extra arguments, e.g. optax.contrib.reduce_on_plateau's value, go to the inner optimizer)
    inner_updates, inner_state = inner_x.update(updates, state.inner_state, params, **extra_args)
    local = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, inner_updates)
    norm = norm_fn(inner_updates) if norm_fn is not None else None

    # A sync step: the averaging, in a while loop of 0 or 1 trips (comm.gated) rather than a
    # lax.cond. XLA updates a while loop's carried buffers in place, so on a local step the
    # parameters (and block momentum's anchor and outer momentum) are written once, by the
    # inner step's own kernel, and nothing else touches them. A conditional cannot alias its
    # results with the step's donated inputs: XLA copies every parameter-sized result into
    # place (or, with the update formed after it, runs one more kernel per leaf). Deviceless
    # XLA:GPU compile, ResNet-18 W=1 bf16 batch 512 for an H100 (experiments/bench_gpu_hlo.py):
    # local step 508 kernel launches with the conditional, 411 with the loop, 406 with no
    # averaging at all; block momentum 756 -> 411 (BENCHMARKS.md, target 3). XLA:CPU
    # allocates a conditional's results afresh at every execution (16,386 page faults per
    # step on 2^24 parameters); the loop's carry it does not (2).
    flat = is_flat(params)
    if flat and flat_layouts and layout(params)[0] not in flat_layouts:
      got, treedef = layout(params)
      paths = lambda lay: [k for k, *_ in lay]  # noqa: E731
      # the init tree to compare with: one with the same leaf paths if there is one
      want, init_treedef = min(flat_layouts.items(), key=lambda lay: paths(lay[0]) != paths(got))
      diff = (f"its structure is {treedef}, init's was {init_treedef}"
              if paths(got) != paths(want)
              else next(f"leaf {a[0]} is {a[1]} {a[2]}, init's was {b[1]} {b[2]}"
                        for a, b in zip(got, want) if a != b))
      raise ValueError(f"params do not match the tree init was given: {diff} (a flat anchor "
                       f"holds the values in init's order)")

    def sync_body(carry):
      local, inner_state, outer_state, anchor, ctl, param_comm, scalar_comm, diag = carry
      if flat:  # the same arithmetic on one vector; back to the tree once, at the end
        local, unravel = ravel_pytree(local)
      if comm_dtype is not None:
        delta = jax.tree.map(_subtract, local, anchor)
        mean = jax.tree.map(jnp.add, anchor, _pmean_floats(delta, axis_name, comm_dtype))
      else:
        mean = _pmean_floats(local, axis_name)
      if average_inner_state:
        inner_state = _pmean_floats(inner_state, axis_name)
      if compute_s:
        def exchange_s_k():  # (float32: _sq_norm's)
          return pmean_tree(_sq_norm(jax.tree.map(_subtract, mean, local)), axis_name)

        if skip_s_before:
          # k is the same on every worker but batched under the worker vmap, where a cond on
          # it became a select that ran the all-reduce anyway (uncounted): made unbatched
          needed = _unbatched(k >= skip_s_before, axis_name)
          s_k, exchanged = jax.lax.cond(needed, exchange_s_k, nan), needed.astype(jnp.int32)
        else:
          s_k, exchanged = exchange_s_k(), 1
        if communicates:
          scalar_comm = scalar_comm._replace(count=scalar_comm.count + exchanged)
      else:
        s_k = nan()
      if outer is not None:
        pseudo_grad = jax.tree.map(_subtract, anchor, mean)
        new_outer = outer_tx.update(pseudo_grad, outer_state, anchor)
        outer_updates, outer_state = new_outer[0], _same_dtypes(new_outer[1], outer_state)
        new_params = optax.apply_updates(anchor, outer_updates)
      else:
        new_params = mean
      if keep_anchor:
        anchor = new_params
      if flat:
        new_params = unravel(new_params)  # (a tree of one dtype: is_flat)
      steps_since = ctl.cnt
      ctl = controller.on_sync(ctl, k, s_k)
      if communicates:
        param_comm = param_comm._replace(count=param_comm.count + 1)
      # Diagnostics: V_t (eq. 11) over the steps of this round, and the trace.
      v_t = diag.variance_sum / steps_since.astype(jnp.float32) if track_variance else nan()
      if trace_length:
        i = diag.syncs % trace_length
        lr_k = (nan() if controller.learning_rate is None
                else jnp.asarray(controller.learning_rate(k), jnp.float32))
        diag = diag._replace(
            trace_step=diag.trace_step.at[i].set(k + 1),
            trace_period=diag.trace_period.at[i].set(steps_since),
            trace_sync_variance=diag.trace_sync_variance.at[i].set(s_k),
            trace_mean_variance=diag.trace_mean_variance.at[i].set(v_t),
            trace_lr=diag.trace_lr.at[i].set(lr_k))
      diag = diag._replace(syncs=diag.syncs + 1, last_sync_variance=s_k,
                           variance_sum=jnp.zeros_like(diag.variance_sum))
      return (new_params, inner_state, outer_state, anchor, ctl, param_comm, scalar_comm, diag)

    carry = (local, inner_state, state.outer_state, state.anchor, ctl, state.param_comm,
             state.scalar_comm, diag)
    carry = gated(due, sync_body, carry, owner=schedule)
    new_params, inner_state, outer_state, anchor, ctl, param_comm, scalar_comm, diag = carry
    return new_params, PeriodicAveragingState(
        count=optax.safe_increment(k), inner_state=inner_state, outer_state=outer_state,
        anchor=anchor, controller=ctl, param_comm=param_comm, scalar_comm=scalar_comm,
        diagnostics=diag), norm

  def update_fn(updates, state, params=None, **extra_args):
    new_params, state, _ = params_step(updates, state, params, **extra_args)
    return jax.tree.map(lambda n, p: _subtract(n, p).astype(p.dtype), new_params, params), state

  update_fn.params_step = params_step
  if schedule is not None:
    update_fn.host_schedule = schedule
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _host_schedule(controller: PeriodController) -> HostSchedule:
  """The sync decisions of ``controller`` replayed on the host (see :func:`mfopt.comm.static_gates`).

  Mirrors ``advance``: ``cnt += 1``; due iff ``cnt >= period in force``; a sync resets
  ``cnt`` (``on_sync``). ``tests/test_averaging.py`` checks it against the device's ``due``
  over several rounds of every built-in controller.
  """

  def read(opt_state):
    ctl = find_averaging_state(opt_state).controller
    return tuple(host_scalar(x) for x in (ctl.count, ctl.cnt, ctl.period))

  def next_(h):
    count, cnt, period = h
    now, period = controller.host_period(count, period)
    cnt += 1
    due = cnt >= now
    return due, (min(count + 1, _INT32_MAX), 0 if due else cnt, period)  # as safe_increment

  # After a sync the host reads the period again where on_sync may have changed it: ADPSGD's
  # (uses_variance), and any controller's own on_sync (a user's that changed its period
  # without uses_variance tripped fit's gate-mismatch check on the GPU default).
  reread = controller.uses_variance or controller.on_sync is not _restart_round
  return HostSchedule(read, next_, reread_after_open=reread)


def _same_dtypes(new: Any, old: Any) -> Any:
  """``new`` with each array leaf cast to ``old``'s dtype.

  The sync runs in a loop whose carry keeps its types, but an optax state may drift: an
  ``optax.inject_hyperparams`` outer optimizer with float32 hyperparameters promotes a bf16
  leaf's momentum trace to float32 (used on its own it would just keep the float32 trace). Here
  the outer state keeps the dtypes ``init`` gave it, the parameters' own.
  """
  return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") else n, new, old)


def block_momentum(inner: optax.GradientTransformation, axis_name: AxisName,
                   period: PeriodController | int, momentum: float = 0.9,
                   nesterov: bool = False, *, average_inner_state: bool = False,
                   comm_dtype: Any = None, sync_variance: bool | None = None,
                   track_variance: bool = False, trace_length: int = 0,
                   flat_anchor: bool | None = None) -> optax.GradientTransformation:
  r"""M-AVG (seed 003 Alg. 1): K local steps of ``inner``, then block momentum on the mean.

  .. math::

     a = \frac1P \sum_j w^j, \quad d = a - \tilde w, \quad v \leftarrow \mu v + d,
     \quad \tilde w \leftarrow \tilde w + v

  implemented as ``periodic_averaging(inner, axis_name, period,
  outer=optax.sgd(1.0, momentum=momentum, nesterov=nesterov))`` (the pseudo-gradient
  is ``w~ - a``, DiLoCo's sign). ``momentum=0`` is K-AVG (equal to plain
  periodic averaging up to the rounding of ``w~ + (a - w~)``). Learner-level
  momentum (the paper's conclusion) is ``inner=optax.sgd(lr, momentum=...)``. ``jax.grad``
  through ``update``: as for :func:`periodic_averaging`.

  Args:
    inner: the learners' optimizer (paper: plain SGD with step ``gamma``).
    axis_name: worker axes; ``None`` for one worker.
    period: ``K`` as an int or a :class:`PeriodController`.
    momentum: ``mu`` in [0, 1).
    nesterov: Nesterov form of the block momentum (optax's).
    average_inner_state, comm_dtype, sync_variance, track_variance, trace_length: as in
      :func:`periodic_averaging`.
    flat_anchor: as in :func:`periodic_averaging`, but default ``None`` here, so the anchor
      and the block momentum are one flat vector each wherever the parameters share one dtype.

  Spelled out rather than ``**kwargs`` so that ``optax.inject_hyperparams`` can inject
  ``momentum``: every argument that is not a number to inject must be static, e.g.
  ``optax.inject_hyperparams(block_momentum, static_args=("inner", "axis_name", "period",
  "nesterov", "trace_length"))(inner=..., axis_name=..., period=4, momentum=0.6)``
  (``trace_length`` is an integer, so inject_hyperparams would otherwise trace it).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import optax, mfopt
    >>> tx = mfopt.block_momentum(optax.sgd(0.05), mfopt.WORKER_AXES, 8, momentum=0.7)
  """
  _checks.unit_interval("momentum", momentum)
  nesterov = _checks.flag("nesterov", nesterov)
  outer = optax.sgd(1.0, momentum=momentum if _checks.is_traced(momentum) else float(momentum),
                    nesterov=nesterov)
  return periodic_averaging(inner, axis_name, period, outer=outer,
                            average_inner_state=average_inner_state, comm_dtype=comm_dtype,
                            sync_variance=sync_variance, track_variance=track_variance,
                            trace_length=trace_length, flat_anchor=flat_anchor)


# ----------------------------------------------------------------------------- reading the state


def find_averaging_state(opt_state: Any) -> PeriodicAveragingState:
  """The (first) :class:`PeriodicAveragingState` inside an optimizer state (chains included)."""
  found = states_of(opt_state, PeriodicAveragingState)
  if not found:
    raise ValueError("no PeriodicAveragingState in opt_state (is this a periodic_averaging state?)")
  return found[0]


def averaging_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars to log (worker 0 of a stacked state): period, syncs, last ``S_k``, ``C2`` samples.

  ``period`` is the period the controller holds: during ADPSGD's warm-up it still reads
  ``p_init`` while every step averages (the state does not know the warm-up length);
  :func:`sync_trace` has the periods actually run.

  For ``mfopt.train.fit(extra_metrics=...)``:
  ``{"period": lambda s: mfopt.averaging_metrics(s.opt_state)["period"]}``.
  """
  s = find_averaging_state(opt_state)

  def first(x):
    x = jnp.asarray(x)
    return x.reshape(-1)[0] if x.ndim else x

  return {"period": first(s.controller.period), "syncs": first(s.diagnostics.syncs),
          "last_sync_variance": first(s.diagnostics.last_sync_variance),
          "c2": first(s.controller.c2_sum) / jnp.maximum(first(s.controller.c2_count), 1)}


def sync_trace(opt_state: Any, worker: int = 0) -> dict[str, np.ndarray]:
  """The per-sync trace (in sync order) as NumPy arrays: step, period, S_k, V_t, lr.

  Reads ``worker`` of a worker-stacked state (all workers hold the same trace). In a
  multi-process run, where this process holds only its own workers' rows, it reads the first
  of those instead (no collective).
  Only the last ``trace_length`` syncs are kept.
  """
  s = find_averaging_state(opt_state)
  leaves = [x for x in jax.tree.leaves(s.diagnostics) if isinstance(x, jax.Array)]
  if any(not x.is_fully_addressable for x in leaves):
    d = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data)
                     if isinstance(x, jax.Array) else x, s.diagnostics)
    worker = 0
  else:
    d = jax.device_get(s.diagnostics)
  if np.asarray(d.syncs).ndim:  # worker-stacked
    d = jax.tree.map(lambda x: np.asarray(x)[worker], d)
  syncs = int(d.syncs)
  fields = {"step": d.trace_step, "period": d.trace_period, "sync_variance": d.trace_sync_variance,
            "mean_variance": d.trace_mean_variance, "lr": d.trace_lr}
  out = {}
  for name, a in fields.items():
    a = np.asarray(a, dtype=np.int32 if name in ("step", "period") else np.float32)
    if a.ndim == 0 or a.size == 0:  # no trace kept
      out[name] = a.reshape(-1)[:0]
      continue
    t = a.shape[0]
    n = min(syncs, t)
    start = (syncs - n) % t
    out[name] = np.roll(a, -start)[:n]
  return out


def variance_trace(opt_state: Any, worker: int = 0) -> dict[str, np.ndarray]:
  """The per-step ``Var[W_k]`` (eq. 7) of ``track_variance=True, trace_length=T`` as NumPy
  arrays: ``step`` (``k``, 0-based: the variance at the start of step ``k``, before its update)
  and ``variance``, for the last ``T`` steps in step order. Seed 001's eq. (9) is then
  ``sum(lr(step) * variance) / sum(lr(step))``. Reads ``worker`` as :func:`sync_trace` does.

  Raises:
    ValueError: the transform was built without ``track_variance`` or ``trace_length``.
  """
  s = find_averaging_state(opt_state)
  a, count = s.diagnostics.trace_variance, s.count
  if isinstance(a, tuple):  # the placeholder of a state without the trace (a host copy of one
    # with it holds NumPy arrays, which sync_trace reads too)
    raise ValueError("variance_trace needs periodic_averaging(..., track_variance=True, "
                     "trace_length=T) (T > 0); this state keeps no per-step variance")
  if isinstance(a, jax.Array) and not a.is_fully_addressable:
    a, count, worker = a.addressable_shards[0].data, count.addressable_shards[0].data, 0
  a, count = np.asarray(a, np.float32), np.asarray(count)
  if count.ndim:  # worker-stacked
    a, count = a[worker], count[worker]
  t, done = a.shape[0], int(count)
  n = min(done, t)
  start = (done - n) % t
  return {"step": np.arange(done - n, done, dtype=np.int64), "variance": np.roll(a, -start)[:n]}


def parameter_variance(stacked_params: Any) -> jax.Array:
  """``Var[W]`` (seed 001 eq. 7) of a worker-stacked parameter tree, computed outside the step.

  A measurement hook that needs no collective inside the train step:
  ``mean_i ||mean_j w_j - w_i||^2`` over the leading worker axis.
  """
  def one(x):
    x = x.astype(jnp.float32)
    d = x - jnp.mean(x, axis=0, keepdims=True)
    return jnp.sum(jnp.square(d).reshape(x.shape[0], -1), axis=1)
  per_worker = sum(jax.tree.leaves(jax.tree.map(one, stacked_params)))
  return jnp.mean(per_worker)
