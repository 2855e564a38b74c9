"""One generic train step for every algorithm, an evaluation step, and a training loop.

The step (``make_train_step``) is the same for synchronous, local and
block-momentum algorithms: each worker computes its loss and gradient on its own
batch, calls ``tx.update`` and applies the update. Whatever communication the
algorithm needs happens inside ``tx`` (``mfopt.sync_gradients``,
``mfopt.periodic_averaging``, ...), over :data:`mfopt.parallel.WORKER_AXES`.

How a device's workers are stacked is the step's ``lowering`` (``vmap``, ``lax.map``, a mix,
or chosen by timing; :func:`make_train_step`); the update is always ``vmap``-ed over the
worker axis, so the transforms' collectives see the same axes under every lowering.

Metrics stay on device: the step returns per-worker scalars, and :func:`fit`
fetches them every ``log_every`` steps (no host sync in the hot loop).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from mfopt import _checks
from mfopt import checkpoint as ckpt_lib
from mfopt import comm as comm_lib
from mfopt import data as data_lib
from mfopt import models as models_lib
from mfopt import parallel
from mfopt import precision as precision_lib
from mfopt import report as report_lib

LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean softmax cross-entropy in float32, and accuracy.

  Works for ``(N, C)`` logits with ``(N,)`` labels and for sequence models'
  ``(N, L, V)`` logits with ``(N, L)`` labels (language modelling: the loss is the
  mean per-token cross-entropy, ``exp(loss)`` the perplexity).
  """
  logits = logits.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  accuracy = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
  return loss, {"accuracy": accuracy}


def split_batch(global_batch: int, num_workers: int) -> int:
  """Per-worker batch for a global batch; raises unless it divides evenly."""
  _checks.positive_int("global_batch", global_batch)
  _checks.positive_int("num_workers", num_workers)
  if global_batch % num_workers:
    raise ValueError(f"global_batch must be divisible by num_workers={num_workers} "
                     f"(the per-worker batch is fixed), got {global_batch}")
  return global_batch // num_workers


class TrainState(NamedTuple):
  """Worker-stacked training state: every leaf has a leading worker axis ``W``."""

  params: Any
  model_state: Any
  opt_state: Any


def init_train_state(model, tx: optax.GradientTransformation, example_x: np.ndarray, *,
                     num_workers: int, mesh, seed: int = 0) -> TrainState:
  """Initialises identical replicas on all workers and the per-worker optimizer state.

  The model is initialised once from ``seed`` and replicated, so every worker
  starts from the same point. ``tx.init`` runs under the worker map, so a
  transform's ``init`` may use the worker axes (e.g. ``lax.axis_index``).
  """
  params, model_state = models_lib.init_model(model, jax.random.PRNGKey(seed), example_x)
  rows = parallel.process_worker_slice(num_workers, mesh)
  local = rows.stop - rows.start
  stacked = parallel.shard_workers(
      parallel.stack_workers(jax.device_get((params, model_state)), local), mesh)
  params, model_state = stacked
  opt_init = jax.jit(parallel.per_worker(tx.init, mesh, num_workers))
  return TrainState(params, model_state, opt_init(params))


LOWERINGS = ("vmap", "map", "map:K", "unroll", "gemm", "auto")


def _parse_lowering(lowering: Any) -> tuple[str, int | None]:
  """``"vmap"`` / ``"map"`` / ``"map:K"`` / ``"unroll"`` / ``"gemm"`` / ``"auto"`` -> (kind,
  lax.map batch size)."""
  if isinstance(lowering, str):
    if lowering in ("vmap", "map", "unroll", "gemm", "auto"):
      return lowering, None
    head, _, k = lowering.partition(":")
    if head == "map" and k.isdigit() and int(k) >= 1:
      return "map", int(k) if int(k) > 1 else None
  raise ValueError(f"lowering must be one of {LOWERINGS} (K a positive int), got {lowering!r}")


#: ``lowering="auto"`` times ``"unroll"`` up to this many workers per device: its program (and
#: compile) grows with W (ResNet-18 at 16 x 256 for an H100: 77 s to compile on a 2-core VM,
#: against 19 s for ``"map"``).
UNROLL_MAX_WORKERS = 16


def _auto_candidates(local: int, gemm: bool = False) -> list[str]:
  """What ``lowering="auto"`` times: ``vmap``, ``map`` and one mixed ``map:K`` (K workers
  ``vmap``-ed at a time, ``local / K`` such groups one after another), K the largest power of
  two <= sqrt(local), when that is > 1 (4 -> 2, 8 -> 2, 16 -> 4, 32 -> 4); ``unroll`` up to
  :data:`UNROLL_MAX_WORKERS`; and ``gemm`` if ``gemm`` (a model with a ``conv_impl`` field)."""
  k = 1
  while (2 * k) ** 2 <= local:
    k *= 2
  return (["vmap", "map"] + ([f"map:{k}"] if k > 1 else [])
          + (["unroll"] if local <= UNROLL_MAX_WORKERS else []) + (["gemm"] if gemm else []))


def _has_conv_impl(model) -> bool:
  return hasattr(model, "conv_impl")


def tree_norm(tree: Any, fused: bool = False) -> jax.Array:
  """Global L2 norm of ``tree`` (the ``update_norm`` metric).

  ``fused=False`` is ``optax.tree.norm`` (one sum of squares per leaf, then their sum).
  ``fused=True`` reduces the concatenation of all leaves once: XLA:GPU fuses the
  concatenation into a single reduction kernel, where the per-leaf sums are one kernel per
  leaf (H100, deviceless compilation of the ResNet-18 step at batch 512: 463 kernel launches
  with per-leaf sums, 406 fused, 402 for the plain flax + optax step without the metric; the
  same scratch memory). XLA:CPU materialises the concatenation (+8 B/param), so train steps
  use it on accelerators with one worker per device only (:func:`_fuse_norm`).
  """
  if not fused:
    return optax.tree.norm(tree)
  leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(jnp.sum(jnp.square(jnp.concatenate(leaves))))


def apply_transform(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                    norm_fn: Callable[[Any], jax.Array] | None = None):
  """One optimizer step: ``(new_params, new_opt_state, norm)``.

  For any optax transform this is ``tx.update`` then ``optax.apply_updates``, and ``norm``
  is ``norm_fn(updates)``. A transform whose ``update`` function carries a ``params_step``
  attribute (:func:`mfopt.periodic_averaging`, :func:`mfopt.block_momentum`) returns the new
  parameters itself: ``params_step(grads, opt_state, params, norm_fn) -> (new_params,
  new_opt_state, norm)``. That skips forming ``updates = new - params`` only to add them back
  (one more kernel and a parameter-sized round trip per leaf), which is what lets a local step
  of periodic averaging cost what the inner optimizer's step costs (BENCHMARKS.md, target 3).
  For those transforms ``norm`` is ``norm_fn`` of the *inner* optimizer's updates on every step,
  the averaging jump of a sync step excluded (its size is the ``S_k`` diagnostic,
  ``periodic_averaging(sync_variance=True)``). Wrapped in another transform
  (``optax.chain``, :func:`mfopt.precision.dynamic_loss_scale`) the attribute is gone and the
  plain ``update`` + ``apply_updates`` path runs: the same parameters up to rounding, but
  ``norm`` is then that of the whole update, a sync step's averaging jump included.

  ``norm`` is ``None`` without ``norm_fn``.
  """
  params_step = getattr(tx.update, "params_step", None)
  if params_step is not None:
    return params_step(grads, opt_state, params, norm_fn)
  updates, opt_state = tx.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state,
          None if norm_fn is None else norm_fn(updates))


def _fuse_norm(mesh, local_workers: int) -> bool:
  """Whether a step computes ``update_norm`` fused: on accelerators, one worker per device.

  With several workers per device the norm runs under the worker ``vmap``, where XLA:GPU
  concatenates the stacked leaves through layout copies (ResNet-18, 16 workers: 703 MB of
  copies per step against 25 kernel launches saved), so the per-leaf sums stay there.
  """
  return mesh.devices.flat[0].platform != "cpu" and local_workers == 1


def _worker_phases(model, tx: optax.GradientTransformation, loss_fn: LossFn,
                   fuse_norm: bool = False, gate: bool | None = None):
  """One worker's step in two phases: gradients (no communication) and the update.

  ``gate``: trace the transform's gates shut/open (:func:`mfopt.comm.static_gates`) and add
  ``gate_mismatch`` (how many of its gates the device would have decided otherwise) to the
  metrics; ``None``: device-side gates.
  """

  def grad_phase(params, model_state, dynamic_scale, batch):
    def loss_of(p):
      logits, new_model_state = models_lib.apply_model(model, p, model_state, batch["x"], train=True)
      loss, aux = loss_fn(logits, batch["y"])
      return loss, (aux, new_model_state)

    if dynamic_scale is None:
      (loss, (aux, new_model_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    else:
      (loss, (aux, new_model_state)), grads = precision_lib.scaled_value_and_grad(
          loss_of, dynamic_scale)(params)
    return loss, aux, new_model_state, grads

  def update_phase(params, old_model_state, new_model_state, opt_state, grads, loss, aux):
    norm_fn = lambda u: tree_norm(u, fuse_norm)  # noqa: E731
    if gate is None:
      params, opt_state, norm = apply_transform(tx, grads, opt_state, params, norm_fn)
      gate_metrics = {}
    else:
      with comm_lib.static_gates(gate, getattr(tx.update, "host_schedule", None)) as preds:
        params, opt_state, norm = apply_transform(tx, grads, opt_state, params, norm_fn)
      if not preds:
        raise ValueError(f"host gates: the transform traced no mfopt.comm.gated call that its "
                         f"host_schedule decides (none, or each owned by another schedule: "
                         f"gated(..., owner=...)), so it has nothing to decide "
                         f"(tx.update={tx.update!r})")
      gate_metrics = {"gate_mismatch": sum((jnp.asarray(p) != gate).astype(jnp.int32)
                                           for p in preds)}
    metrics = {"loss": loss, **aux, "update_norm": norm, **gate_metrics}
    if precision_lib.loss_scale_of(opt_state) is not None:
      # overflow: BN statistics kept; loss scale in the metrics
      new_model_state, extra = precision_lib.finish_step(opt_state, new_model_state,
                                                         old_model_state)
      metrics.update(extra)
    return params, new_model_state, opt_state, metrics

  return grad_phase, update_phase


def _communicating_model(model) -> bool:
  return getattr(model, "bn_axis_name", None) is not None


def make_train_step(model, tx: optax.GradientTransformation, *, mesh, num_workers: int,
                    loss_fn: LossFn = classification_loss, donate: bool = True,
                    lowering: str = "vmap", host_gates: bool | None = None):
  """Builds the worker-stacked train step ``(state, batch) -> (state, metrics)``.

  ``batch`` is ``{"x": (W, B, ...), "y": (W, B, ...)}`` sharded over workers.
  ``metrics`` maps names to per-worker arrays of shape ``(W,)`` (loss, accuracy,
  ``update_norm``), left on device. ``update_norm`` is the norm of the applied update; for
  periodic averaging and block momentum it is the inner optimizer's step on every step (see
  :func:`apply_transform`).

  Mixed precision needs no argument: the model's ``dtype`` is the compute dtype
  (``mfopt.precision.apply_policy``); if ``tx`` is wrapped by
  ``mfopt.precision.dynamic_loss_scale`` the loss is scaled by its fp16 loss scale, an
  overflowing step keeps the BN statistics, and ``loss_scale``/``overflow`` join the metrics.

  ``lowering`` says how the ``W / devices`` workers that share a device compute their
  forward/backward pass (the optimizer update is always ``vmap``-ed with the worker axis
  names, so every transform's collectives work unchanged):

  * ``"vmap"`` (default): all of a device's workers at once. ``vmap`` of per-worker weights
    lowers convolutions to grouped convolutions, which GPUs run slowly at large ``W``.
  * ``"map"``: one worker after another (``lax.map``), each a plain convolution. Not possible
    for a model whose BatchNorm communicates (``bn_axis_name`` set): raises.
  * ``"map:K"``: mixed; ``K`` workers ``vmap``-ed at a time, the groups one after another
    (``lax.map(..., batch_size=K)``).
  * ``"unroll"``: one worker after another like ``"map"``, but as ``W / devices`` copies of the
    worker's program in one straight-line program (a Python loop at trace time) instead of a
    ``lax.map`` loop: no per-iteration slicing of the stacked arrays and no loop for XLA to
    run one trip at a time, at the price of a compile that grows with ``W``. Compiled for an
    H100 (ResNet-18, 16 workers x 256): 4,589 kernel launches per step against ``"map"``'s
    6,724, and 28% fewer bytes written (BENCHMARKS.md, session 6); not yet timed on a GPU.
  * ``"gemm"``: ``vmap`` of a copy of the model whose convolutions are patches times a matrix
    (``conv_impl="gemm"``, :func:`mfopt.models.gemm_conv_general_dilated`): per-worker weights
    then meet the activations in a batched GEMM instead of a grouped convolution, at the
    memory cost of the patches. For models with a ``conv_impl`` field (CNN, ResNets).
  * ``"auto"``: ``vmap``, ``map``, one ``map:K``, ``unroll`` (up to
    :data:`UNROLL_MAX_WORKERS` workers per device) and (models with ``conv_impl``) ``gemm``
    (:func:`_auto_candidates`) are compiled on the first call and timed on a copy of the state
    (2 warm-up steps each, then 5 interleaved timed rounds); the fastest runs from then on
    (issue 8, target 4b: never below the best lowering). The returned
    :class:`AutoLoweredStep` reports ``choice``, ``timings`` and ``skipped``. With one worker
    per device, or a communicating model, there is nothing to choose and ``"vmap"`` is used
    without timing.

  With one worker per device (``num_workers == len(mesh.devices)``, e.g. one per GPU) and a
  model whose BatchNorm does not communicate, there is nothing to map: the forward/backward is
  the plain single-replica program on the device's slice and only the update is ``vmap``-ed
  (size 1), whatever ``lowering`` says, except ``"gemm"``, which still swaps the convolutions
  for patches x matmul (and needs a model with ``conv_impl``).

  All lowerings compute the same step (``tests/test_train.py`` compares them); the float
  rounding of the convolutions may differ.

  ``host_gates``: for a transform with a ``tx.update.host_schedule`` (periodic averaging,
  block momentum, ADPSGD, ``hybrid_adabound_lars``), compile the step twice, with its
  :func:`mfopt.comm.gated` sync (or LARS norms) shut and open, and let the host pick one per
  step from its copy of the schedule (:class:`HostGatedStep`). Same results (tested); a
  local step is then exactly the no-communication program, and no step waits on the device
  to decide. ``None`` (default): on for GPUs and other non-CPU backends, where the
  device-side gate blocks the host every step (H100: 1.26x step time, BENCHMARKS.md target
  3), off on CPU, where it costs nothing measurable and the second compile would.
  ``metrics`` then also holds ``gate_mismatch`` (0 unless the host's schedule disagreed with
  the device; :func:`fit` raises if it is not).
  """
  schedule = host_schedule(tx, host_gates)
  kind, _ = _parse_lowering(lowering)
  local = parallel.local_workers(num_workers, mesh)
  if kind == "gemm" and not _has_conv_impl(model):
    raise ValueError(f"lowering='gemm' needs a model with a conv_impl field (CNN, ResNet), "
                     f"got {type(model).__name__}")
  if kind in ("map", "unroll") and _communicating_model(model):
    raise ValueError(
        f"lowering={lowering!r} runs a device's workers one after another, so the model's "
        f"BatchNorm cannot communicate across them; got a model with "
        f"bn_axis_name={getattr(model, 'bn_axis_name')!r} (use lowering='vmap')")
  if kind == "auto" and not (local == 1 or _communicating_model(model)):
    return AutoLoweredStep({name: make_train_step(model, tx, mesh=mesh, num_workers=num_workers,
                                                  loss_fn=loss_fn, donate=donate,
                                                  lowering=name, host_gates=host_gates)
                            for name in _auto_candidates(local, _has_conv_impl(model))})
  if schedule is not None:
    return HostGatedStep({gate: _make_step(model, tx, mesh, num_workers, loss_fn, donate,
                                           lowering, gate) for gate in (False, True)}, schedule)
  return _make_step(model, tx, mesh, num_workers, loss_fn, donate, lowering, None)


def host_schedule(tx: optax.GradientTransformation,
                  host_gates: bool | None = None) -> comm_lib.HostSchedule | None:
  """The :class:`mfopt.comm.HostSchedule` a train step of ``tx`` replays on the host, or
  ``None`` for device-side gates. ``host_gates=None`` (the default of :func:`make_train_step`
  and :func:`fit`): the transform's ``update.host_schedule`` off CPU, ``None`` on CPU;
  ``True`` requires one; ``False``: ``None``."""
  schedule = getattr(tx.update, "host_schedule", None)
  if host_gates is None:
    return schedule if jax.default_backend() != "cpu" else None
  if host_gates and schedule is None:
    raise ValueError(f"host_gates=True needs a transform with update.host_schedule (periodic "
                     f"averaging, block momentum, ADPSGD, hybrid_adabound_lars), got "
                     f"tx.update={tx.update!r}")
  return schedule if host_gates else None


def _make_step(model, tx, mesh, num_workers: int, loss_fn: LossFn, donate: bool, lowering: str,
               gate: bool | None):
  """The jitted step of one lowering (not ``"auto"``); ``gate``: see :func:`_worker_phases`."""
  kind, map_batch = _parse_lowering(lowering)
  local = parallel.local_workers(num_workers, mesh)
  if kind == "gemm":
    model, kind = model.clone(conv_impl="gemm"), "vmap"
  if kind == "auto":
    kind = "vmap"
  grad_phase, update_phase = _worker_phases(model, tx, loss_fn, _fuse_norm(mesh, local), gate)

  def worker_step(params, model_state, opt_state, batch):
    dynamic_scale = precision_lib.loss_scale_of(opt_state)
    loss, aux, new_model_state, grads = grad_phase(params, model_state, dynamic_scale, batch)
    return update_phase(params, model_state, new_model_state, opt_state, grads, loss, aux)

  if kind == "vmap" and (local > 1 or _communicating_model(model)):
    mapped = parallel.per_worker(worker_step, mesh, num_workers)
  else:
    def on_device(params, model_state, opt_state, batch):
      # The stacked LossScaleState (or None) goes through the map; nothing else of opt_state.
      dynamic_scale = precision_lib.loss_scale_of(opt_state)
      args = (params, model_state, dynamic_scale, batch)
      if local == 1:
        # One worker per device (e.g. one per GPU): the forward/backward is the plain
        # single-replica program (no vmap of the weights: its reshapes cost ~5% of a
        # ResNet-50 step on CPU, bench_train_step); only the update is vmap-ed (size 1) for
        # the LOCAL_AXIS collectives.
        out = grad_phase(*jax.tree.map(lambda a: a[0], args))
        loss, aux, new_model_state, grads = jax.tree.map(lambda a: a[None], out)
      elif kind == "unroll":  # W copies of one worker's program, no loop
        outs = [grad_phase(*jax.tree.map(lambda a, w=w: a[w], args)) for w in range(local)]
        loss, aux, new_model_state, grads = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
      else:
        loss, aux, new_model_state, grads = jax.lax.map(lambda a: grad_phase(*a), args,
                                                        batch_size=map_batch)
      return jax.vmap(update_phase, axis_name=parallel.LOCAL_AXIS)(
          params, model_state, new_model_state, opt_state, grads, loss, aux)

    mapped = parallel.per_device(on_device, mesh, num_workers)

  def step(state: TrainState, batch):
    params, model_state, opt_state, metrics = mapped(
        state.params, state.model_state, state.opt_state, batch)
    return TrainState(params, model_state, opt_state), metrics

  return jax.jit(step, donate_argnums=(0,) if donate else ())


class HostGatedStep:
  """A train step whose :func:`mfopt.comm.gated` decisions are made on the host.

  Built by ``make_train_step(..., host_gates=True)`` (the default off CPU). It holds two
  jitted steps, traced with the transform's gates shut (``steps[False]``: the local step,
  no collective) and open (``steps[True]``), and a host copy of the schedule
  (:class:`mfopt.comm.HostSchedule`) read from the state on the first call (one small
  device-to-host transfer), again whenever the state passed in is not the one the last call
  returned (e.g. a restored checkpoint), and after every open gate of an adaptive schedule
  (ADPSGD: the period changes only at a sync). Each call then dispatches without waiting on
  the device. The metrics' ``gate_mismatch`` counts the gates whose device-side predicate
  disagreed with the host's choice; :func:`fit` raises if it is ever non-zero.

  Attributes:
    steps: ``{False: jitted local step, True: jitted gate-open step}``.
    schedule: the transform's :class:`mfopt.comm.HostSchedule`.
    opened: how many calls ran the open step.
  """

  def __init__(self, steps: Mapping[bool, Any], schedule: comm_lib.HostSchedule):
    self.steps = dict(steps)
    self.schedule = schedule
    self.opened = 0
    self._host = None
    self._last = None

  def _decide(self, state: TrainState) -> tuple[bool, Any]:
    host = self._host
    if host is None or state is not self._last:
      host = self.schedule.read(state.opt_state)
    gate, host = self.schedule.next(host)
    return bool(gate), host

  def next_gate(self, state: TrainState) -> bool:
    """The gate of the step that would run on ``state`` (a query: nothing advances)."""
    return self._decide(state)[0]

  def __call__(self, state: TrainState, batch):
    gate, host = self._decide(state)
    out = self.steps[gate](state, batch)
    self.opened += gate
    # The host copy now belongs to the output; an adaptive schedule is re-read from the
    # output after an open gate (on the next call).
    reread = gate and self.schedule.reread_after_open
    self._host, self._last = (None, None) if reread else (host, out[0])
    return out

  def lower(self, *args, **kwargs):
    """Both steps lowered; ``.compile()`` gives a :class:`HostGatedStep` of compiled steps."""
    return _HostGatedLowered(self, {g: s.lower(*args, **kwargs) for g, s in self.steps.items()})


class _HostGatedLowered:
  def __init__(self, owner: HostGatedStep, lowered: Mapping[bool, Any]):
    self.owner, self.lowered = owner, dict(lowered)

  def compile(self) -> HostGatedStep:
    return HostGatedStep({g: low.compile() for g, low in self.lowered.items()},
                         self.owner.schedule)


class AutoLoweredStep:
  """A train step that picks its lowering (``vmap``, ``map``, ``map:K``, ``unroll``, ``gemm``)
  by timing.

  Built by ``make_train_step(..., lowering="auto")``. The first call compiles every candidate
  (jitted step) for the call's shapes and runs them on one copy of the state (the caller's
  state is not touched: donation consumes only the copy; the candidates compute the same
  step, so the copy is passed from one to the next): 2 untimed steps each, then 5 rounds in
  which every candidate takes one timed step (``block_until_ready`` after each), the order
  rotating by one per round. It keeps the candidate with the smallest median. Interleaving
  matters on a shared machine: timed back to back, a load change between two candidates'
  blocks decided the choice (measured on the 2-core CI VM: at 32 workers x batch 1, blocks
  of 3 steps picked ``map`` at 84.6 ms vs ``vmap`` 101.9 ms while 15 interleaved steps
  afterwards put ``vmap`` ahead). A candidate that runs out of device memory
  (``RESOURCE_EXHAUSTED``, e.g. ``gemm``'s patches at a large batch) is dropped and named in
  ``skipped``. Later calls go straight to the chosen jitted step. In a multi-process job
  every process times its own devices and all take process 0's choice (one program
  everywhere). Setting ``choice`` beforehand (a resumed run's saved choice) skips the timing.

  Attributes:
    choice: the chosen lowering's name (``None`` before the first call).
    timings: median seconds per step of each candidate (empty before the first call).
    skipped: candidates dropped for lack of memory, with the error's first line.
    steps: the candidate jitted steps by name.
  """

  warmup: int = 2
  reps: int = 5
  clock = staticmethod(time.perf_counter)

  def __init__(self, steps: Mapping[str, Any]):
    self.steps = dict(steps)
    self.choice: str | None = None
    self.timings: dict[str, float] = {}
    self.skipped: dict[str, str] = {}

  def choose(self, state: TrainState, batch) -> str:
    """Times every candidate on ``(state, batch)`` (a copy) and records the choice."""
    if self.choice is None:
      original, state = state, jax.tree.map(jnp.copy, state)
      names = []
      for name in self.steps:
        try:
          for _ in range(self.warmup):
            state, _ = self.steps[name](state, batch)
          jax.block_until_ready(state)
          names.append(name)
        except jax.errors.JaxRuntimeError as e:
          if "RESOURCE_EXHAUSTED" not in str(e):
            raise
          self.skipped[name] = str(e).splitlines()[0]
          state = jax.tree.map(jnp.copy, original)  # the failed call may have taken the copy
      if not names:
        raise RuntimeError(f"lowering='auto': every candidate ran out of memory: {self.skipped}")
      times: dict[str, list[float]] = {name: [] for name in names}
      for r in range(self.reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
          t0 = self.clock()
          state, metrics = self.steps[name](state, batch)
          jax.block_until_ready((state, metrics))
          times[name].append(self.clock() - t0)
      self.timings = {name: float(np.median(t)) for name, t in times.items()}
      self.choice = min(self.timings, key=self.timings.get)
      if jax.process_count() > 1:  # every process must run the same program: process 0's pick
        from jax.experimental import multihost_utils  # noqa: PLC0415
        order = list(self.steps)
        self.choice = order[int(multihost_utils.broadcast_one_to_all(
            np.int32(order.index(self.choice))))]
    return self.choice

  def __call__(self, state: TrainState, batch):
    return self.steps[self.choose(state, batch)](state, batch)

  def lower(self, *args, **kwargs):
    """``jax.jit(...).lower`` of the chosen step (``"vmap"`` before the first call)."""
    return self.steps[self.choice or "vmap"].lower(*args, **kwargs)


@functools.partial(jax.jit, static_argnums=0)
def _eval_sums(model, params, model_state, x, y, mask):
  logits, _ = models_lib.apply_model(model, params, model_state, x, train=False)
  logits = logits.astype(jnp.float32)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
  m = mask.reshape(mask.shape + (1,) * (per_example.ndim - mask.ndim)).astype(jnp.float32)
  m = jnp.broadcast_to(m, per_example.shape)
  return (per_example * m).sum(), (correct * m).sum(), m.sum()


def make_eval_fn(model):
  """Jitted ``(params, model_state, x, y, mask) -> (sum_loss, sum_correct, count)`` for one model.

  Evaluation uses a single (worker-averaged) model in inference mode and reports the
  per-example softmax cross-entropy (per token for sequence models) and accuracy,
  whatever loss trained it; sums are returned so batches of different sizes combine
  exactly. The model is a static argument of one module-level jitted function, so
  every run of the same model (all algorithms of an experiment) shares one compiled
  evaluation.
  """
  return functools.partial(_eval_sums, model)


@jax.jit
def _worker_means(params, model_state):
  return parallel.worker_mean(params), parallel.worker_mean(model_state)


def averaged_model(state: TrainState) -> tuple[Any, Any]:
  """The worker-averaged parameters and model state (what evaluation uses)."""
  return _worker_means(state.params, state.model_state)


EVAL_BATCH_SIZE = 512  # examples per evaluation batch in fit


def _local_copy(a: Any) -> Any:
  """A replicated global array of a multi-process run as a copy on one local device."""
  if not isinstance(a, jax.Array) or a.is_fully_addressable:
    return a
  if a.is_fully_replicated:
    return a.addressable_data(0)
  from jax.experimental import multihost_utils
  return jax.device_put(multihost_utils.process_allgather(a, tiled=True), jax.local_devices()[0])


def evaluate(eval_fn, params, model_state, source,
             batch_size: int = EVAL_BATCH_SIZE) -> dict[str, float]:
  """Loss and accuracy of one model over a whole source (the test set).

  In a multi-process run every process evaluates a local copy of the model on every
  ``P``-th batch (it reads only those), the per-batch sums are gathered, and all
  processes add them in batch order: the same result as one process's, bit for bit,
  with the reading and evaluation split ``P`` ways. Every process must call it (the
  gather is a collective), as with any computation on the run's global arrays.
  """
  procs, me = jax.process_count(), jax.process_index()
  if procs > 1:
    params, model_state = jax.tree.map(_local_copy, (params, model_state))
  # Dispatch every batch, then fetch once: the host prepares batch i+1 while the device
  # evaluates batch i (one device_get per batch would serialise them).
  outs = [eval_fn(params, model_state, batch["x"], batch["y"], batch["mask"])
          for batch in data_lib.eval_batches(source, batch_size, shard=(me, procs))]
  sums = np.asarray(jax.device_get(outs), np.float32).reshape(-1, 3)  # per batch, as computed
  if procs > 1:
    from jax.experimental import multihost_utils
    num_batches = -(-len(source) // batch_size)
    per_proc = -(-num_batches // procs)
    mine = np.zeros((per_proc, 3), np.float32)
    mine[:len(sums)] = sums
    # batch i is row i // P of process i % P: interleave back into batch order
    sums = np.asarray(multihost_utils.process_allgather(mine)).transpose(1, 0, 2).reshape(
        -1, 3)[:num_batches]
  totals = np.zeros(3)
  for row in sums:  # batch order, float64: the same sum in any process layout
    totals += row.astype(np.float64)
  loss, correct, count = totals
  return {"test_loss": float(loss / count), "test_accuracy": float(correct / count)}


@dataclasses.dataclass
class FitResult:
  """What :func:`fit` returns: the history rows, the final summary and the final state."""

  history: list[dict[str, Any]]
  summary: dict[str, Any]
  state: TrainState


class NonFiniteError(FloatingPointError):
  """A non-finite loss or update stopped :func:`fit`.

  Attributes:
    step: the first training step (counted from 1, as history rows count) whose
      loss or update was not finite.
    workers: the worker indices on which it was not finite at that step.
    metric: which per-worker metric (``loss``, ``update_norm``, ...).
    detected_at: the step at which the run checked and stopped (within one
      logging interval of ``step``).
    checkpoint: the last good checkpoint (``"step S at PATH"``), or a sentence
      saying none was written. No state after it was saved.
  """

  def __init__(self, message: str, *, step: int, workers: list[int], metric: str,
               detected_at: int, checkpoint: str):
    super().__init__(message)
    self.step, self.workers, self.metric = step, workers, metric
    self.detected_at, self.checkpoint = detected_at, checkpoint


def check_finite(window: list[Mapping[str, Any]], first_step: int, *, detected_at: int,
                 checkpoint: str = "none (checkpointing off)") -> None:
  """Raises :class:`NonFiniteError` at the first step of ``window`` with a non-finite metric.

  Args:
    window: host-side per-step metric dicts (arrays of shape ``(W,)``), in step order.
    first_step: the step number (from 1) of ``window[0]``.
    detected_at: the step at which the check runs (for the message).
    checkpoint: the last good checkpoint, named in the message.
  """
  for i, metrics in enumerate(window):
    for name, value in metrics.items():
      value = np.asarray(value)
      if not jnp.issubdtype(value.dtype, jnp.inexact):  # bfloat16's kind is 'V', not 'f'
        continue
      value = value.astype(np.float32) if value.dtype.kind == "V" else value
      bad = np.flatnonzero(~np.isfinite(value.reshape(value.shape[0], -1)).all(axis=1)
                           if value.ndim else ~np.isfinite(value.reshape(1)))
      if bad.size:
        step = first_step + i
        workers = [int(w) for w in bad]
        raise NonFiniteError(
            f"non-finite {name} at step {step} on worker(s) {workers} (detected at step "
            f"{detected_at}); training stopped and no later state was saved; last good "
            f"checkpoint: {checkpoint}",
            step=step, workers=workers, metric=name, detected_at=detected_at,
            checkpoint=checkpoint)


@functools.lru_cache(maxsize=None)
def _replicate_fn(mesh, first_worker_only: bool):
  """Jitted copy of a tree onto every device of ``mesh`` (optionally only worker 0's row)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if first_worker_only:
    return jax.jit(lambda t: jax.tree.map(_first_row, t), out_shardings=replicated)
  return jax.jit(lambda t: t, out_shardings=replicated)


def _first_row(x):
  return x[:1] if np.ndim(x) else x


def to_host(tree: Any, mesh, first_worker_only: bool = False) -> Any:
  """``jax.device_get`` that also works for worker-sharded arrays of a multi-process run.

  In a multi-process run the tree is first replicated over ``mesh`` (one program: every
  process must call this), so every process gets every worker's rows (only worker 0's with
  ``first_worker_only``, e.g. for counters every worker holds alike; in a single-process run
  too: the shape does not depend on the process count). Loops of one's own
  (``experiments/bn_strategies.py``) read their step metrics with it, as ``fit`` does.
  """
  if jax.process_count() > 1:
    tree = _replicate_fn(mesh, first_worker_only)(tree)
  elif first_worker_only:
    tree = jax.tree.map(_first_row, tree)
  return jax.device_get(tree)


def _skipped_steps(opt_state: Any, mesh) -> int:
  """Steps that (the outermost) dynamic loss scaling skipped on worker 0 so far; 0 without."""
  scaling = comm_lib.states_of(opt_state, precision_lib.LossScaleState)
  if not scaling:
    return 0
  return int(np.asarray(to_host(scaling[0].overflows, mesh)).reshape(-1)[0])


def _comm_totals(opt_state: Any, mesh) -> dict[str, int]:
  if jax.process_count() > 1:  # worker 0's counters, replicated to every process
    opt_state = _replicate_fn(mesh, True)(opt_state)
  return comm_lib.comm_totals(opt_state)


def _fit_summary(last_row: Mapping[str, Any], *, num_steps: int, num_workers: int,
                 per_worker_batch: int, train_size: int, compile_s: float, train_s: float,
                 comm: Mapping[str, int], lowering: str | None) -> dict[str, Any]:
  global_batch = num_workers * per_worker_batch
  return {
      "final_train_loss": last_row["train_loss"],
      "final_train_accuracy": last_row.get("train_accuracy"),
      "test_loss": last_row["test_loss"],
      "test_accuracy": last_row["test_accuracy"],
      "steps": num_steps, "samples": num_steps * global_batch,
      "epochs": num_steps * global_batch / train_size,
      "num_workers": num_workers, "per_worker_batch": per_worker_batch,
      "global_batch": global_batch, "compile_s": compile_s, "train_s": train_s,
      **comm, "lowering": lowering,
  }


def diverged_summary(error: NonFiniteError, *, num_steps: int, num_workers: int,
                     per_worker_batch: int) -> dict[str, Any]:
  """The summary of a run that ``error`` stopped, with the keys of :func:`fit`'s summary.

  Experiments that sweep a grid record a diverged cell with this instead of
  aborting (a paper's table reports runs that did not converge too). The
  planned ``steps`` / ``num_workers`` / ``per_worker_batch`` / ``global_batch``
  are kept; every metric, timing, sample count and communication counter is
  ``nan`` (the run has no final value for it), ``lowering`` is ``None`` (not
  known from the error); ``diverged`` is true, ``error``
  the message's first line and ``diverged_at_step`` the first non-finite step.

  >>> from mfopt.train import NonFiniteError, diverged_summary
  >>> e = NonFiniteError("non-finite loss at step 7\\n...", step=7, workers=[0], metric="loss",
  ...                    detected_at=10, checkpoint="none")
  >>> s = diverged_summary(e, num_steps=100, num_workers=8, per_worker_batch=4)
  >>> s["global_batch"], s["diverged_at_step"], s["error"], s["test_accuracy"]
  (32, 7, 'non-finite loss at step 7', nan)
  """
  nan = math.nan
  # Built by _fit_summary so a diverged row has exactly the keys of a finished one.
  summary = _fit_summary(
      {"train_loss": nan, "train_accuracy": nan, "test_loss": nan, "test_accuracy": nan},
      num_steps=num_steps, num_workers=num_workers, per_worker_batch=per_worker_batch,
      train_size=1, compile_s=nan, train_s=nan,
      comm=dict.fromkeys(comm_lib.comm_totals(()), nan), lowering=None)
  summary.update(samples=nan, epochs=nan, diverged=True, error=str(error).splitlines()[0],
                 diverged_at_step=error.step)
  return summary


def _check_fit_objects(model, tx, dataset, mesh, learning_rate, loss_fn, extra_metrics,
                       host_gates) -> None:
  """``fit``'s object arguments, by name, before anything is built (a string model or an
  uncalled ``optax.sgd`` failed inside initialisation, a constant learning_rate only after
  the first step had compiled and run)."""
  def bad(name, want, value):
    raise ValueError(f"{name} must be {want}, got {value!r}")

  if not (hasattr(model, "init") and hasattr(model, "apply")):
    bad("model", "a Flax module (e.g. mfopt.models.get_model('mlp', num_classes=10))", model)
  _checks.transformation("tx", tx)
  if not (hasattr(dataset, "train") and hasattr(dataset, "test")):
    bad("dataset", "a mfopt.data.Dataset (e.g. mfopt.data.load('digits'))", dataset)
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    bad("mesh", "a jax.sharding.Mesh (mfopt.parallel.make_mesh()) or None", mesh)
  if learning_rate is not None and not callable(learning_rate):
    bad("learning_rate", "a schedule (a callable of the step, e.g. optax.constant_schedule(0.1)) "
        "or None; it only labels the logs", learning_rate)
  if not callable(loss_fn):
    bad("loss_fn", "a callable", loss_fn)
  if extra_metrics is not None and not (isinstance(extra_metrics, Mapping) and all(
      callable(f) for f in extra_metrics.values())):
    bad("extra_metrics", "a mapping of names to callables of the TrainState", extra_metrics)
  _checks.flag("host_gates", host_gates, allow_none=True)


def _check_outputs_fit_labels(model, example_x, example_y, dataset) -> None:
  """The model's logits against the dataset's labels, from shapes only (``jax.eval_shape``),
  before anything compiles: 3 outputs on digits' 10 classes gathered out of range and stopped
  the run with "non-finite loss at step 1", which reads as divergence, and an MLP on a token
  corpus failed inside optax with "indices and arr must have the same number of dimensions"."""
  try:
    logits = jax.eval_shape(lambda x: model.init_with_output(
        jax.random.PRNGKey(0), x, train=False)[0], example_x)
  except Exception as e:  # noqa: BLE001  (the input does not fit the model at all)
    raise ValueError(f"model {type(model).__name__} cannot take dataset {dataset.name!r}'s "
                     f"inputs of shape {tuple(np.shape(example_x))[1:]}: "
                     f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
  shape, labels = tuple(getattr(logits, "shape", ())), tuple(np.shape(example_y))
  classes = getattr(dataset, "num_classes", None)
  if shape[:-1] != labels:
    raise ValueError(
        f"model {type(model).__name__}'s outputs of shape {shape[1:]} per example do not match "
        f"dataset {dataset.name!r}'s labels of shape {labels[1:]} per example (logits need one "
        "more axis than the labels: (C,) for a class label, (L, V) for a sequence of tokens)")
  if classes is not None and shape[-1] < classes:
    raise ValueError(f"model {type(model).__name__} outputs {shape[-1]} classes but dataset "
                     f"{dataset.name!r} has num_classes={classes}; build it with "
                     f"num_classes={classes}")


MAX_STEPS_IN_FLIGHT = 8
"""How many train steps :func:`fit` lets the host dispatch ahead of the devices.

JAX dispatches asynchronously, so a loop that only syncs at its logging steps can queue
``log_every`` steps. On XLA:CPU (jaxlib 0.10.2) with several devices in one process (2, 4 and 8
tried), a queue of more than about 32 steps whose program has an in-process all-reduce
deadlocks: some devices' threads wait at the all-reduce for devices whose part was never
started, and after 40 s XLA aborts the process ("Termination timeout for `all reduce ...`
exceeded"). Measured with fit on 8 CPU devices and logging only at the end (two processes at a
time, 12000 steps): a limit of 30 (at most 31 steps queued) ran through, limits of 34 and 48
aborted (2 of 2 runs each); one process, 1000 steps, no limit, aborted in 3 of 4 runs here and 1
of 11 in a reviewer's
(``tests/test_train.py::test_fit_does_not_queue_enough_steps_to_deadlock_xla_cpu``). Without
mfopt: ``scripts/xla_cpu_deadlock_repro.py`` (a limit of 30 finished on 2, 4 and 8 devices, 40
aborted on 2 and 4). CI's crash on 2026-11-24 had this abort's signature (``test_readme``,
``log_every=50``, a loaded 2-core machine, the main thread in ``Compiled.__call__`` in ``fit``).
The host waits for a step eight back, not the last, so the devices keep queued work; on CPU this
costs nothing measurable (``experiments/bench_fit_dispatch.py``), on a GPU it is not yet
measured.
"""


def wait_for_old_steps(window: list[Any], limit: int | None = None) -> None:
  """Blocks until the step ``limit`` (default :data:`MAX_STEPS_IN_FLIGHT`, read at each call)
  places before the newest in ``window`` (its outputs, one entry per dispatched step, oldest
  first) has finished. Pass outputs that are not donated to the next step (metrics, not the
  state)."""
  limit = MAX_STEPS_IN_FLIGHT if limit is None else _checks.positive_int("limit", limit)
  if len(window) > limit:
    jax.block_until_ready(window[-1 - limit])


def fit(*, model, tx: optax.GradientTransformation, dataset: data_lib.Dataset, num_workers: int,
        per_worker_batch: int, num_steps: int, mesh=None, seed: int = 0,
        log_every: int = 50, eval_every: int | None = None,
        learning_rate: Callable[[int], float] | None = None,
        loss_fn: LossFn = classification_loss, progress: bool = True,
        desc: str | None = None, on_log: Callable[[dict[str, Any]], None] | None = None,
        extra_metrics: Mapping[str, Callable[[TrainState], Any]] | None = None,
        checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
        keep_checkpoints: int | None = None, run_info: Mapping[str, Any] | None = None,
        allow_mismatch: bool = False, checkpoint_interval_s: float | None = None,
        lowering: str | None = None, host_gates: bool | None = None) -> FitResult:
  """Trains ``model`` with ``tx`` on ``num_workers`` workers and returns history and summary.

  Every worker reads its own deterministic stream of ``per_worker_batch``
  examples per step (``mfopt.data.WorkerBatcher`` seeded by ``seed``); the global
  batch is ``num_workers * per_worker_batch``. Metrics are fetched every
  ``log_every`` steps and at the end; the test set is evaluated every
  ``eval_every`` steps (if given; a multiple of ``log_every``) and at the end, on the
  worker-averaged model. A row's ``epoch`` is ``samples / len(train)`` (SPEC.md's samples
  processed, in epochs), not the batcher's passes: each pass drops its last
  ``len(train) % global batch`` examples, so the passes run ahead of it.

  Checkpointing (``mfopt.checkpoint``): with ``checkpoint_dir`` (or inside
  ``mfopt.checkpoint.auto_checkpoint``, which the runner sets up for
  ``--workdir``), the complete state -- worker-stacked parameters, BatchNorm
  statistics, optimizer state, the step (the data position, since batches are
  stateless in the step), the history so far and the timings -- is saved every
  ``checkpoint_every`` steps and at the end. A call that finds a checkpoint
  resumes from it and produces bit-for-bit the history and parameters of an
  uninterrupted run; one that finds the final checkpoint returns its saved
  result without training.

  Numerical guard: every logging step checks each step's per-worker loss,
  accuracy and ``update_norm`` since the previous one; a non-finite value stops
  the run within one logging interval with :class:`NonFiniteError` naming the
  first bad step, the worker(s) and the last good checkpoint, which is never
  overwritten with non-finite state (saves happen only after the check).

  Args:
    mesh: the device mesh of the workers (``mfopt.parallel.make_mesh``); default
      ``mfopt.parallel.worker_mesh(num_workers)``: every device where ``num_workers`` is a
      multiple of the device count, else the largest mesh they split over evenly (6 workers
      on 8 devices: 6 devices).
    learning_rate: optional ``step -> lr`` (the schedule the transform uses), logged
      beside the metrics as ``learning_rate``: its value at the optimizer's own count of
      the last step. Steps that fp16 loss scaling skips do not advance that count, so
      with :func:`mfopt.precision.dynamic_loss_scale` it is the step minus worker 0's
      overflows so far (the optimizer runs that many steps behind the global step).
    on_log: called with every history row as soon as it exists (the runner
      appends it to ``metrics.jsonl``). After a resume, rows logged after the
      restored checkpoint by the interrupted run are logged again.
    extra_metrics: ``name -> fn(state)`` evaluated on device at log time.
    checkpoint_dir: this run's checkpoint directory (``None``: the active
      ``auto_checkpoint`` policy's next sub-directory, or no checkpointing).
    checkpoint_every: steps between checkpoints, a multiple of ``log_every``
      (default: every ``log_every`` steps).
    keep_checkpoints: checkpoints kept (>= 2 allows falling back past a corrupt one;
      default: the ``auto_checkpoint`` policy's ``keep``, else 2).
    run_info: extra JSON fields for the run's fingerprint (e.g. the algorithm
      name and its hyperparameters): a checkpoint with a different fingerprint
      is refused, naming the differing fields. The fingerprint already holds the dataset,
      the model's class and fields that differ from their defaults (``model_settings``: a
      bf16 model is not an f32 one), the workers, batch, steps, seed and logging intervals.
      ``tx`` itself is not in the fingerprint (an optax transform cannot be read back), and
      hyperparameters held in its state, e.g. ``constant_period``'s ``p`` or
      ``optax.inject_hyperparams``' values, resume with the checkpoint's values: name them
      here to have a change refused (the experiments do).
    allow_mismatch: resume from a checkpoint with a different fingerprint anyway (the
      differing fields are printed). A finished run with the same ``num_steps`` returns
      its saved result, computed with the checkpoint's values, not the new ones.
    checkpoint_interval_s: if given, a periodic checkpoint is skipped unless this
      many seconds passed since the previous save (the final one is always
      written); the runner's default is 60 s at logging steps.
    lowering: how a device's workers run their forward/backward (``"vmap"``, ``"map"``,
      ``"map:K"``, ``"unroll"``, ``"gemm"`` or ``"auto"``; see :func:`make_train_step`). ``None``
      (default): the environment variable ``MFOPT_LOWERING`` if set (so experiment scripts
      can be switched to ``auto`` on a GPU without editing their configs), else ``"vmap"``.
      The lowering that ran (for ``"auto"``, the one chosen by timing, which counts in
      ``compile_s``; ``"vmap"`` where ``"auto"`` has nothing to choose: one worker per
      device, or a model whose BatchNorm communicates) is the summary's ``lowering``. A
      resumed ``"auto"`` run keeps the choice saved in its checkpoint (no new timing, the
      same rounding as an uninterrupted run).
    host_gates: see :func:`make_train_step` (default: on off CPU for transforms with a host
      schedule). A step whose gate the host predicted wrongly raises ``RuntimeError`` at the
      next log.

  Returns:
    A :class:`FitResult`. ``summary`` holds the final train loss (mean over the
    last logging window), test loss/accuracy, the communication totals per
    worker counted by the transforms, and timings (compile excluded).

  Raises:
    NonFiniteError: a non-finite loss or update (a ``FloatingPointError``).
    mfopt.checkpoint.ConfigMismatchError: the checkpoint belongs to another run.
  """
  _check_fit_objects(model, tx, dataset, mesh, learning_rate, loss_fn, extra_metrics, host_gates)
  if keep_checkpoints is not None:
    _checks.positive_int("keep_checkpoints", keep_checkpoints)
  for name, value in (("num_workers", num_workers), ("per_worker_batch", per_worker_batch),
                      ("num_steps", num_steps), ("log_every", log_every)):
    _checks.positive_int(name, value)
  if eval_every is not None:
    _checks.positive_int("eval_every", eval_every)
    if eval_every % log_every:  # evaluations are added to logged rows
      raise ValueError(f"eval_every must be a multiple of log_every={log_every} (the test set "
                       f"is evaluated on a logged step), got {eval_every!r}")
  policy = ckpt_lib.active_policy() if checkpoint_dir is None else None
  if policy is not None:
    checkpoint_dir = policy.next_run_dir(desc)
    if checkpoint_every is None and policy.every is not None:
      # an experiment's sub-runs log at their own intervals: the policy's "every N steps"
      # becomes the first logging step at or after each N (explicit values stay strict)
      checkpoint_every = -(-policy.every // log_every) * log_every
    allow_mismatch = policy.allow_mismatch or allow_mismatch
    if keep_checkpoints is None:  # (an explicit value wins, as checkpoint_every's does)
      keep_checkpoints = policy.keep
    if checkpoint_interval_s is None:
      checkpoint_interval_s = policy.min_interval_s
  if checkpoint_every is None:
    checkpoint_every = log_every
  if not _checks.is_int(checkpoint_every) or checkpoint_every <= 0 or checkpoint_every % log_every:
    raise ValueError(f"checkpoint_every must be a positive multiple of log_every={log_every}, "
                     f"got {checkpoint_every!r}")
  if lowering is None:
    lowering = os.environ.get("MFOPT_LOWERING", "vmap")
    try:
      _parse_lowering(lowering)
    except ValueError as e:
      raise ValueError(f"environment variable MFOPT_LOWERING: {e}") from None
  # (worker_mesh: all devices where num_workers is a multiple of their count, as make_mesh()
  # was; else the largest mesh the workers split over evenly, where make_mesh() raised)
  mesh = parallel.worker_mesh(num_workers) if mesh is None else mesh
  batcher = data_lib.WorkerBatcher(dataset.train, num_workers=num_workers,
                                   per_worker_batch=per_worker_batch, seed=seed)
  rows = parallel.process_worker_slice(num_workers, mesh)

  def device_batch(step, host=None):  # host: this process's rows of the step if already read
    # Each process reads (and augments) only its own workers' rows where the source allows.
    return parallel.shard_workers(batcher.batch(step, rows) if host is None else host, mesh)

  first = batcher.batch(0, rows)
  # Worker 0's inputs initialise the model in every process (the same params everywhere even
  # if a model's init looked at the values).
  example_x = first["x"][0] if rows.start == 0 else batcher.batch(0, slice(0, 1))["x"][0]
  if loss_fn is classification_loss:
    _check_outputs_fit_labels(model, example_x, first["y"][0], dataset)
  state = init_train_state(model, tx, example_x, num_workers=num_workers, mesh=mesh, seed=seed)

  history: list[dict[str, Any]] = []
  train_s = compile_s = 0.0
  start = 0
  ckpt = saved_lowering = None
  if checkpoint_dir is not None:
    fingerprint = {"dataset": dataset.name, "train_examples": len(dataset.train),
                   "model": type(model).__name__,
                   # its fields that differ from their defaults (a bf16 model resumed an f32
                   # run's checkpoint: same shapes)
                   "model_settings": ckpt_lib.changed_settings(model), "num_workers": num_workers,
                   "per_worker_batch": per_worker_batch, "num_steps": num_steps, "seed": seed,
                   "log_every": log_every, "eval_every": eval_every, "desc": desc,
                   **dict(run_info or {})}
    ckpt = ckpt_lib.RunCheckpointer(checkpoint_dir, keep=keep_checkpoints or 2,
                                    fingerprint=fingerprint, allow_mismatch=allow_mismatch)
    restored = ckpt.restore_latest(state)
    if restored is not None:
      state, start = restored.state, restored.step
      history = restored.meta["history"]
      train_s, compile_s = restored.meta["train_s"], restored.meta["compile_s"]
      saved_lowering = restored.meta.get("lowering")
      if start > num_steps:
        ckpt.close()
        raise ValueError(f"{checkpoint_dir} holds a run at step {start}, past num_steps="
                         f"{num_steps}; use another checkpoint_dir or num_steps >= {start}")
      if restored.meta.get("summary") is not None and start == num_steps:
        ckpt.close()  # finished: return the saved result
        return FitResult(history=history, summary=restored.meta["summary"], state=state)
      # (a finished run resumed with a larger num_steps, allow_mismatch=True: trains on)

  report_lib.note_run_start(start)  # (for a metrics log under an allowed config change)
  eval_fn = make_eval_fn(model)
  if start < num_steps:
    train_step = make_train_step(model, tx, mesh=mesh, num_workers=num_workers,
                                 loss_fn=loss_fn, lowering=lowering, host_gates=host_gates)
    if isinstance(train_step, AutoLoweredStep) and saved_lowering in train_step.steps:
      train_step.choice = saved_lowering  # the interrupted run's pick: the same rounding
    t0 = time.perf_counter()
    batch = device_batch(start, first if start == 0 else None)
    if isinstance(train_step, AutoLoweredStep):  # times the candidate lowerings on a state copy
      lowering = train_step.choose(state, batch)
    elif _parse_lowering(lowering)[0] == "auto":  # nothing to choose: make_train_step runs vmap
      lowering = "vmap"
    compiled = train_step.lower(state, batch).compile()
    if start == 0:
      compile_s = time.perf_counter() - t0
  else:  # resumed at num_steps (see below): nothing to train, so no step to time or compile
    lowering = saved_lowering

  window: list[dict[str, jax.Array]] = []
  global_batch = num_workers * per_worker_batch
  last_row: dict[str, Any] = history[-1] if history else {}

  def log_row(step: int, state: TrainState, evaluate_now: bool) -> dict[str, Any]:
    fetched = to_host(window, mesh)
    check_finite(fetched, step - len(fetched) + 1, detected_at=step,
                 checkpoint=ckpt.describe_last_good() if ckpt else "none (checkpointing off)")
    per_worker = {k: np.stack([m[k] for m in fetched]) for k in fetched[0]}  # (steps, W)
    mismatch = per_worker.pop("gate_mismatch", None)
    if mismatch is not None and mismatch.any():
      bad = int(np.flatnonzero(mismatch.any(axis=-1))[0]) + step - len(fetched) + 1
      raise RuntimeError(
          f"host gates: at step {bad} the host's schedule ({type(tx).__name__} "
          f"update.host_schedule) disagreed with the device's gate predicate; the step ran the "
          f"wrong program. Pass host_gates=False to fit/make_train_step. With mfopt's own "
          f"transforms, report this. With your own code it is a likely cause: a "
          f"PeriodController whose host_period does not replay its advance/on_sync, or a "
          f"mfopt.comm.gated gate of your own without an owner, which follows the chain's "
          f"schedule (owner=<a mfopt.comm.HostSchedule of its own> keeps it on the device).")
    row: dict[str, Any] = {
        "step": step, "epoch": step * global_batch / len(dataset.train),
        "samples": step * global_batch,
    }
    for k, v in per_worker.items():
      row[f"train_{k}"] = float(v.mean())
    if learning_rate is not None:
      skipped = _skipped_steps(state.opt_state, mesh)
      row["learning_rate"] = float(learning_rate(max(step - 1 - skipped, 0)))
    row.update(_comm_totals(state.opt_state, mesh))
    for name, fn in (extra_metrics or {}).items():
      row[name] = to_host(fn(state), mesh)
      if isinstance(row[name], np.ndarray):
        row[name] = row[name].tolist()
    if evaluate_now:
      params, model_state = averaged_model(state)
      row.update(evaluate(eval_fn, params, model_state, dataset.test, EVAL_BATCH_SIZE))
    row["train_time_s"] = train_s
    return row

  def summarize(state) -> dict[str, Any]:
    return _fit_summary(last_row, num_steps=num_steps, num_workers=num_workers,
                        per_worker_batch=per_worker_batch, train_size=len(dataset.train),
                        compile_s=compile_s, train_s=train_s,
                        comm=_comm_totals(state.opt_state, mesh), lowering=lowering)

  summary = None  # the final summary, formed once (for the last checkpoint and the result)
  # disable=None: off when stderr is not a terminal (a log file got every redraw)
  bar = tqdm(total=num_steps, initial=start, desc=desc, disable=None if progress else True,
             leave=False)
  last_save = time.perf_counter()
  tick = time.perf_counter()
  try:
    if start == num_steps and "test_loss" not in last_row:
      # a mid-run save resumed with num_steps = its step (allow_mismatch): nothing to train,
      # but the final row's evaluation was never done (the summary raised KeyError); not
      # logged again (on_log had the row) and not saved (the next rerun repeats it)
      params, model_state = averaged_model(state)
      last_row = {**last_row, **evaluate(eval_fn, params, model_state, dataset.test,
                                         EVAL_BATCH_SIZE)}
      history[-1] = last_row
    for step in range(start, num_steps):
      next_batch = device_batch(step + 1) if step + 1 < num_steps else None
      state, metrics = compiled(state, batch)
      window.append(metrics)
      wait_for_old_steps(window)
      batch = next_batch
      done = step + 1
      if done % log_every == 0 or done == num_steps:
        jax.block_until_ready(state)
        train_s += time.perf_counter() - tick
        evaluate_now = done == num_steps or (eval_every is not None and done % eval_every == 0)
        last_row = log_row(done, state, evaluate_now)
        history.append(last_row)
        if on_log is not None:
          on_log(last_row)
        window = []
        bar.set_postfix(loss=f"{last_row['train_loss']:.4f}")
        # (process 0's clock decides for every process; no checkpointer: no collective)
        if ckpt is not None and (done == num_steps or (
            done % checkpoint_every == 0
            and ckpt_lib.interval_elapsed(last_save, checkpoint_interval_s))):
          last_save = time.perf_counter()
          if done == num_steps:
            summary = summarize(state)
          ckpt.save(done, state, {
              "history": history, "train_s": train_s, "compile_s": compile_s,
              "summary": summary, "lowering": lowering})
        tick = time.perf_counter()
      bar.update(1)
  finally:
    bar.close()
    if ckpt is not None:
      ckpt.close()

  if summary is None:  # no checkpointing (or nothing trained): summarise now
    summary = summarize(state)
  return FitResult(history=history, summary=summary, state=state)
