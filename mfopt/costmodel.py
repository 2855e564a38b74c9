"""Communication cost model for projections (SPEC.md): never presented as a measurement.

Ring all-reduce of ``S`` payload bytes over ``n`` workers on links of bandwidth
``B`` bytes/s and per-message latency ``alpha`` seconds:

.. math::  t_{ar} = \\frac{2(n-1)}{n} \\frac{S}{B} + 2(n-1)\\,\\alpha

All-gather (QSGD's exchange) of ``S_q`` bytes per worker:

.. math::  t_{ag} = \\frac{n-1}{n} \\frac{n S_q}{B} + (n-1)\\,\\alpha

Bytes: *payload* is what one worker contributes to one collective (what the
transforms count, :mod:`mfopt.comm`); *wire* is what the cost model puts on a
link: ``2(n-1)/n x payload`` for a ring all-reduce, ``(n-1) x payload`` for an
all-gather. Projected wall-clock = measured compute time + modeled
communication; reports label it "projected".

The latency term of the ring all-reduce is ``2(n-1) alpha`` as SPEC.md states;
the all-gather takes ``n-1`` ring steps, hence ``(n-1) alpha`` (a choice: SPEC.md
gives only its bandwidth term).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mfopt import _checks
from mfopt.comm import CollectiveKind


@dataclasses.dataclass(frozen=True)
class Link:
  """A network link: bandwidth in bytes/s and per-message latency in seconds."""

  name: str
  bandwidth: float
  latency: float

  def __post_init__(self):
    # (a string raised a bare TypeError and True passed as 1 byte/s)
    ok, v = _checks.real_scalar(self.bandwidth)
    if not ok or v is None or not v > 0:
      raise ValueError(f"bandwidth must be positive (bytes/s), got {self.bandwidth!r}")
    ok, v = _checks.real_scalar(self.latency)
    if not ok or v is None or not v >= 0:
      raise ValueError(f"latency must be non-negative (s), got {self.latency!r}")

  def describe(self) -> str:
    """``"10 Gbit/s Ethernet (1.25 GB/s per direction, latency 20 us)"``: what a report says a
    projection assumed (latency is a large share of a small model's modelled all-reduce)."""
    return (f"{self.name} ({self.bandwidth / 1e9:.4g} GB/s per direction, latency "
            f"{self.latency * 1e6:.3g} us)")

  def transfer_time(self, num_bytes: float) -> float:
    """Point-to-point time of one message (parameter-server push/pull)."""
    return _amount("num_bytes", num_bytes) / self.bandwidth + self.latency


GBIT = 1e9 / 8  # bytes/s in one Gbit/s

#: Presets. Ethernet latencies are typical TCP figures; NVLink and NDR numbers
#: are the bus bandwidths nccl-tests reports (SPEC.md).
PRESETS: Mapping[str, Link] = {
    "1gbit": Link("1 Gbit/s Ethernet", 1 * GBIT, 50e-6),
    "10gbit": Link("10 Gbit/s Ethernet", 10 * GBIT, 20e-6),
    # seed 001 §V's "emulated 10Gbps": trickle capped each node's upload and download at
    # 5 Gbit/s, so 5 Gbit/s per direction, which is B in the full-duplex ring formula
    "10gbit-trickle": Link("seed 001's emulated 10 Gbit/s (5 Gbit/s up and down per node)",
                           5 * GBIT, 20e-6),
    "100gbit": Link("100 Gbit/s InfiniBand", 100 * GBIT, 5e-6),
    "nvlink": Link("NVLink ring (370 GB/s)", 370e9, 3e-6),
    "ndr400": Link("NDR 400 InfiniBand (~47 GB/s)", 47e9, 3e-6),
}


def link(name_or_link: str | Link) -> Link:
  """A preset by name (``"10gbit"``, ``"100gbit"``, ``"nvlink"``, ``"ndr400"``, ``"1gbit"``) or a Link."""
  if isinstance(name_or_link, Link):
    return name_or_link
  if name_or_link not in PRESETS:
    raise ValueError(f"unknown link {name_or_link!r}; presets: {', '.join(PRESETS)}")
  return PRESETS[name_or_link]


def _amount(name: str, value: float) -> float:
  """``value`` if it is a real number >= 0 or NaN (a diverged run's counters stay NaN), else
  ValueError naming ``name``: negative bytes, counts or seconds modelled negative times."""
  ok, v = _checks.real_scalar(value)
  if not ok or (v is not None and v < 0):
    raise ValueError(f"{name} must be a non-negative number, got {value!r}")
  return value


def _check_workers(n: int) -> None:
  _checks.positive_int("num_workers", n)


def wire_bytes(payload_bytes: float, num_workers: int, kind: CollectiveKind) -> float:
  """Bytes one worker puts on its link for one collective of ``payload_bytes``."""
  _check_workers(num_workers)
  _amount("payload_bytes", payload_bytes)
  n = num_workers
  if kind == CollectiveKind.ALL_REDUCE:
    return 2 * (n - 1) / n * payload_bytes
  if kind == CollectiveKind.ALL_GATHER:
    return (n - 1) * payload_bytes
  raise ValueError(f"unknown collective kind {kind!r}")


def _ring_time(payload_bytes: float, num_workers: int, net: str | Link,
               kind: CollectiveKind) -> float:
  """:func:`wire_bytes` over the bandwidth plus one latency per ring step (2(n-1) for an
  all-reduce: reduce-scatter then all-gather; n-1 for an all-gather); 0 for one worker."""
  _check_workers(num_workers)
  _amount("payload_bytes", payload_bytes)  # NaN (a diverged run's counters) stays NaN
  net, n = link(net), num_workers
  if n == 1:
    return 0.0
  steps = 2 * (n - 1) if kind == CollectiveKind.ALL_REDUCE else n - 1
  return wire_bytes(payload_bytes, n, kind) / net.bandwidth + steps * net.latency


def all_reduce_time(payload_bytes: float, num_workers: int, net: str | Link) -> float:
  """Ring all-reduce time in seconds (0 for one worker)."""
  return _ring_time(payload_bytes, num_workers, net, CollectiveKind.ALL_REDUCE)


def all_gather_time(payload_bytes: float, num_workers: int, net: str | Link) -> float:
  """Ring all-gather time in seconds of ``payload_bytes`` per worker (0 for one worker)."""
  return _ring_time(payload_bytes, num_workers, net, CollectiveKind.ALL_GATHER)


def collective_time(payload_bytes: float, num_workers: int, net: str | Link,
                    kind: CollectiveKind) -> float:
  if kind == CollectiveKind.ALL_REDUCE:
    return all_reduce_time(payload_bytes, num_workers, net)
  if kind == CollectiveKind.ALL_GATHER:
    return all_gather_time(payload_bytes, num_workers, net)
  raise ValueError(f"unknown collective kind {kind!r}")


def communication_time(totals: Mapping[str, int], num_workers: int, net: str | Link) -> float:
  """Modeled time of all collectives in ``mfopt.comm_totals(state)`` (per worker, seconds).

  Uses the counts and the per-kind payload totals; each collective's payload is
  taken as the kind's mean payload (exact when every exchange of a kind has the
  same size, as in every mfopt transform).
  """
  pairs = (("all_reduces", "all_reduce_bytes"), ("all_gathers", "all_gather_bytes"))
  if not isinstance(totals, Mapping) or not any(c in totals for c, _ in pairs) or any(
      c in totals and b not in totals for c, b in pairs):
    # (a mapping without these keys, e.g. a misspelt one, used to model as no communication)
    raise ValueError(f"totals must hold mfopt.comm_totals(state)'s counts and bytes "
                     f"(all_reduces + all_reduce_bytes and/or all_gathers + all_gather_bytes; "
                     f"a run summary does), got {totals!r}")
  t = 0.0
  for kind, count_key, bytes_key in ((CollectiveKind.ALL_REDUCE, "all_reduces", "all_reduce_bytes"),
                                     (CollectiveKind.ALL_GATHER, "all_gathers", "all_gather_bytes")):
    count = _amount(f"totals[{count_key!r}]", totals.get(count_key, 0))
    _amount(f"totals[{bytes_key!r}]", totals.get(bytes_key, 0))
    if count:
      per_call = totals[bytes_key] / count
      t += count * collective_time(per_call, num_workers, net, kind)
  return t


def projected_time(compute_s: float, totals: Mapping[str, int], num_workers: int,
                   net: str | Link) -> dict[str, float]:
  """Projected wall-clock = measured compute + modeled communication (no overlap assumed).

  Returns ``{"compute_s", "comm_s", "projected_s", "scaling_efficiency"}`` where
  scaling efficiency is ``1 / (1 + comm/compute)`` (seed 004 §1).
  """
  _amount("compute_s", compute_s)
  comm = communication_time(totals, num_workers, net)
  eff = 1.0 / (1.0 + comm / compute_s) if compute_s > 0 else float("nan")
  return {"compute_s": compute_s, "comm_s": comm, "projected_s": compute_s + comm,
          "scaling_efficiency": eff}
