"""The simulated parameter-server cluster: :class:`Simulator` and :func:`simulate`.

This is a *simulation*: time is a deterministic virtual clock ("simulated
time", seconds), the gradients are real. One parameter server holds θ (version
``t`` = number of server updates); M workers repeatedly pull a version, compute
a mini-batch gradient on it (jitted), and push it. Staleness arises from the
clock only: worker ``w``'s ``n``-th gradient is computed on exactly the version
it pulled, on the batch ``WorkerBatcher(train, M, b, seed).batch(n)[w]``.

Timing:

* compute: :class:`mfopt.sim.clock.ComputeModel` (speed factors, lognormal
  jitter, stragglers), stateless in ``(seed, worker, step)``; a BB worker's step
  also pays for its exact-ν gradient and Armijo loss evaluations
  (:meth:`~mfopt.sim.clock.ComputeModel.bb_extra_steps`), known once its step is
  computed, so its compute-done event is put back by that much the first time
  it fires. ``summary["compute_s_per_step"]`` is the mean drawn compute time
  per local step (speed factors and jitter are not mean-one);
* server updates and the k-test take no simulated time;
* push and pull: ``payload_bytes / bandwidth + latency`` from
  :mod:`mfopt.costmodel`, queued FIFO on the server's link
  (:class:`mfopt.sim.clock.ServerLink`, full duplex by default);
* the all-reduce baseline uses ``costmodel.all_reduce_time`` instead.

Tie-breaking: events at equal simulated times are processed in the order they
were scheduled (``(time, seq)``, FIFO); initial computes are scheduled in worker
order. A pull carries the version, and the broadcast ``k``, ``r``, ``V̂``,
current when the server *sends* it (one message, spec §4).

Batching: a worker's gradient depends only on inputs fixed when its compute
starts, so the simulator evaluates it lazily: when a compute-done event finds
its gradient missing, it computes the gradients of *all* workers currently
computing in one vmapped call (padded to a power of two rows, at most M).

Memory: a parameter version is stored once and dropped as soon as no worker,
in-flight pull, or BB history refers to it.

Checkpointing: :meth:`Simulator.state_dict` returns plain data (NumPy arrays,
numbers, lists, dicts; the event queue as a list of ``[time, seq, kind,
worker]``); :meth:`Simulator.load_state_dict` restores it into a simulator built
with the same arguments, and the continued run is bit-identical to an
uninterrupted one.

Reference: ``seeds/002_7eb60581c949cce6.txt``; ``spec/seed-002-async-ksync.md`` §4, §7.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from tqdm.auto import tqdm

from mfopt import _checks
from mfopt import checkpoint as checkpoint_lib
from mfopt import costmodel
from mfopt import data as data_lib
from mfopt import models as models_lib
from mfopt import train as train_lib
from mfopt.sim import bb as bb_lib
from mfopt.sim import clock as clock_lib
from mfopt.sim import server as server_lib

IDLE, COMPUTING, PUSHING, PULLING = 0, 1, 2, 3


@dataclasses.dataclass
class WorkerOut:
  """A worker's finished step: its loss, gradient and (BB) step size."""

  loss: float
  grad: np.ndarray
  alpha: float = float("nan")
  alpha_carry: float = float("nan")
  num_backtracks: int = 0
  hit_limit: bool = False
  bb_applied: bool = False
  had_prev: bool = True  # (BB) the worker had theta_prev and g_prev: exact nu was computable


@dataclasses.dataclass
class Msg:
  """What a worker pushes: gradient, step size and the version it was computed at."""

  grad: np.ndarray
  alpha: float
  version: int
  loss: float


@dataclasses.dataclass
class SimResult:
  """Everything a run logs (all times are simulated seconds, except ``wall_s``)."""

  strategy: str
  history: list[dict[str, Any]]
  summary: dict[str, Any]
  k_trace: list[list[float]]            # [server_step, sim_time, k]: every server version
                                        # (k = 1 for ASP, SSP and EASGD)
  staleness: dict[int, int]             # τ -> count of pushed gradients
  lr_traces: list[list[list[float]]]    # per worker: [sim_time, alpha]
  server_lr_trace: list[list[float]]    # [server_step, sim_time, lr]
  #: measured host seconds spent in :meth:`Simulator.run` over every attempt of a resumed run
  #: (NaN from a checkpoint written before it was kept): a finished run's saved result
  #: returned on a rerun had been timed as the seconds it took to load
  wall_s: float = float("nan")

  def first_reaching(self, accuracy: float) -> dict[str, Any] | None:
    """The first history row with ``test_accuracy >= accuracy`` (None if never)."""
    for row in self.history:
      if row["test_accuracy"] >= accuracy:
        return row
    return None


def flat_model(params_example):
  """``(theta0, unravel)`` of a model's parameters as one float32 vector."""
  theta, unravel = ravel_pytree(params_example)
  return np.asarray(theta, np.float32), unravel


@functools.lru_cache(maxsize=64)
def _engines(model, loss_fn, bb: bb_lib.BBConfig | None, batch_size: int, num_train: int,
             input_shape: tuple[int, ...]):
  """Jitted (plain step, BB step, eval) for a model; cached so simulators share compilations."""
  params, _ = models_lib.init_model(model, jax.random.PRNGKey(0),
                                    jnp.zeros((1,) + input_shape, jnp.float32))
  _, unravel = ravel_pytree(params)

  def loss_flat(theta, x, y):
    logits = model.apply({"params": unravel(theta)}, x, train=True)
    return loss_fn(logits, y)[0]

  plain = jax.jit(jax.vmap(jax.value_and_grad(loss_flat)))
  bb_step = None
  if bb is not None:
    bb_step = jax.jit(jax.vmap(bb_lib.make_bb_step(loss_flat, bb, batch_size=batch_size,
                                                   dataset_size=num_train)))

  def evaluate(theta, x, y):
    loss, aux = train_lib.classification_loss(
        model.apply({"params": unravel(theta)}, x, train=False), y)
    return loss, aux["accuracy"]

  return plain, bb_step, jax.jit(evaluate)


def _bucket(n: int, m: int) -> int:
  """Rows of one vmapped call: the next power of two >= n, at most M (log2(M)+1 compilations)."""
  b = 1
  while b < n:
    b *= 2
  return min(b, m)


class Simulator:
  """A deterministic simulated parameter-server cluster (see the module docstring).

  Args:
    strategy: a :mod:`mfopt.sim.server` strategy object (fresh per simulator).
    model: a flax model from :mod:`mfopt.models` without mutable state (no BatchNorm).
    dataset: a :class:`mfopt.data.Dataset`.
    num_workers: M.
    per_worker_batch: b.
    seed: data order, initialisation and compute-time draws.
    compute: :class:`mfopt.sim.clock.ComputeModel`.
    network: a :mod:`mfopt.costmodel` preset name or Link, or None (zero time).
    duplex: full-duplex server link (separate push and pull queues).
    payload_bytes: bytes of one push or pull; default the float32 parameters.
    eval_every_samples: evaluate the server model every this many samples processed (a
      positive int; a float such as ``1000.0`` is refused since 2026-11-25).
    init_params: optional flat initial parameters (default: the model initialised from ``seed``).
    loss_fn: ``(logits, labels) -> (loss, aux)``, default classification loss: the loss the
      workers train on (``train_loss``). Evaluation (``test_loss``, ``test_accuracy`` and the
      divergence check on them) is always softmax cross-entropy and accuracy, as in
      :func:`mfopt.train.make_eval_fn`, whatever loss trained the model.
  """

  def __init__(self, strategy: server_lib.Strategy, *, model, dataset: data_lib.Dataset,
               num_workers: int, per_worker_batch: int, seed: int = 0,
               compute: clock_lib.ComputeModel | None = None,
               network: str | costmodel.Link | None = "10gbit", duplex: bool = True,
               payload_bytes: float | None = None, eval_every_samples: int | None = None,
               init_params: np.ndarray | None = None, loss_fn=train_lib.classification_loss):
    if not isinstance(strategy, server_lib.Strategy):
      what = "the class" if isinstance(strategy, type) else "an object"
      raise ValueError(f"strategy must be a mfopt.sim strategy instance, e.g. mfopt.sim.ASP(), "
                       f"got {what} {strategy!r}")
    _checks.positive_int("num_workers", num_workers)
    _checks.positive_int("per_worker_batch", per_worker_batch)
    if payload_bytes is not None:
      _checks.nonnegative_number("payload_bytes", payload_bytes)
    if eval_every_samples is not None:  # (0.5, True and inf were accepted)
      _checks.positive_int("eval_every_samples", eval_every_samples)
    if compute is not None and not isinstance(compute, clock_lib.ComputeModel):
      raise ValueError(f"compute must be a mfopt.sim.ComputeModel or None, got {compute!r}")
    strategy.check_settings()  # (before anything runs, checkpointed or not)
    self.strategy = strategy
    self.model, self.dataset = model, dataset
    self.num_workers, self.batch_size, self.seed = int(num_workers), int(per_worker_batch), int(seed)
    self.compute = compute or clock_lib.ComputeModel()
    self.network = None if network is None else costmodel.link(network)
    self.link = clock_lib.ServerLink(self.network, duplex)
    self.duplex = bool(duplex)
    self.batcher = data_lib.WorkerBatcher(dataset.train, num_workers=num_workers,
                                          per_worker_batch=per_worker_batch, seed=seed)
    self.num_train = len(dataset.train)
    first = self.batcher.batch(0)
    params, model_state = models_lib.init_model(model, jax.random.PRNGKey(seed), first["x"][0])
    if model_state:
      raise ValueError(f"mfopt.sim supports models without mutable state (no BatchNorm); model "
                       f"{type(model).__name__} has collections {sorted(model_state)}")
    theta0, unravel = flat_model(params)
    self.unravel = unravel
    if init_params is not None:
      flat = np.asarray(init_params, np.float32)
      if flat.size != theta0.size:
        raise ValueError(f"init_params must hold the model's {theta0.size} parameters (flat), "
                         f"got {flat.size} values")
      theta0 = flat.reshape(theta0.shape)
    self.dim = theta0.size
    self._theta0_crc = zlib.crc32(np.ascontiguousarray(theta0, np.float32).tobytes())
    self.payload_bytes = float(4 * self.dim if payload_bytes is None else payload_bytes)
    self.eval_every_samples = eval_every_samples
    self.speeds = self.compute.speed_factors(self.num_workers, self.seed)

    self._loss_fn = loss_fn
    self._build_engines()
    self._build_eval()

    m = self.num_workers
    # ---- server and worker state (plain data) ----
    self.now = 0.0
    self.theta = theta0
    self.version = 0
    self.versions: dict[int, np.ndarray] = {0: theta0}
    self.refs: dict[int, int] = collections.defaultdict(int)
    self.w_version = np.full(m, -1, np.int64)
    self.w_prev_version = np.full(m, -1, np.int64)
    self.w_incoming = np.full(m, -1, np.int64)
    self.w_step = np.zeros(m, np.int64)
    self.w_phase = np.zeros(m, np.int8)
    self.w_computed = np.zeros(m, bool)
    self.w_bcast = np.zeros((m, 3), np.float64)  # k, r, v_hat adopted with the current version
    self.w_incoming_bcast = np.zeros((m, 3), np.float64)  # k, r, v_hat of the pull in flight
    self.w_k_grew = np.zeros(m, bool)
    self.w_extra_s = np.zeros(m, np.float64)  # BB step's extra compute, once scheduled (> 0)
    self.compute_busy = np.zeros(m, np.float64)  # simulated compute seconds of finished steps
    self.out: list[WorkerOut | None] = [None] * m
    self.msg: list[Msg | None] = [None] * m
    bb = strategy.bb
    self.alpha_carry = np.full(m, bb.alpha0 if bb else np.nan, np.float32)
    # the step each worker last pushed (its g_prev's coefficient in the server's sum; differs
    # from alpha_carry where the floor lifted the carried step)
    self.alpha_pushed = np.full(m, bb.alpha0 if bb else np.nan, np.float32)
    self.has_prev = np.zeros(m, bool)
    # whether each worker's last push was fresh: a stale one is merged into u after the version
    # the worker then pulls was built, so it is not in that s = theta - theta_prev (c_a = 0)
    self.w_push_fresh = np.ones(m, bool)
    self.g_prev = np.zeros((m, self.dim), np.float32) if bb else None
    self.broadcast = {"k": 1.0, "r": 0.0, "v_hat": 0.0}
    self.pushes = np.zeros(m, np.int64)
    self.pulls = np.zeros(m, np.int64)
    self.dropped = 0
    self.collectives = 0
    self.bb_stats = {"backtracks": 0, "hit_limit": 0, "bb_applied": 0, "steps": 0,
                     "extra_compute_s": 0.0}
    # ---- logs ----
    self.k_trace: list[list[float]] = []
    self.staleness: collections.Counter = collections.Counter()
    self.lr_traces: list[list[list[float]]] = [[] for _ in range(m)]
    self.server_lr_trace: list[list[float]] = []
    self.history: list[dict[str, Any]] = []
    self.window: list[float] = []
    self.next_eval = eval_every_samples or 0
    self.diverged_at: int | None = None  # samples at the evaluation that found a non-finite loss
    self.wall_s = 0.0  # host seconds in run(), over every attempt (SimResult.wall_s)
    self.queue = clock_lib.EventQueue()
    self._batches: dict[int, dict[str, np.ndarray]] = {}

    self._ref(0)  # the server's current version
    strategy.reset(self)
    for w in range(m):  # every worker starts from θ_0 at time 0, in worker order
      self.adopt(w, 0)
      self.start_compute(w)

  # ------------------------------------------------------------------ engines
  def _build_engines(self):
    shape = tuple(self.dataset.input_shape)
    self._plain, self._bb, self._eval = _engines(self.model, self._loss_fn, self.strategy.bb,
                                                 self.batch_size, self.num_train, shape)

  def _build_eval(self):
    test = self.dataset.test
    batch = test.get(np.arange(len(test)), None)
    self._test_x, self._test_y = jnp.asarray(batch["x"]), jnp.asarray(batch["y"])

  def evaluate(self, theta: np.ndarray | None = None) -> dict[str, float]:
    """Test loss and accuracy of ``theta`` (default: the strategy's evaluated model)."""
    theta = self.strategy.eval_params(self) if theta is None else theta
    loss, acc = jax.device_get(self._eval(theta, self._test_x, self._test_y))
    return {"test_loss": float(loss), "test_accuracy": float(acc)}

  # ------------------------------------------------------------------ derived quantities
  @property
  def samples(self) -> int:
    """Samples processed: gradients completed by all workers times b."""
    return int(self.w_step.sum()) * self.batch_size

  @property
  def epoch(self) -> float:
    return self.samples / self.num_train

  # ------------------------------------------------------------------ version bookkeeping
  def _ref(self, v: int) -> None:
    if v >= 0:
      self.refs[v] += 1

  def _unref(self, v: int) -> None:
    if v < 0:
      return
    self.refs[v] -= 1
    if self.refs[v] <= 0:
      del self.refs[v]
      if v != self.version:
        self.versions.pop(v, None)

  # ------------------------------------------------------------------ actions for strategies
  def apply(self, new_theta: np.ndarray, lr: float = float("nan")) -> None:
    """Installs ``new_theta`` as server version ``t+1``."""
    old = self.version
    self.theta = np.asarray(new_theta, np.float32)
    self.version += 1
    self.versions[self.version] = self.theta
    self._ref(self.version)
    self._unref(old)
    self.server_lr_trace.append([self.version, self.now, float(lr)])

  def record_update(self, k: int) -> None:
    self.k_trace.append([self.version, self.now, int(k)])

  def send(self, w: int) -> None:
    """Worker ``w`` pulls the current version and broadcast (over the link), then computes."""
    self.w_incoming[w] = self.version
    self.w_incoming_bcast[w] = (self.broadcast["k"], self.broadcast["r"], self.broadcast["v_hat"])
    self._ref(self.version)
    self.w_phase[w] = PULLING
    self.pulls[w] += 1
    t = self.link.transfer(self.now, self.payload_bytes, 1) if self.strategy.uses_server else self.now
    self.queue.push(t, clock_lib.PULL_ARRIVE, w)

  def push(self, w: int) -> None:
    """Worker ``w`` pushes its finished gradient to the server (over the link)."""
    o = self.out[w]
    self.msg[w] = Msg(o.grad, o.alpha, int(self.w_version[w]), o.loss)
    self.w_phase[w] = PUSHING
    self.pushes[w] += 1
    t = self.link.transfer(self.now, self.payload_bytes, 0)
    self.queue.push(t, clock_lib.PUSH_ARRIVE, w)

  def block(self, w: int) -> None:
    self.w_phase[w] = IDLE

  def adopt(self, w: int, v: int, bcast: np.ndarray | None = None) -> None:
    """Worker ``w`` now holds version ``v`` and the broadcast k, r, V̂ sent with it
    (``bcast``; default the server's current one, for a version adopted at once)."""
    old = int(self.w_version[w])
    if self.strategy.bb is not None:
      self._unref(int(self.w_prev_version[w]))
      self.w_prev_version[w] = old
    else:
      self._unref(old)
    self.w_version[w] = v
    self._ref(v)
    k_old = self.w_bcast[w, 0]
    if bcast is None:
      bcast = (self.broadcast["k"], self.broadcast["r"], self.broadcast["v_hat"])
    self.w_bcast[w] = bcast
    self.w_k_grew[w] = self.w_bcast[w, 0] > k_old

  def start_compute(self, w: int) -> None:
    self.w_phase[w] = COMPUTING
    self.w_computed[w] = False
    dt = self.compute.time(self.speeds, self.seed, w, int(self.w_step[w]))
    self.queue.push(self.now + dt, clock_lib.COMPUTE_DONE, w)

  def start_collective(self) -> None:
    dt = 0.0 if self.network is None else costmodel.all_reduce_time(
        self.payload_bytes, self.num_workers, self.network)
    self.collectives += 1
    self.queue.push(self.now + dt, clock_lib.COLLECTIVE_DONE, -1)

  # ------------------------------------------------------------------ gradients
  def _batch(self, step: int) -> dict[str, np.ndarray]:
    if step not in self._batches:
      self._batches[step] = self.batcher.batch(step)
    return self._batches[step]

  def _flush(self) -> None:
    """Computes the steps of every worker that is computing and has no result yet (one vmapped call)."""
    pending = [w for w in range(self.num_workers)
               if self.w_phase[w] == COMPUTING and not self.w_computed[w]]
    n = len(pending)
    size = _bucket(n, self.num_workers)
    rows = pending + [pending[0]] * (size - n)
    theta = np.stack([self.strategy.worker_params(self, w) for w in rows])
    x = np.stack([self._batch(int(self.w_step[w]))["x"][w] for w in rows])
    y = np.stack([self._batch(int(self.w_step[w]))["y"][w] for w in rows])
    bb = self.strategy.bb
    if bb is None:
      loss, grad = jax.device_get(self._plain(theta, x, y))
      for i, w in enumerate(pending):
        self.out[w] = WorkerOut(float(loss[i]), np.asarray(grad[i]))
    else:
      zeros = np.zeros(self.dim, np.float32)
      theta_prev = np.stack([self.versions[int(self.w_prev_version[w])]
                             if self.has_prev[w] and self.w_prev_version[w] >= 0 else zeros
                             for w in rows])
      damp = self.strategy.momentum_damping
      k = self.w_bcast[rows, 0]
      inputs = bb_lib.BBInputs(
          theta=theta, theta_prev=theta_prev, g_prev=self.g_prev[rows],
          alpha_prev=self.alpha_carry[rows],
          has_prev=self.has_prev[rows] & (self.w_prev_version[rows] >= 0),
          k=k.astype(np.float32), k_grew=self.w_k_grew[rows],
          r=self.w_bcast[rows, 1].astype(np.float32), v_hat=self.w_bcast[rows, 2].astype(np.float32),
          # g_prev entered s through the server's update scaled by the step pushed with it, if
          # it arrived fresh (a stale or dropped one is not in s)
          c_a=np.where(self.w_push_fresh[rows],
                       self.alpha_pushed[rows] * damp / np.maximum(k, 1.0), 0.0
                       ).astype(np.float32))
      o = jax.device_get(self._bb(inputs, x, y))
      for i, w in enumerate(pending):
        self.out[w] = WorkerOut(float(o.loss[i]), np.asarray(o.grad[i]), float(o.alpha[i]),
                                float(o.alpha_carry[i]), int(o.num_backtracks[i]),
                                bool(o.hit_limit[i]), bool(o.bb_applied[i]),
                                bool(inputs.has_prev[i]))
    self.w_computed[pending] = True
    low = int(self.w_step.min())
    for s in [s for s in self._batches if s < low]:
      del self._batches[s]

  def _charge_bb_extra(self, w: int) -> bool:
    """Puts a BB worker's compute-done back by its step's extra work (once); True if it did."""
    bb = self.strategy.bb
    if bb is None or self.w_extra_s[w] > 0:
      return False
    if not self.w_computed[w]:
      self._flush()
    o = self.out[w]
    # exact nu is one more gradient at theta_prev: a worker's first step has none to take
    units = self.compute.bb_extra_steps(bb.nu == "exact" and o.had_prev, 1 + o.num_backtracks)
    dt = units * self.compute.time(self.speeds, self.seed, w, int(self.w_step[w]))
    if not dt > 0:
      return False
    self.w_extra_s[w] = dt
    self.queue.push(self.now + dt, clock_lib.COMPUTE_DONE, w)
    return True

  def _finish_compute(self, w: int) -> None:
    if not self.w_computed[w]:
      self._flush()
    extra, self.w_extra_s[w] = self.w_extra_s[w], 0.0
    self.compute_busy[w] += self.compute.time(self.speeds, self.seed, w, int(self.w_step[w])) + extra
    o = self.out[w]
    self.w_step[w] += 1
    self.window.append(o.loss)
    if self.strategy.bb is not None:
      self.g_prev[w] = o.grad
      self.has_prev[w] = True
      self.alpha_carry[w] = o.alpha_carry
      self.alpha_pushed[w] = o.alpha
      self.bb_stats["steps"] += 1
      self.bb_stats["extra_compute_s"] += float(extra)
      self.bb_stats["backtracks"] += o.num_backtracks
      self.bb_stats["hit_limit"] += int(o.hit_limit)
      self.bb_stats["bb_applied"] += int(o.bb_applied)
      self.lr_traces[w].append([self.now, o.alpha])
    self.strategy.on_compute_done(self, w)

  # ------------------------------------------------------------------ event loop
  def step(self) -> bool:
    """Processes one event; returns False if the queue is empty."""
    if not len(self.queue):
      return False
    t, _, kind, w = self.queue.pop()
    self.now = t
    if kind == clock_lib.COMPUTE_DONE:
      if not self._charge_bb_extra(w):
        self._finish_compute(w)
    elif kind == clock_lib.PUSH_ARRIVE:
      if self.strategy.logs_staleness:
        self.staleness[self.version - self.msg[w].version] += 1
      self.w_push_fresh[w] = self.msg[w].version == self.version
      self.strategy.on_push(self, w)
    elif kind == clock_lib.PULL_ARRIVE:
      v = int(self.w_incoming[w])
      self.w_incoming[w] = -1
      self.adopt(w, v, self.w_incoming_bcast[w].copy())
      self._unref(v)
      self.start_compute(w)
    else:
      self.strategy.on_collective(self)
    return True

  def _row(self) -> dict[str, Any]:
    return {"server_step": self.version, "sim_time": self.now, "samples": self.samples,
            "epoch": self.epoch,
            "train_loss": float(np.mean(self.window)) if self.window else float("nan"),
            **self.evaluate()}

  def _log(self) -> dict[str, Any]:
    row = self._row()
    self.window = []
    self.history.append(row)
    return row

  def run(self, *, max_samples: int | None = None, max_server_steps: int | None = None,
          max_time: float | None = None, max_events: int | None = None, progress: bool = False,
          desc: str | None = None, on_log: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Runs events until a limit is reached (at least one limit is required); ``max_time``
    runs the events at simulated times up to and including it.

    A run whose evaluated model has a non-finite test loss at an evaluation (every
    ``eval_every_samples``) has diverged: it stops there (nothing after it would be a
    number), says so on stderr, and its summary has ``diverged`` true and
    ``diverged_at_samples``.
    """
    if all(v is None for v in (max_samples, max_server_steps, max_time, max_events)):
      raise ValueError("run needs at least one of max_samples, max_server_steps, max_time, max_events")
    # (a NaN max_time never ended the run; a negative limit returned an empty "success")
    for name, value in (("max_samples", max_samples), ("max_server_steps", max_server_steps),
                        ("max_events", max_events)):
      if value is not None:
        _checks.positive_int(name, value)
    if max_time is not None:
      _checks.number_where("max_time", max_time, lambda v: v > 0,
                           "a positive number of simulated seconds")
      frozen = self.compute.base_s == 0 and (
          self.network is None or (self.network.latency == 0 and self.payload_bytes == 0))
      if frozen and max_samples is None and max_server_steps is None:
        # every event at simulated time 0: the loop spun forever (max_events is no end:
        # run_resumable passes its chunk size, and chunked forever)
        raise ValueError("max_time: simulated time never advances here (ComputeModel base_s=0 "
                         "and no network time), so the run would never end; give max_samples "
                         "or max_server_steps")
    # disable=None: off when stderr is not a terminal (a log file got every redraw)
    started = time.perf_counter()
    try:
      self._run(max_samples, max_server_steps, max_time, max_events, progress, desc, on_log)
    finally:
      self.wall_s += time.perf_counter() - started

  def _run(self, max_samples, max_server_steps, max_time, max_events, progress, desc,
           on_log) -> None:
    bar = tqdm(total=max_samples, initial=self.samples, desc=desc,
               disable=None if progress else True, leave=False, unit="samples")
    done_samples = self.samples
    events = 0
    while self.diverged_at is None:
      if ((max_samples is not None and self.samples >= max_samples)
          or (max_server_steps is not None and self.version >= max_server_steps)
          # events up to max_time, none after (checking now alone ran one event past it)
          or (max_time is not None and self.queue.next_time() > max_time)
          or (max_events is not None and events >= max_events)):
        break
      if not self.step():
        # No event left and no limit reached: every worker waits on the server, which waits
        # on them. The run used to end here as if finished (a strategy whose on_push never
        # sent a worker the model stopped after one round, at 64 of 4,000 samples).
        bar.close()
        raise RuntimeError(
            f"simulation stalled: no event is left at {self.samples} samples, server version "
            f"{self.version}, simulated time {self.now:.6g} s, before any limit was reached; "
            f"every worker is waiting. Strategy {self.strategy.describe()!r} must eventually "
            "release each worker it holds (sim.send(w) after a push, or a collective)")
      events += 1
      if self.eval_every_samples and self.samples >= self.next_eval:
        # the next multiple past the samples: one interval at a time fell behind when a step
        # adds more than an interval, and sample-less events (arrivals) logged again
        self.next_eval = (self.samples // self.eval_every_samples + 1) * self.eval_every_samples
        row = self._log()
        if on_log is not None:
          on_log(row)
        if not np.isfinite(row["test_loss"]):
          self.diverged_at = self.samples
          print(f"{desc or self.strategy.describe()}: diverged (non-finite test loss after "
                f"{self.samples} samples); simulation stopped", file=sys.stderr)
      if self.samples != done_samples:
        bar.update(self.samples - done_samples)
        done_samples = self.samples
    bar.close()

  # ------------------------------------------------------------------ results
  def result(self) -> SimResult:
    """The logs so far, with a final evaluation appended if the last row is not current.

    It changes nothing: called between two ``run`` calls, it appended that row to the run's
    own history and emptied the train-loss window, so the rest of the curve changed. A row is
    current when it has this sample count and this server version: samples are counted when a
    gradient is computed, applied later, so a run stopped by server steps or time had reported
    an older model's loss and accuracy (logged at the same sample count) as its final ones."""
    history = list(self.history)
    if (not history or history[-1]["samples"] != self.samples
        or history[-1]["server_step"] != self.version):
      history.append(self._row())
    util = self.link.utilisation(self.now)
    staleness = dict(sorted(self.staleness.items()))
    total = sum(staleness.values())
    ks = [k for _, _, k in self.k_trace]
    s = self.strategy
    summary = {
        "strategy": s.describe(), "num_workers": self.num_workers,
        "per_worker_batch": self.batch_size, "server_steps": self.version,
        "worker_steps": self.w_step.tolist(), "samples": self.samples, "epochs": self.epoch,
        "sim_time_s": self.now,
        "compute_s_per_step": (float(self.compute_busy.sum() / self.w_step.sum())
                               if self.w_step.sum() else float("nan")),
        "test_accuracy": history[-1]["test_accuracy"],
        "test_loss": history[-1]["test_loss"],
        "final_train_loss": history[-1]["train_loss"],
        "pushes_per_worker": float(self.pushes.mean()), "pulls_per_worker": float(self.pulls.mean()),
        # bytes a worker moves over its link (pushed + pulled; an all-reduce counts its payload
        # once, the library's convention) and the payload it sends (its pushes), which is what
        # train.fit's counters report for the all-reduce rows beside these
        "bytes_per_worker": float((self.pushes + self.pulls).mean() * self.payload_bytes)
        if s.uses_server else float(self.collectives * self.payload_bytes),
        "bytes_sent_per_worker": float(self.pushes.mean() * self.payload_bytes)
        if s.uses_server else float(self.collectives * self.payload_bytes),
        "exchanges_per_worker": float((self.pushes + self.pulls).mean()) if s.uses_server
        else float(self.collectives),
        "payload_bytes": self.payload_bytes,
        "link_utilisation_push": util["push"], "link_utilisation_pull": util["pull"],
        "network": None if self.network is None else self.network.name,
        "mean_staleness": (sum(k * v for k, v in staleness.items()) / total) if total else 0.0,
        "max_staleness": max(staleness) if staleness else 0,
        "mean_k": float(np.mean(ks)) if ks else float("nan"),
        "dropped_gradients": self.dropped,
        "versions_stored": len(self.versions),
        "diverged": self.diverged_at is not None or not np.isfinite(history[-1]["test_loss"]),
        "diverged_at_samples": self.diverged_at,
    }
    if s.bb is not None:
      summary.update({f"bb_{k}": v for k, v in self.bb_stats.items()})
      summary["alpha_mean_final"] = float(np.nanmean(self.alpha_carry))
    for attr in ("test_a_fail", "test_b_fail", "forced", "merged", "max_gap"):
      if hasattr(s, attr):
        summary[attr] = getattr(s, attr)
    return SimResult(s.describe(), history, summary, [list(r) for r in self.k_trace],
                     staleness, [list(t) for t in self.lr_traces],
                     [list(r) for r in self.server_lr_trace], wall_s=self.wall_s)

  # ------------------------------------------------------------------ checkpointing
  def state_dict(self) -> dict[str, Any]:
    """All mutable state as plain data (NumPy arrays, numbers, lists, dicts)."""
    def as_dict(o):  # an Outcome or Message dataclass, or None
      return None if o is None else dataclasses.asdict(o)

    return {
        "now": self.now, "theta": self.theta.copy(), "version": self.version,
        "versions": {int(k): v.copy() for k, v in self.versions.items()},
        "refs": {int(k): int(v) for k, v in self.refs.items()},
        "w_version": self.w_version.copy(), "w_prev_version": self.w_prev_version.copy(),
        "w_incoming": self.w_incoming.copy(), "w_step": self.w_step.copy(),
        "w_phase": self.w_phase.copy(), "w_computed": self.w_computed.copy(),
        "w_bcast": self.w_bcast.copy(), "w_k_grew": self.w_k_grew.copy(),
        "w_incoming_bcast": self.w_incoming_bcast.copy(),
        "w_extra_s": self.w_extra_s.copy(), "compute_busy": self.compute_busy.copy(),
        "out": [as_dict(o) for o in self.out], "msg": [as_dict(m) for m in self.msg],
        "alpha_carry": self.alpha_carry.copy(), "alpha_pushed": self.alpha_pushed.copy(),
        "has_prev": self.has_prev.copy(), "w_push_fresh": self.w_push_fresh.copy(),
        "g_prev": None if self.g_prev is None else self.g_prev.copy(),
        "broadcast": dict(self.broadcast), "pushes": self.pushes.copy(), "pulls": self.pulls.copy(),
        "dropped": self.dropped, "collectives": self.collectives, "bb_stats": dict(self.bb_stats),
        "k_trace": [list(r) for r in self.k_trace], "staleness": dict(self.staleness),
        "lr_traces": [[list(r) for r in t] for t in self.lr_traces],
        "server_lr_trace": [list(r) for r in self.server_lr_trace],
        "history": [dict(r) for r in self.history], "window": list(self.window),
        "next_eval": self.next_eval, "diverged_at": self.diverged_at, "wall_s": self.wall_s,
        "queue": self.queue.state_dict(),
        "link": self.link.state_dict(), "strategy": self.strategy.state_dict(),
    }

  def fingerprint(self) -> dict[str, Any]:
    """Every setting of this simulator that changes its results, as JSON data:
    :func:`mfopt.checkpoint.run_resumable` checks a checkpoint against it (given no fingerprint
    of its own), so a checkpoint directory written with another compute model, network,
    strategy, seed, learning rate, dataset, model or initial parameters is refused instead of
    resumed (it was resumed, or its finished result returned)."""
    return {"strategy": self.strategy.describe(), "settings": self.strategy.settings(),
            "num_workers": self.num_workers, "per_worker_batch": self.batch_size,
            "seed": self.seed, "dataset": getattr(self.dataset, "name", None),
            "train_examples": self.num_train,
            "model": {"class": type(self.model).__name__,
                      **server_lib.plain_settings(self.model)},
            "init_params_crc32": self._theta0_crc,
            "loss_fn": server_lib.plain_settings(self._loss_fn),
            "network": server_lib.plain_settings(self.network),
            "compute": server_lib.plain_settings(self.compute), "duplex": self.duplex,
            "payload_bytes": self.payload_bytes, "eval_every_samples": self.eval_every_samples}

  def load_state_dict(self, d: Mapping[str, Any]) -> None:
    """Restores :meth:`state_dict` output into a simulator built with the same arguments."""
    self.now = float(d["now"])
    self.version = int(d["version"])
    self.versions = {int(k): np.array(v, np.float32) for k, v in d["versions"].items()}
    self.theta = self.versions[self.version]
    self.refs = collections.defaultdict(int, {int(k): int(v) for k, v in d["refs"].items()})
    for name in ("w_version", "w_prev_version", "w_incoming", "w_step", "w_phase", "w_computed",
                 "w_bcast", "w_k_grew", "w_incoming_bcast", "w_extra_s", "compute_busy",
                 "alpha_carry", "has_prev", "pushes", "pulls"):
      setattr(self, name, np.array(d[name], getattr(self, name).dtype))
    self.out = [None if o is None else WorkerOut(**{**o, "grad": np.array(o["grad"], np.float32)})
                for o in d["out"]]
    self.msg = [None if m is None else Msg(**{**m, "grad": np.array(m["grad"], np.float32)})
                for m in d["msg"]]
    # (checkpoints written before alpha_pushed existed: the carried step, what c_a used then)
    self.alpha_pushed = np.array(d.get("alpha_pushed", d["alpha_carry"]), np.float32)
    # (checkpoints written before w_push_fresh existed: every push counted as fresh then)
    self.w_push_fresh = np.array(d.get("w_push_fresh", np.ones_like(self.has_prev)), bool)
    self.g_prev = None if d["g_prev"] is None else np.array(d["g_prev"], np.float32)
    self.broadcast = dict(d["broadcast"])
    self.dropped, self.collectives = int(d["dropped"]), int(d["collectives"])
    self.bb_stats = dict(d["bb_stats"])
    self.wall_s = float(d.get("wall_s", float("nan")))  # (not kept before 2026-11-26)
    self.k_trace = [list(r) for r in d["k_trace"]]
    self.staleness = collections.Counter({int(k): int(v) for k, v in d["staleness"].items()})
    self.lr_traces = [[list(r) for r in t] for t in d["lr_traces"]]
    self.server_lr_trace = [list(r) for r in d["server_lr_trace"]]
    self.history = [dict(r) for r in d["history"]]
    self.window = list(d["window"])
    self.next_eval = d["next_eval"]
    self.diverged_at = d.get("diverged_at")  # absent in checkpoints written before it existed
    self.queue = clock_lib.EventQueue.from_state_dict(d["queue"])
    self.link.load_state_dict(d["link"])
    self.strategy.load_state_dict(d["strategy"])
    self._batches = {}


def simulate(strategy: server_lib.Strategy, *, model, dataset: data_lib.Dataset, num_workers: int,
             per_worker_batch: int, max_samples: int | None = None,
             max_server_steps: int | None = None, max_time: float | None = None,
             seed: int = 0, compute: clock_lib.ComputeModel | None = None,
             network: str | costmodel.Link | None = "10gbit", duplex: bool = True,
             payload_bytes: float | None = None, eval_every_samples: int | None = None,
             progress: bool = False, desc: str | None = None,
             on_log: Callable[[dict[str, Any]], None] | None = None) -> SimResult:
  """Runs one simulated training and returns its :class:`SimResult` (simulated time).

  Inside :func:`mfopt.checkpoint.auto_checkpoint` (every experiment the runner starts), the run
  checkpoints like a ``train.fit`` call: into the policy's next run directory, every
  :data:`CHECKPOINT_CHUNK_EVENTS` events (the policy's ``every``, when set: the runner's
  ``--checkpoint-every N`` counts simulator events here) once the policy's interval passed, and at the end
  (:func:`mfopt.checkpoint.run_resumable`). A rerun resumes it bit for bit; a finished one
  returns its saved result.

  Example::

    ds = mfopt.data.load("mnist1d")
    res = mfopt.sim.simulate(mfopt.sim.ASP(mfopt.sim.BaseSGD(0.05)), model=get_model("mlp"),
                             dataset=ds, num_workers=8, per_worker_batch=16, max_samples=20_000)
    res.summary["sim_time_s"], res.staleness
  """
  sim = Simulator(strategy, model=model, dataset=dataset, num_workers=num_workers,
                  per_worker_batch=per_worker_batch, seed=seed, compute=compute, network=network,
                  duplex=duplex, payload_bytes=payload_bytes, eval_every_samples=eval_every_samples)
  # Every setting that changes the result is in the checkpoint fingerprint (the strategy's name
  # alone let a run with another learning rate or compute model resume an earlier one's
  # checkpoints); Strategy.SETTINGS names constructor settings, which reset leaves alone.
  settings = strategy.settings()
  limits = dict(max_samples=max_samples, max_server_steps=max_server_steps, max_time=max_time)
  policy = checkpoint_lib.active_policy()
  if policy is None:
    sim.run(**limits, progress=progress, desc=desc, on_log=on_log)
  else:
    checkpoint_lib.run_resumable(
        sim, policy.next_run_dir(desc or strategy.describe()),
        # --checkpoint-every N: every N simulator events (it was ignored here)
        chunk_events=policy.every or CHECKPOINT_CHUNK_EVENTS, keep=policy.keep,
        allow_mismatch=policy.allow_mismatch, min_interval_s=policy.min_interval_s,
        fingerprint={"strategy": strategy.describe(), "settings": settings,
                     "num_workers": num_workers, "per_worker_batch": per_worker_batch,
                     "seed": seed, "dataset": getattr(dataset, "name", None),
                     "train_examples": len(dataset.train),
                     "model": {"class": type(model).__name__,
                               **server_lib.plain_settings(model)},
                     "network": None if sim.network is None else sim.network.name,
                     "compute": server_lib.plain_settings(sim.compute), "duplex": duplex,
                     "payload_bytes": server_lib.plain_settings(sim.payload_bytes),
                     "eval_every_samples": eval_every_samples},
        **limits, progress=progress, desc=desc, on_log=on_log)
  return sim.result()


CHECKPOINT_CHUNK_EVENTS = 2000  # simulated events between checkpoint opportunities
