"""The communication cost model against SPEC.md's closed forms."""

import math

import pytest

from mfopt import comm, costmodel


def test_ring_all_reduce_closed_form():
  net = costmodel.Link("x", bandwidth=1e9, latency=1e-5)
  s, n = 4e8, 8
  assert math.isclose(costmodel.all_reduce_time(s, n, net), 2 * 7 / 8 * s / 1e9 + 2 * 7 * 1e-5)
  assert costmodel.all_reduce_time(s, 1, net) == 0.0


def test_ring_all_gather_closed_form():
  """(n-1) x payload over the bandwidth plus n-1 ring latencies (one per step; an all-reduce
  pays 2(n-1)): QSGD's exchange time."""
  net = costmodel.Link("x", bandwidth=1e9, latency=1e-4)
  s, n = 1e5, 8
  assert math.isclose(costmodel.all_gather_time(s, n, net), 7 * s / 1e9 + 7 * 1e-4)
  assert math.isclose(costmodel.collective_time(s, n, net, comm.CollectiveKind.ALL_GATHER),
                      7 * s / 1e9 + 7 * 1e-4)
  assert costmodel.all_gather_time(s, 1, net) == 0.0


def test_all_gather_wire_bytes_overtake_ring_all_reduce():
  # QSGD-8bit sends ~1/4 of the fp32 payload, but all-gather wire bytes grow as (n-1)
  # while the ring all-reduce's stay below 2x payload: the crossover is at n = 9.
  fp32, q8 = 4.0, 1.0
  ar = {n: costmodel.wire_bytes(fp32, n, comm.CollectiveKind.ALL_REDUCE) for n in range(2, 33)}
  ag = {n: costmodel.wire_bytes(q8, n, comm.CollectiveKind.ALL_GATHER) for n in range(2, 33)}
  crossover = min(n for n in ar if ag[n] > ar[n])
  assert crossover == 9  # (n-1) > 8(n-1)/n  <=>  n > 8


def test_communication_time_from_counted_totals():
  totals = {"all_reduces": 10, "all_reduce_bytes": 10 * 1000, "all_gathers": 0, "all_gather_bytes": 0}
  t = costmodel.communication_time(totals, 4, "10gbit")
  assert math.isclose(t, 10 * costmodel.all_reduce_time(1000, 4, "10gbit"))
  p = costmodel.projected_time(2.0, totals, 4, "10gbit")
  assert math.isclose(p["scaling_efficiency"], 1 / (1 + t / 2.0))


@pytest.mark.parametrize("kwargs,match", [({"bandwidth": 0, "latency": 0}, "bandwidth.*0"),
                                          ({"bandwidth": 1, "latency": -1}, "latency.*-1")])
def test_link_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    costmodel.Link("bad", **kwargs)


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown link 'wifi'"):
    costmodel.link("wifi")


def test_projected_time_adds_compute_and_communication():
  """SPEC: projected wall-clock = measured compute + modeled communication (no overlap), and
  efficiency 1 / (1 + comm/compute); overlapping them (the max of the two) would give 1.0 s."""
  net = costmodel.Link("x", bandwidth=1e9, latency=0.0)
  totals = {"all_reduces": 1, "all_reduce_bytes": 4e8}
  comm_s = 2 * (2 - 1) / 2 * 4e8 / 1e9  # ring all-reduce of 4e8 bytes over 2 workers: 0.4 s
  p = costmodel.projected_time(1.0, totals, 2, net)
  assert math.isclose(p["comm_s"], comm_s) and p["compute_s"] == 1.0
  assert math.isclose(p["projected_s"], 1.4)
  assert math.isclose(p["scaling_efficiency"], 1.0 / 1.4)


def test_negative_amounts_and_non_numbers_are_refused_naming_them():
  """Negative bytes, counts or compute seconds modelled negative times (projected_s -0.999 for
  compute_s=-1); a string bandwidth raised a bare TypeError and True passed as 1 byte/s. NaN
  (a diverged run's counters) still passes through."""
  net = costmodel.PRESETS["10gbit"]
  cases = [
      (lambda: costmodel.projected_time(-1.0, {"all_reduces": 0, "all_reduce_bytes": 0}, 4, net),
       r"compute_s must be a non-negative number, got -1.0"),
      (lambda: costmodel.communication_time({"all_reduces": -3, "all_reduce_bytes": 12}, 4, net),
       r"totals\['all_reduces'\] must be a non-negative number, got -3"),
      (lambda: costmodel.communication_time({"all_reduces": 3, "all_reduce_bytes": -12}, 4, net),
       r"totals\['all_reduce_bytes'\] must be a non-negative number, got -12"),
      (lambda: costmodel.wire_bytes(-5, 4, costmodel.CollectiveKind.ALL_REDUCE),
       r"payload_bytes must be a non-negative number, got -5"),
      (lambda: net.transfer_time(-5), r"num_bytes must be a non-negative number, got -5"),
      (lambda: costmodel.Link("z", "1e9", 0), r"bandwidth must be positive \(bytes/s\), got '1e9'"),
      (lambda: costmodel.Link("z", True, 0), r"bandwidth must be positive .*got True"),
      (lambda: costmodel.Link("z", 1e9, None), r"latency must be non-negative \(s\), got None"),
  ]
  for build, match in cases:
    with pytest.raises(ValueError, match=match):
      build()
  assert math.isnan(costmodel.all_reduce_time(float("nan"), 4, net))
  assert net.transfer_time(0) == net.latency


def test_amounts_that_are_not_numbers_are_refused_naming_them():
  """A string or a bool as a byte count, call count or compute time is refused with the field's
  name, as a negative one is; letting it through failed later with a bare TypeError (bytes
  over the bandwidth) or counted True as 1."""
  net = costmodel.PRESETS["10gbit"]
  cases = [
      (lambda: net.transfer_time("5"), r"num_bytes must be a non-negative number, got '5'"),
      (lambda: costmodel.wire_bytes("8", 4, costmodel.CollectiveKind.ALL_REDUCE),
       r"payload_bytes must be a non-negative number, got '8'"),
      (lambda: costmodel.communication_time({"all_reduces": True, "all_reduce_bytes": 8}, 4, net),
       r"totals\['all_reduces'\] must be a non-negative number, got True"),
      (lambda: costmodel.projected_time("1", {}, 4, net),
       r"compute_s must be a non-negative number, got '1'"),
  ]
  for build, match in cases:
    with pytest.raises(ValueError, match=match):
      build()


def test_presets_match_spec_bandwidths_and_documented_latencies():
  """SPEC.md's presets in bytes/s (1 Gbit/s = 1.25e8 B/s; seed 001's emulated 10 Gbit/s is
  5 Gbit/s per direction), the describe() example for 10 Gbit/s Ethernet, and latencies that do
  not fall as links get slower: a misplaced digit in a preset skews every projection made on it."""
  gbit = 1e9 / 8
  want = {"1gbit": gbit, "10gbit": 10 * gbit, "10gbit-trickle": 5 * gbit, "100gbit": 100 * gbit,
          "nvlink": 370e9, "ndr400": 47e9}
  for name, bandwidth in want.items():
    assert math.isclose(costmodel.link(name).bandwidth, bandwidth, rel_tol=1e-12), name
  assert costmodel.link("10gbit").describe() == (
      "10 Gbit/s Ethernet (1.25 GB/s per direction, latency 20 us)")
  lat = {name: costmodel.link(name).latency for name in want}
  assert lat["1gbit"] >= lat["10gbit"] >= lat["100gbit"] >= lat["ndr400"] > 0
  assert lat["10gbit-trickle"] == lat["10gbit"] and lat["nvlink"] <= lat["100gbit"]


def test_describe_reports_gigabytes_per_second_and_microseconds():
  """describe() writes bandwidth in GB/s (1e9 bytes/s) and latency in us: 2.5e9 B/s and 7e-6 s
  read "2.5 GB/s" and "7 us"; a wrong power of ten would mislabel every report's projection."""
  assert costmodel.Link("x", 2.5e9, 7e-6).describe() == "x (2.5 GB/s per direction, latency 7 us)"


def test_projected_time_with_zero_compute_is_not_reported_efficient():
  """With no measured compute time the efficiency 1 / (1 + comm/compute) has no finite value:
  it is NaN (or its limit 0 when there is communication), never a perfect 1.0."""
  net = costmodel.Link("x", bandwidth=1e9, latency=0.0)
  p = costmodel.projected_time(0.0, {"all_reduces": 1, "all_reduce_bytes": 4e8}, 2, net)
  assert math.isclose(p["comm_s"], 0.4) and math.isclose(p["projected_s"], 0.4)
  assert math.isnan(p["scaling_efficiency"]) or p["scaling_efficiency"] == 0.0


def test_communication_time_refuses_counts_without_their_bytes():
  """A count without its byte total cannot be modelled: refused, saying which keys it needs,
  rather than a bare KeyError (count > 0) or a silent 0 s of communication (count 0)."""
  for totals in ({"all_reduces": 4}, {"all_reduces": 0},
                 {"all_gathers": 2, "all_reduce_bytes": 8, "all_reduces": 1}):
    with pytest.raises(ValueError, match=r"totals must hold mfopt.comm_totals"):
      costmodel.communication_time(totals, 4, "10gbit")
