"""Virtual clock of the simulated cluster: event queue, worker compute times, the server link.

Everything here is host-side Python/NumPy and *simulated time* (seconds on a
virtual clock); nothing is measured.

Tie-breaking rule (documented and tested): events are ordered by
``(time, seq)`` where ``seq`` is a global counter incremented every time an
event is scheduled. Events at the same simulated instant are therefore
processed in the order in which they were *scheduled* (FIFO). The initial
compute of the workers is scheduled in worker-id order, so with equal speeds
and zero communication, simultaneous arrivals are served in worker-id order.

Compute times are stateless functions of ``(seed, worker, local step)``
(``np.random.default_rng([seed, 7, worker, step])``), so a resumed simulation
draws exactly the times an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from mfopt import _checks, costmodel

# Event kinds (small ints so the queue is plain data).
COMPUTE_DONE = 0   # a worker finished computing its gradient
PUSH_ARRIVE = 1    # a worker's message reached the server
PULL_ARRIVE = 2    # the server's parameters reached a worker
COLLECTIVE_DONE = 3  # an all-reduce among the workers finished (all-reduce baseline)
EVENT_NAMES = ("compute_done", "push_arrive", "pull_arrive", "collective_done")


class EventQueue:
  """A deterministic priority queue of ``(time, seq, kind, worker)`` tuples.

  ``seq`` is the scheduling order; it breaks ties between equal times (FIFO).
  The queue is plain data: :meth:`state_dict` / :meth:`from_state_dict`.
  """

  def __init__(self):
    self._heap: list[tuple[float, int, int, int]] = []
    self._seq = 0

  def push(self, time: float, kind: int, worker: int) -> None:
    heapq.heappush(self._heap, (float(time), self._seq, int(kind), int(worker)))
    self._seq += 1

  def pop(self) -> tuple[float, int, int, int]:
    return heapq.heappop(self._heap)

  def next_time(self) -> float:
    """Time of the next event (``inf`` if none)."""
    return self._heap[0][0] if self._heap else float("inf")

  def __len__(self) -> int:
    return len(self._heap)

  def state_dict(self) -> dict[str, Any]:
    return {"events": [list(e) for e in sorted(self._heap)], "seq": self._seq}

  @classmethod
  def from_state_dict(cls, d: dict[str, Any]) -> "EventQueue":
    q = cls()
    q._heap = [(float(t), int(s), int(k), int(w)) for t, s, k, w in d["events"]]
    heapq.heapify(q._heap)
    q._seq = int(d["seq"])
    return q


@dataclasses.dataclass(frozen=True)
class ComputeModel:
  """Simulated time of one worker gradient step.

  ``time(w, n) = base_s * speed[w] * exp(jitter_sigma * z) * (straggler_slowdown if straggle)``
  with ``z ~ N(0, 1)`` and ``straggle ~ Bernoulli(straggler_prob)``, both drawn
  from ``np.random.default_rng([seed, 7, w, n])`` (``n`` = the worker's local step).

  A Barzilai-Borwein worker (seed 002's model) does more than one gradient per step, and is
  charged for it: :meth:`bb_extra_steps` gradient steps more, drawn with the same factors
  (spec §3.1: ``nu="exact"`` needs ``∇L_{D_t}(θ_{t-1})``, each Armijo trial one loss
  evaluation). The spec calls the first "one extra backward pass"; it needs its own forward at
  ``θ_{t-1}`` on the current batch, so it is charged as a whole gradient step.

  Args:
    base_s: simulated seconds of one gradient step on a speed-1 worker.
    speeds: per-worker speed *factors* (multiply the time; > 1 is slower); ``None``
      draws them from ``speed_spread``.
    speed_spread: if ``speeds`` is None, ``speed[w] = exp(speed_spread * z_w)``
      with ``z_w ~ N(0,1)`` from ``default_rng([seed, 11])`` (0 -> equal speeds).
    jitter_sigma: lognormal jitter of each step (0 -> deterministic).
    straggler_prob, straggler_slowdown: occasional slow steps.
    forward_cost: one loss evaluation (a forward pass) in gradient steps; 1/3 by the usual
      rule that a backward pass costs two forwards. ``0`` (with ``extra_gradient_cost=0``)
      charges BB workers nothing extra, as before this was modelled.
    extra_gradient_cost: the exact-ν gradient at ``θ_{t-1}``, in gradient steps (1).
  """

  base_s: float = 0.01
  speeds: Sequence[float] | None = None
  speed_spread: float = 0.0
  jitter_sigma: float = 0.0
  straggler_prob: float = 0.0
  straggler_slowdown: float = 1.0
  forward_cost: float = 1.0 / 3.0
  extra_gradient_cost: float = 1.0

  def __post_init__(self):
    _checks.python_scalars(self)
    w = _checks.number_where  # finite real scalars only (a string or inf used to slip through)
    for name in ("base_s", "speed_spread", "jitter_sigma", "forward_cost", "extra_gradient_cost"):
      w(name, getattr(self, name), lambda v: v >= 0, ">= 0")
    w("straggler_prob", self.straggler_prob, lambda v: 0 <= v <= 1, "in [0, 1]")
    w("straggler_slowdown", self.straggler_slowdown, lambda v: v >= 1, ">= 1")
    if self.speeds is not None:  # (a bare 2.0 raised "not iterable"; inf was accepted)
      if isinstance(self.speeds, str) or np.ndim(self.speeds) != 1:
        raise ValueError(f"speeds must be None or a sequence of per-worker factors, got "
                         f"{self.speeds!r}")
      for s in self.speeds:
        w("speeds", s, lambda v: v > 0, "a sequence of finite positive numbers")

  def speed_factors(self, num_workers: int, seed: int) -> np.ndarray:
    if self.speeds is not None:
      if len(self.speeds) != num_workers:
        raise ValueError(f"speeds must have num_workers={num_workers} entries, got {len(self.speeds)}")
      return np.asarray(self.speeds, np.float64)
    z = np.random.default_rng([seed, 11]).standard_normal(num_workers)
    return np.exp(self.speed_spread * z)

  def bb_extra_steps(self, exact_nu: bool, loss_evals: int) -> float:
    """Gradient steps a BB worker's step costs beyond its own gradient: the exact-ν gradient
    (if ``exact_nu``) and ``loss_evals`` Armijo trials (1 + its backtracks)."""
    return (self.extra_gradient_cost if exact_nu else 0.0) + self.forward_cost * int(loss_evals)

  def time(self, speeds: np.ndarray, seed: int, worker: int, step: int) -> float:
    t = self.base_s * float(speeds[worker])
    if self.jitter_sigma == 0 and self.straggler_prob == 0:
      return t
    rng = np.random.default_rng([seed, 7, worker, step])
    z, u = rng.standard_normal(), rng.random()
    t *= float(np.exp(self.jitter_sigma * z))
    if u < self.straggler_prob:
      t *= self.straggler_slowdown
    return t


class ServerLink:
  """The parameter server's network link; concurrent transfers queue on it (FIFO).

  A transfer of ``S`` bytes requested at time ``now`` starts at
  ``start = max(now, free_at)``, occupies the link for ``S / bandwidth`` and
  arrives at ``start + S / bandwidth + latency`` (latency does not occupy the
  link). With ``duplex=True`` (default: a full-duplex NIC) pushes (into the
  server) and pulls (out of it) queue on separate directions; with ``False``
  they share one queue. ``net=None`` is an ideal network (zero time).

  Utilisation of a direction = busy time / simulated time.
  """

  def __init__(self, net: str | costmodel.Link | None, duplex: bool = True):
    self.net = None if net is None else costmodel.link(net)
    self.duplex = _checks.flag("duplex", duplex)
    self.free_at = [0.0, 0.0]
    self.busy = [0.0, 0.0]
    self.bytes = [0.0, 0.0]
    self.transfers = [0, 0]

  def transfer(self, now: float, num_bytes: float, direction: int) -> float:
    """Queues a transfer (``direction`` 0 = push into the server, 1 = pull); returns its arrival time."""
    self.bytes[direction] += num_bytes
    self.transfers[direction] += 1
    if self.net is None:
      return now
    lane = direction if self.duplex else 0
    occupy = num_bytes / self.net.bandwidth
    start = max(now, self.free_at[lane])
    self.free_at[lane] = start + occupy
    self.busy[lane] += occupy
    return start + occupy + self.net.latency

  def utilisation(self, sim_time: float) -> dict[str, float]:
    """Busy fraction of each direction up to ``sim_time``. Transfers are queued back to back
    from the request (made at the current time) on, so a lane's busy time still ahead is
    ``free_at - sim_time``: counted whole, queued transfers made it exceed 1 (half duplex,
    BSP, 4 workers: 1.116)."""
    if sim_time <= 0:
      return {"push": 0.0, "pull": 0.0}
    done = [b - max(0.0, f - sim_time) for b, f in zip(self.busy, self.free_at)]
    if self.duplex:
      return {"push": done[0] / sim_time, "pull": done[1] / sim_time}
    u = done[0] / sim_time
    return {"push": u, "pull": u}

  def state_dict(self) -> dict[str, Any]:
    return {"free_at": list(self.free_at), "busy": list(self.busy), "bytes": list(self.bytes),
            "transfers": list(self.transfers)}

  def load_state_dict(self, d: dict[str, Any]) -> None:
    self.free_at = [float(v) for v in d["free_at"]]
    self.busy = [float(v) for v in d["busy"]]
    self.bytes = [float(v) for v in d["bytes"]]
    self.transfers = [int(v) for v in d["transfers"]]
