"""Server algorithms of the simulated cluster, each a small strategy object (seed 002 §5, spec §1-5).

A strategy reacts to three simulator events (see :class:`mfopt.sim.run.Simulator`):

* ``on_compute_done(sim, w)``: worker ``w`` finished its gradient
  (``sim.out[w]``: loss, gradient, step size). Parameter-server strategies push it
  over the server link (``sim.push(w)``).
* ``on_push(sim, w)``: the message of worker ``w`` reached the server
  (``sim.msg[w]``: gradient, step size, the version it was computed at).
* ``on_collective(sim)``: an all-reduce among the workers finished (all-reduce baseline).

and uses the simulator's actions: ``sim.apply(new_theta)`` (a new server
version), ``sim.send(w)`` (worker ``w`` pulls the current version over the
link and then computes), ``sim.start_compute(w)``, ``sim.block(w)``,
``sim.record_update(k)`` (every server version records its k, the workers whose gradients
or elastic exchange made it: 1 for ASP, SSP and EASGD). All strategies but :class:`KSync`
update the server with the base optimizer :class:`BaseSGD` (``optax.sgd``, learning rate
``LR * DR^epoch``, spec §5).

Strategies: :class:`ASP`, :class:`BSP`, :class:`SSP` (s = 3), :class:`DropWorker`
(keep the fastest 50 %), :class:`EASGD` (TF ElasticAverageOptimizer, moving rate
``0.9/(interval M)``), :class:`AllReduce` (synchronous ring all-reduce, no
server) and :class:`KSync` (the seed's model: adaptive k, progressive momentum,
per-worker BB steps).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mfopt import _checks
from mfopt import checkpoint as checkpoint_lib
from mfopt.sim import bb as bb_lib
from mfopt.sim import ksync as ksync_lib


# ----------------------------------------------------------------------------- base optimizer


@dataclasses.dataclass(frozen=True)
class BaseSGD:
  """The baselines' optimizer: ``optax.sgd(1, momentum)`` scaled by ``lr = LR * DR^floor(epoch)``.

  ``epoch`` = samples processed by all workers so far / N, so the decay is one
  step per epoch of data (spec §5: decay_steps not given, one epoch assumed) and
  is the same for every algorithm at equal samples. Scaling optax.sgd's update
  by ``lr`` afterwards equals a scheduled ``optax.sgd`` (its momentum trace is
  lr-free).

  Args:
    learning_rate: LR (Table 3: 0.01 / 0.1 / 0.001).
    decay_rate: DR (0.99 in Table 3); 1.0 = constant.
    momentum: None (plain SGD, default [A]) or e.g. 0.9.
  """

  learning_rate: float = 0.01
  decay_rate: float = 0.99
  momentum: float | None = None

  def __post_init__(self):
    _checks.python_scalars(self)
    _checks.number_where("learning_rate", self.learning_rate, lambda v: v > 0, "> 0")
    _checks.number_where("decay_rate", self.decay_rate, lambda v: 0 < v <= 1, "in (0, 1]")
    if self.momentum is not None:
      _checks.number_where("momentum", self.momentum, lambda v: 0 <= v < 1, "in [0, 1) or None")

  def lr(self, epoch: float) -> float:
    return float(self.learning_rate * self.decay_rate ** math.floor(epoch))

  def tx(self) -> optax.GradientTransformation:
    return optax.sgd(1.0, momentum=self.momentum)


@functools.lru_cache(maxsize=None)
def _jitted_apply(momentum: float | None):
  tx = optax.sgd(1.0, momentum=momentum)

  def apply(theta, g, state, lr):
    updates, state = tx.update(g, state, theta)
    return theta + lr * updates, state

  return jax.jit(apply)


def _base_sgd(base: Any, owner: str) -> BaseSGD:
  """``base`` if it is a :class:`BaseSGD` (``BaseSGD()`` for None), else ``ValueError``."""
  if base is None:
    return BaseSGD()
  if not isinstance(base, BaseSGD):
    hint = (f" (for a learning rate of {base!r}: {owner}(base=BaseSGD({base!r})))"
            if _checks.is_real(base) else "")
    raise ValueError(f"{owner}: base must be a mfopt.sim.BaseSGD or None, got {base!r}{hint}")
  return base


class _Optimizer:
  """Host wrapper: a jitted ``(theta, g, state, lr) -> (theta, state)`` and its plain-array state."""

  def __init__(self, base: BaseSGD, dim: int):
    self.base = base
    self._state = base.tx().init(jnp.zeros(dim, jnp.float32))
    self._treedef = jax.tree.structure(self._state)
    self._apply = _jitted_apply(base.momentum)

  def step(self, theta: np.ndarray, g: np.ndarray, epoch: float) -> np.ndarray:
    lr = np.float32(self.base.lr(epoch))
    theta, self._state = self._apply(theta, np.asarray(g, np.float32), self._state, lr)
    return np.asarray(theta)

  def state_dict(self) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(self._state)]

  def load_state_dict(self, leaves: list[np.ndarray]) -> None:
    self._state = jax.tree.unflatten(self._treedef, [jnp.asarray(x) for x in leaves])


# ----------------------------------------------------------------------------- strategy base


class Strategy:
  """Base class; subclasses override the event hooks. ``name`` labels reports."""

  name = "strategy"
  #: the per-worker BB config, or None (workers only compute gradients)
  bb: bb_lib.BBConfig | None = None
  #: True if workers exchange through the parameter server's link
  uses_server: bool = True
  #: True if pushes carry gradients of a server version (their staleness is logged)
  logs_staleness: bool = True
  #: factor on fresh gradients entering the server momentum (``1 - γ`` when dampened);
  #: workers scale the BB carry-over ``c_a`` by it too
  momentum_damping: float = 1.0

  def reset(self, sim) -> None:
    """Called once at construction, after the simulator's own state exists."""

  def on_compute_done(self, sim, w: int) -> None:
    sim.push(w)

  def on_push(self, sim, w: int) -> None:
    raise NotImplementedError

  def on_collective(self, sim) -> None:
    raise NotImplementedError

  def eval_params(self, sim) -> np.ndarray:
    return sim.theta

  def worker_params(self, sim, w: int) -> np.ndarray:
    """The parameters worker ``w`` computes its gradient on (its pulled version)."""
    return sim.versions[sim.w_version[w]]

  def state_dict(self) -> dict[str, Any]:
    return {}

  def load_state_dict(self, d: dict[str, Any]) -> None:
    del d

  def describe(self) -> str:
    return self.name

  #: constructor settings, for :meth:`settings`: a subclass with constructor arguments of its
  #: own must list them (``SETTINGS = SSP.SETTINGS + ("alpha",)``), each held as an attribute
  SETTINGS: tuple[str, ...] = ()

  def settings(self) -> dict[str, Any]:
    """Every constructor setting as JSON data (the checkpoint fingerprint of a simulated run:
    :meth:`describe` names the strategy only, e.g. ``"ASP"`` whatever its learning rate)."""
    self.check_settings()
    return {"class": type(self).__name__,
            **{k: plain_settings(getattr(self, k)) for k in self.SETTINGS}}

  def check_settings(self) -> None:
    """ValueError if the constructor takes an argument :data:`SETTINGS` does not list: a
    subclass inherited its parent's list, so a resumed run with another value of its own
    argument passed the fingerprint check and ran on with the checkpoint's."""
    try:
      params = inspect.signature(type(self).__init__).parameters.values()
    except (TypeError, ValueError):  # (no signature to read)
      return
    missing = [p.name for p in params if p.name != "self"
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in self.SETTINGS]
    if missing:
      raise ValueError(
          f"{type(self).__name__}.__init__ takes {missing} that its SETTINGS "
          f"{self.SETTINGS!r} does not list; add them (e.g. SETTINGS = "
          f"{type(self).__mro__[1].__name__}.SETTINGS + {tuple(missing)!r}) and keep each as "
          "an attribute of that name: SETTINGS are the checkpoint fingerprint of a simulated "
          "run, and an unlisted argument changed on resume went unnoticed")


# (moved to mfopt.checkpoint, where train.fit's fingerprint uses it too; kept importable here)
plain_settings = checkpoint_lib.plain_settings


class _OptStrategy(Strategy):
  """A strategy whose server applies :class:`BaseSGD`."""

  SETTINGS = ("base",)

  def __init__(self, base: BaseSGD | None = None):
    self.base = _base_sgd(base, type(self).__name__)

  def reset(self, sim) -> None:
    self.opt = _Optimizer(self.base, sim.dim)

  def _update(self, sim, g: np.ndarray) -> None:
    sim.apply(self.opt.step(sim.theta, g, sim.epoch), lr=self.base.lr(sim.epoch))

  def state_dict(self) -> dict[str, Any]:
    return {"opt": self.opt.state_dict()}

  def load_state_dict(self, d: dict[str, Any]) -> None:
    self.opt.load_state_dict(d["opt"])


# ----------------------------------------------------------------------------- ASP / SSP


class ASP(_OptStrategy):
  """Asynchronous parallel (TF async PS): every arriving gradient is applied at once.

  ``θ ← θ - η g_i(θ_v)``; the worker then pulls the newest θ. Staleness unbounded.
  """

  name = "ASP"

  def on_push(self, sim, w: int) -> None:
    self._update(sim, sim.msg[w].grad)
    sim.record_update(k=1)
    sim.send(w)


class SSP(_OptStrategy):
  """Stale synchronous parallel (Ho et al. 2013) with staleness bound ``s`` (3, spec §5).

  Gradients are applied on arrival as in ASP. A worker's clock ``c_i`` is the
  number of gradients it has pushed. After a push, worker ``i`` may start its
  next gradient (iteration ``c_i + 1``) only if ``c_i - min_j c_j <= s``, the
  spec's rule as written (§5; Ho et al.: ``s = 0`` is bulk-synchronous clocks);
  otherwise it blocks until the slowest worker catches up (then it pulls the
  newest θ). Hence at every push the pusher's ``c_i - min_j c_j <= s + 1``
  (``max_gap`` records the largest gap seen at a push; ``summary["max_gap"]``).
  """

  name = "SSP"

  SETTINGS = ("staleness", "base")

  def __init__(self, staleness: int = 3, base: BaseSGD | None = None):
    super().__init__(base)
    self.staleness = _checks.nonnegative_int("staleness", staleness)

  def reset(self, sim) -> None:
    super().reset(sim)
    self.clock = np.zeros(sim.num_workers, np.int64)
    self.blocked: list[int] = []
    self.max_gap = 0

  def _may_start(self, w: int) -> bool:
    return self.clock[w] - self.clock.min() <= self.staleness

  def on_push(self, sim, w: int) -> None:
    self._update(sim, sim.msg[w].grad)
    sim.record_update(k=1)
    self.clock[w] += 1
    self.max_gap = max(self.max_gap, int(self.clock[w] - self.clock.min()))
    still = []
    for b in self.blocked:  # FIFO over the workers blocked so far
      if self._may_start(b):
        sim.send(b)
      else:
        still.append(b)
    self.blocked = still
    if self._may_start(w):
      sim.send(w)
    else:
      self.blocked.append(w)
      sim.block(w)

  def state_dict(self):
    return {**super().state_dict(), "clock": self.clock.copy(), "blocked": list(self.blocked),
            "max_gap": self.max_gap}

  def load_state_dict(self, d):
    super().load_state_dict(d)
    self.clock = np.array(d["clock"], np.int64)
    self.blocked = [int(b) for b in d["blocked"]]
    self.max_gap = int(d["max_gap"])

  def describe(self):
    return f"SSP(s={self.staleness})"


# ----------------------------------------------------------------------------- collecting strategies


class _Collect(Strategy):
  """Synchronous collection of fresh gradients for the current version (BSP, DropWorker, KSync).

  A fresh gradient (computed at the current version t) is added to the step's
  collection and its worker waits for version t+1; when :meth:`_ready` says so
  the server updates and releases all waiting workers (each pulls θ_{t+1}). A
  stale gradient is handed to :meth:`_stale` and its worker pulls at once.
  Fresh gradients are summed in float64, so the mean does not depend on the
  arrival order beyond rounding of the final cast.
  """

  def reset(self, sim) -> None:
    self.waiting: list[int] = []
    self.sum = np.zeros(sim.dim, np.float64)

  def on_push(self, sim, w: int) -> None:
    msg = sim.msg[w]
    if msg.version == sim.version:
      self._fresh(sim, w, msg)
      self.waiting.append(w)
      sim.block(w)
      if self._ready(sim):
        self._finish_step(sim, sim.send)
    else:
      self._stale(sim, w, msg)
      sim.send(w)

  def _finish_step(self, sim, release) -> None:
    """One server update from the waiting workers' sum, then ``release`` each of them."""
    n = len(self.waiting)
    self._update(sim, n)
    sim.record_update(k=n)
    self._clear(sim)
    released, self.waiting = self.waiting, []
    for b in released:
      release(b)

  def _fresh(self, sim, w, msg) -> None:
    self.sum += msg.grad

  def _clear(self, sim) -> None:
    self.sum[:] = 0.0

  def _stale(self, sim, w, msg) -> None:
    sim.dropped += 1

  def _ready(self, sim) -> bool:
    raise NotImplementedError

  def _update(self, sim, n: int) -> None:
    raise NotImplementedError

  def state_dict(self):
    return {"waiting": list(self.waiting), "sum": self.sum.copy()}

  def load_state_dict(self, d):
    self.waiting = [int(b) for b in d["waiting"]]
    self.sum = np.array(d["sum"], np.float64)


class BSP(_Collect, _OptStrategy):
  """Bulk synchronous (TF SyncReplicasOptimizer, replicas_to_aggregate = M).

  ``θ_{t+1} = θ_t - η_t (1/M) Σ_i g_i(θ_t)``. In optimisation terms this is the
  synchronous all-reduce step; only the timing differs (server link).
  """

  name = "BSP"

  def reset(self, sim):
    _OptStrategy.reset(self, sim)
    _Collect.reset(self, sim)

  def _ready(self, sim):
    return len(self.waiting) == sim.num_workers

  def _update(self, sim, n):
    _OptStrategy._update(self, sim, (self.sum / n).astype(np.float32))

  def state_dict(self):
    return {**_Collect.state_dict(self), **_OptStrategy.state_dict(self)}

  def load_state_dict(self, d):
    _Collect.load_state_dict(self, d)
    _OptStrategy.load_state_dict(self, d)


class DropWorker(BSP):
  """Straggler dropping (Chen et al.; drop rate 50 %, spec §5): BSP over the fastest ``ceil((1-rate) M)``.

  Gradients arriving for an old version are discarded (SyncReplicasOptimizer
  with ``replicas_to_aggregate = M/2``); their workers pull the newest θ.
  """

  name = "DropWorker"

  SETTINGS = ("drop_rate", "base")

  def __init__(self, drop_rate: float = 0.5, base: BaseSGD | None = None):
    super().__init__(base)
    _checks.number_where("drop_rate", drop_rate, lambda v: 0 <= v < 1, "in [0, 1)")
    self.drop_rate = drop_rate

  def reset(self, sim):
    super().reset(sim)
    self.k = max(1, math.ceil((1 - self.drop_rate) * sim.num_workers))

  def _ready(self, sim):
    return len(self.waiting) == self.k

  def describe(self):
    return f"DropWorker(drop={self.drop_rate:g})"


@dataclasses.dataclass(frozen=True)
class KSyncConfig:
  """The seed's model (spec §1.2, §2, §4). Defaults are the spec's (the ``faithful`` preset).

  Args:
    gamma: momentum decay γ = 0.9 [A].
    dampening: ``u = γu + (1-γ)G`` and ``(1-γ)`` on stale merges (spec caution 1); off = literal [A].
    k_rule: ``"adaptive"`` (the k-test) or a fixed integer k (ablation, Figs. 13-14).
    ktest: :class:`mfopt.sim.ksync.KTestConfig`.
    stale_merge: ``"additive"`` (``u += γ^(τ-1) α_i/k_v g``, default), ``"reaverage"`` (slot v
      stays the mean of all its gradients received so far: ``u += γ^(τ-1) (α_i g - Ĝ_v)/(n_v+1)``,
      spec §1.2 option; needs one stored slot mean per version within the cutoff) or ``"drop"`` [A].
    stale_cutoff: drop stale gradients once ``γ^τ < stale_cutoff`` (None = never, default) [A].
    bb: per-worker BB config, or None to use ``lr_fallback`` (``BaseSGD`` schedule) for every α_i.
    lr_fallback: the schedule used when ``bb`` is None: a :class:`BaseSGD` (``None`` is
      refused, also with ``bb`` set, since 2026-11-25: it crashed a run with ``bb=None``).
      Only its learning rate and decay are used: KSync's momentum is ``gamma``, and
      ``lr_fallback.momentum`` is ignored (the experiments pass their baselines' BaseSGD).
    r0: the noise ratio broadcast before the first update (0) [A]. A worker's first BB step
      has no previous pull, so r0 changes nothing unless the k-rule keeps k = 1: an update of
      one gradient measures no r, and r0 stays the broadcast r for the whole run.
  Not implemented (optional in spec §1.2/§2.3): OrMo catch-up, the predictive k rule.
  With ``stale_merge="reaverage"`` and no ``stale_cutoff``, slot means are kept for
  versions with ``γ^τ >= 1e-3`` (older stale gradients are dropped).
  """

  gamma: float = 0.9
  dampening: bool = False
  k_rule: str | int = "adaptive"
  ktest: ksync_lib.KTestConfig = ksync_lib.KTestConfig()
  stale_merge: str = "additive"
  stale_cutoff: float | None = None
  bb: bb_lib.BBConfig | None = bb_lib.BBConfig()
  lr_fallback: BaseSGD = BaseSGD()
  r0: float = 0.0

  def __post_init__(self):
    _checks.python_scalars(self)
    _checks.number_where("gamma", self.gamma, lambda v: 0 <= v < 1, "in [0, 1)")
    _checks.flag("dampening", self.dampening)
    if not isinstance(self.ktest, ksync_lib.KTestConfig):
      raise ValueError(f"ktest must be a mfopt.sim.ksync.KTestConfig, got {self.ktest!r}")
    if self.bb is not None and not isinstance(self.bb, bb_lib.BBConfig):
      raise ValueError(f"bb must be a mfopt.sim.bb.BBConfig or None, got {self.bb!r}")
    if not isinstance(self.lr_fallback, BaseSGD):  # (None is not a schedule: bb=None uses it)
      raise ValueError(f"lr_fallback must be a mfopt.sim.BaseSGD, got {self.lr_fallback!r}")
    _checks.number_where("r0", self.r0, lambda v: v >= 0, "a number >= 0")
    if not (self.k_rule == "adaptive" or (_checks.is_int(self.k_rule) and self.k_rule >= 1)):
      raise ValueError(f"k_rule must be 'adaptive' or a positive integer, got {self.k_rule!r}")
    if self.stale_merge not in ("additive", "reaverage", "drop"):
      raise ValueError(f"stale_merge must be 'additive', 'reaverage' or 'drop', got {self.stale_merge!r}")
    if self.stale_cutoff is not None:
      _checks.number_where("stale_cutoff", self.stale_cutoff, lambda v: 0 < v < 1,
                           "in (0, 1) or None")


class KSync(_Collect):
  """Adaptive k-synchronisation with progressive momentum and per-worker BB steps (seed 002).

  Server (spec §4): fresh gradients enter Welford statistics and
  ``A = Σ α_i g_i``; after each with ``n >= k_min`` the k-test runs, and when it
  passes (or ``n = k_max``)::

    u ← γ u + A/n        (dampened: γ u + (1-γ) A/n)
    θ ← θ - u

  and ``k_last = n``, ``r_last = Ê/‖ḡ‖²``, ``V̂`` are broadcast with θ. A stale
  gradient computed at version ``v`` (``τ = t - v``) is merged into the momentum,
  ``u ← u + γ^(τ-1) (α_i / k_v) g`` (dampened: times ``1-γ``), so the next
  update's ``γ u`` gives it the weight ``γ^τ`` of its own iteration's slot.
  """

  name = "KSync"

  SETTINGS = ("config", "label")

  def __init__(self, config: KSyncConfig | None = None, label: str | None = None):
    if config is not None and not isinstance(config, KSyncConfig):
      hint = (f" (for the preset: mfopt.sim.ksync_preset({config!r}), or "
              f"KSync(mfopt.sim.ksync_config({config!r})))"
              if isinstance(config, str) else "")
      raise ValueError(f"KSync: config must be a mfopt.sim.KSyncConfig or None, got "
                       f"{config!r}{hint}")
    self.config = KSyncConfig() if config is None else config
    self.bb = self.config.bb
    self.label = label
    self.momentum_damping = 1.0 - self.config.gamma if self.config.dampening else 1.0

  def reset(self, sim):
    super().reset(sim)
    self._tested = None  # (n, k-test result) of _ready, for _update at the same n
    c = self.config
    if c.k_rule != "adaptive" and int(c.k_rule) > sim.num_workers:
      raise ValueError(f"k_rule={c.k_rule} is more than num_workers={sim.num_workers}: a k-sync "
                       "round cannot wait for more gradients than there are workers")
    if c.k_rule == "adaptive" and c.ktest.k_min > sim.num_workers > 1:  # (it ran as k = M;
      # one worker: k = 1 whatever k_min, the scaling experiments' reference)
      raise ValueError(f"ktest.k_min={c.ktest.k_min} is more than num_workers={sim.num_workers}: "
                       "an adaptive round cannot wait for more gradients than there are workers")
    self.k_max = (c.ktest.resolved_k_max(sim.num_workers) if c.k_rule == "adaptive"
                  else int(c.k_rule))
    self.welford = ksync_lib.Welford(sim.dim)
    self.u = np.zeros(sim.dim, np.float32)
    self.kbuf: dict[int, int] = {}
    self.slots: dict[int, np.ndarray] = {}  # version -> mean of α g received (reaverage only)
    self.test_a_fail = 0
    self.test_b_fail = 0
    self.forced = 0
    self.merged = 0
    sim.broadcast.update(k=float(c.ktest.k_min if c.k_rule == "adaptive" else self.k_max),
                         r=float(c.r0), v_hat=0.0)

  def _alpha(self, sim, msg) -> float:
    return float(msg.alpha) if self.bb is not None else self.config.lr_fallback.lr(sim.epoch)

  def _fresh(self, sim, w, msg):
    self.sum += self._alpha(sim, msg) * msg.grad.astype(np.float64)
    self.welford.add(msg.grad)

  def _ready(self, sim):
    n = len(self.waiting)
    if self.config.k_rule != "adaptive":
      return n >= self.k_max
    if n >= max(self.config.ktest.k_min, 2):
      res = ksync_lib.k_test(self.welford, self.config.ktest)
      self._tested = (n, res)  # _update reuses it: nothing is added between the two
      if res.passed:
        return True
      self.test_a_fail += int(not res.test_a)
      self.test_b_fail += int(not res.test_b)
    if n >= self.k_max:
      self.forced += 1
      return True
    return False

  def _update(self, sim, n):
    c = self.config
    g = np.float32(self.momentum_damping) * (self.sum / n).astype(np.float32)  # x 1.0 is exact
    self.u = np.float32(c.gamma) * self.u + g
    sim.apply(sim.theta - self.u, lr=float(np.mean([sim.msg[w].alpha for w in self.waiting]))
              if self.bb is not None else c.lr_fallback.lr(sim.epoch))
    self.kbuf[sim.version - 1] = n
    if c.stale_merge == "reaverage":
      self.slots[sim.version - 1] = (self.sum / n).astype(np.float32)
      horizon = self._horizon()
      for v in [v for v in self.slots if sim.version - v > horizon]:
        del self.slots[v]
    if n >= 2:
      tested = self._tested
      res = tested[1] if tested is not None and tested[0] == n else ksync_lib.k_test(
          self.welford, c.ktest)
      sim.broadcast.update(k=float(n), r=res.e_hat / max(res.grad_sq_norm, 1e-30), v_hat=res.v_hat)
    else:
      sim.broadcast.update(k=float(n))

  def _clear(self, sim):
    super()._clear(sim)
    self.welford.reset()
    self._tested = None

  def _horizon(self) -> int:
    """The largest staleness ``tau`` with ``gamma**tau >= cut``: the same test as
    :meth:`_stale`'s (``floor(log cut / log gamma)`` alone rounded 1.9999999999999998 down to 1
    at cut = gamma**2, and a slot was pruned while its gradients still merged elsewhere)."""
    cut = self.config.stale_cutoff or 1e-3
    gamma = self.config.gamma
    if not gamma > 0:
      return 1
    tau = max(int(np.floor(np.log(cut) / np.log(gamma))), 0)
    while tau > 0 and gamma ** tau < cut:
      tau -= 1
    while gamma ** (tau + 1) >= cut:
      tau += 1
    return tau

  def _stale(self, sim, w, msg):
    c = self.config
    tau = sim.version - msg.version
    v = msg.version
    if c.stale_merge == "drop" or v not in self.kbuf or (
        c.stale_cutoff is not None and c.gamma ** tau < c.stale_cutoff) or (
        c.stale_merge == "reaverage" and v not in self.slots):
      sim.dropped += 1
      return
    damp = self.momentum_damping
    if c.stale_merge == "reaverage":
      n = self.kbuf[v]
      delta = (np.float32(self._alpha(sim, msg)) * msg.grad - self.slots[v]) / np.float32(n + 1)
      self.slots[v] = self.slots[v] + delta
      self.kbuf[v] = n + 1
      self.u = self.u + np.float32(c.gamma ** (tau - 1) * damp) * delta
    else:
      scale = c.gamma ** (tau - 1) * self._alpha(sim, msg) / self.kbuf[v] * damp
      self.u = self.u + np.float32(scale) * msg.grad
    self.merged += 1

  def state_dict(self):
    return {**super().state_dict(), "welford": self.welford.state_dict(), "u": self.u.copy(),
            "kbuf": [[int(k), int(v)] for k, v in self.kbuf.items()],
            "slots": {int(k): v.copy() for k, v in self.slots.items()},
            "counters": [self.test_a_fail, self.test_b_fail, self.forced, self.merged]}

  def load_state_dict(self, d):
    super().load_state_dict(d)
    self._tested = None
    self.welford.load_state_dict(d["welford"])
    self.u = np.array(d["u"], np.float32)
    self.kbuf = {int(k): int(v) for k, v in d["kbuf"]}
    self.slots = {int(k): np.array(v, np.float32) for k, v in d["slots"].items()}
    self.test_a_fail, self.test_b_fail, self.forced, self.merged = (int(x) for x in d["counters"])

  def describe(self):
    if self.label:
      return self.label
    k = "adaptive k" if self.config.k_rule == "adaptive" else f"k={self.config.k_rule}"
    return f"KSync({k})"


# ----------------------------------------------------------------------------- all-reduce, EASGD


class AllReduce(BSP):
  """Synchronous ring all-reduce among the workers (Horovod/NCCL baseline; no server link).

  Same optimisation as :class:`BSP`; the step ends ``all_reduce_time(payload, M)``
  (cost model) after the slowest worker's gradient, and every worker then has θ_{t+1}.
  """

  name = "all-reduce"
  uses_server = False

  def on_compute_done(self, sim, w):
    self.sum += sim.out[w].grad
    self.waiting.append(w)
    sim.block(w)
    if len(self.waiting) == sim.num_workers:
      sim.start_collective()

  def on_collective(self, sim):
    def restart(b):  # all-reduce: no pull message, the worker adopts the new version at once
      sim.adopt(b, sim.version)
      sim.start_compute(b)

    self._finish_step(sim, restart)


class EASGD(Strategy):
  """Elastic averaging (TF ElasticAverageOptimizer, "EAO", spec §5).

  Each worker runs its base optimizer on its own copy ``x_i`` with the elastic term
  ``(ρ/2)‖x_i - x̃_loc‖²``, ``ρ = a/η`` (so a local step is
  ``x_i ← x_i - η g - a (x_i - x̃_loc)``; with ``base.momentum`` its own momentum on ``g``:
  ``v_i ← μ v_i + g``, ``x_i ← x_i - η v_i - a (x_i - x̃_loc)``, the elastic pull kept out of
  the momentum; the momentum was ignored before). Every ``interval`` local steps it
  pushes ``x_i``; the server sets ``x̃_loc ← x̃``, ``Δ = x_i - x̃_loc``,
  ``x̃ ← x̃ + aΔ`` and the worker continues from ``x_i - aΔ`` with the new
  ``x̃_loc`` once the pull arrives. ``a = 0.9/(interval·M)`` (TF default).
  The evaluated model is the centre ``x̃``; one server step = one exchange.
  """

  name = "EASGD"
  logs_staleness = False  # workers push their local parameters, not gradients of a version

  SETTINGS = ("interval", "base", "moving_rate")

  def __init__(self, interval: int = 20, base: BaseSGD | None = None, moving_rate: float | None = None):
    _checks.positive_int("interval", interval)
    if moving_rate is not None:
      _checks.number_where("moving_rate", moving_rate, lambda v: 0 < v <= 1, "in (0, 1]")
    self.interval = interval
    self.base = _base_sgd(base, "EASGD")
    self.moving_rate = moving_rate

  def reset(self, sim):
    m = sim.num_workers
    self.a = self.moving_rate if self.moving_rate is not None else 0.9 / (self.interval * m)
    self.local = np.tile(sim.theta, (m, 1))
    self.center_loc = np.tile(sim.theta, (m, 1))
    self.local_steps = np.zeros(m, np.int64)
    # per-worker momentum (plain SGD keeps the NumPy step: no state, no jitted call)
    self.opts = ([_Optimizer(self.base, sim.dim) for _ in range(m)]
                 if self.base.momentum is not None else None)

  def worker_params(self, sim, w):
    return self.local[w]

  def on_compute_done(self, sim, w):
    g = sim.out[w].grad
    x = self.local[w]
    elastic = np.float32(self.a) * (x - self.center_loc[w])
    if self.opts is None:
      stepped = x - np.float32(self.base.lr(sim.epoch)) * g
    else:
      stepped = self.opts[w].step(x, g, sim.epoch)
    self.local[w] = stepped - elastic
    self.local_steps[w] += 1
    if self.local_steps[w] % self.interval == 0:
      sim.push(w)
    else:
      sim.start_compute(w)

  def on_push(self, sim, w):
    center = sim.theta.copy()
    delta = self.local[w] - center
    self.center_loc[w] = center
    self.local[w] = self.local[w] - np.float32(self.a) * delta
    sim.apply(center + np.float32(self.a) * delta, lr=self.base.lr(sim.epoch))
    sim.record_update(k=1)  # one worker's elastic exchange per center version
    sim.send(w)

  def state_dict(self):
    return {"local": self.local.copy(), "center_loc": self.center_loc.copy(),
            "local_steps": self.local_steps.copy(),
            "opts": None if self.opts is None else [o.state_dict() for o in self.opts]}

  def load_state_dict(self, d):
    self.local = np.array(d["local"], np.float32)
    self.center_loc = np.array(d["center_loc"], np.float32)
    self.local_steps = np.array(d["local_steps"], np.int64)
    if self.opts is not None:
      if d.get("opts") is None:  # saved while EASGD ignored its momentum: a mixed run
        raise ValueError("EASGD: this checkpoint was written before EASGD used its base "
                         "momentum (its run so far was plain SGD); restart the run")
      for o, leaves in zip(self.opts, d["opts"]):
        o.load_state_dict(leaves)

  def describe(self):
    return f"EASGD(tau={self.interval})"
