"""SSP's staleness bound as a property over random speed profiles (hypothesis)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfopt import data, models, sim

_DS = None


def _ds():
  global _DS
  if _DS is None:
    _DS = data.load("mnist1d")
  return _DS


MODEL = models.get_model("mlp", hidden=(), num_classes=10)


class _Gaps:
  """Mixin: records, at every push arrival, the pusher's count minus the slowest worker's.

  The counts are kept here, independently of the strategy's own clock.
  """

  def reset(self, s):
    super().reset(s)
    self.counts = np.zeros(s.num_workers, np.int64)
    self.gaps = []

  def on_push(self, s, w):
    self.counts[w] += 1
    self.gaps.append(int(self.counts[w] - self.counts.min()))
    super().on_push(s, w)


class Recording(_Gaps, sim.SSP):
  pass


class RecordingASP(_Gaps, sim.ASP):
  pass


def _run(strategy, speeds, jitter, straggle, network, seed, pushes=60):
  s = sim.Simulator(strategy, model=MODEL, dataset=_ds(), num_workers=len(speeds),
                    per_worker_batch=4, seed=seed, network=network,
                    compute=sim.ComputeModel(0.01, speeds=speeds, jitter_sigma=jitter,
                                             straggler_prob=straggle, straggler_slowdown=5.0))
  s.run(max_server_steps=pushes)
  return s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(speeds=st.lists(st.floats(0.2, 8.0), min_size=2, max_size=6),
       staleness=st.integers(0, 4), jitter=st.sampled_from([0.0, 0.5]),
       straggle=st.sampled_from([0.0, 0.2]), network=st.sampled_from([None, "1gbit"]),
       seed=st.integers(0, 3))
def test_ssp_bound_holds_at_every_push(speeds, staleness, jitter, straggle, network, seed):
  strat = Recording(staleness, sim.BaseSGD(0.05))
  s = _run(strat, speeds, jitter, straggle, network, seed)
  assert s.version == 60 and len(strat.gaps) == 60
  # Spec §5: a worker at clock c may start c+1 only if c - min <= s, so its next push
  # arrives at most s + 1 ahead of the slowest.
  assert max(strat.gaps) <= staleness + 1
  assert strat.max_gap == max(strat.gaps)


@pytest.mark.parametrize("staleness", [0, 3])
def test_ssp_bound_is_tight_and_asp_violates_it(staleness):
  speeds = [1.0, 1.0, 6.0]
  strat = Recording(staleness, sim.BaseSGD(0.05))
  _run(strat, speeds, 0.0, 0.0, None, 0)
  # the fast workers do run ahead up to the bound, and not one step further
  assert max(strat.gaps) == staleness + 1

  asp = RecordingASP(sim.BaseSGD(0.05))
  _run(asp, speeds, 0.0, 0.0, None, 0)
  assert max(asp.gaps) > staleness + 1


def test_ssp_staleness_zero_keeps_clocks_in_lock_step():
  """s = 0 (Ho et al.'s BSP end of SSP): no worker starts iteration c + 1 before every worker
  has pushed c times, so the pushes come in rounds of one per worker: the first two of a
  round arrive one ahead of the slowest, the last closes the round (gap 0)."""
  strat = Recording(0, sim.BaseSGD(0.05))
  _run(strat, [1.0, 2.5, 6.0], 0.0, 0.0, None, 0, pushes=30)
  assert strat.gaps == [1, 1, 0] * 10
  assert strat.counts.tolist() == [10, 10, 10]


def test_ssp_rejects_bad_staleness():
  with pytest.raises(ValueError, match="staleness"):
    sim.SSP(-1)
