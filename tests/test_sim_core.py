"""mfopt.sim: clock, link contention, timing, determinism, checkpointing, memory, progressive momentum."""

import dataclasses
import pickle
import re

import numpy as np
import pytest

from mfopt import costmodel, data, models, sim
from mfopt.sim import clock, suite


@pytest.fixture(scope="module")
def ds():
  return data.load("mnist1d")


@pytest.fixture(scope="module")
def linear():
  return models.get_model("mlp", hidden=(), num_classes=10)


def test_event_queue_orders_by_time_then_scheduling_order():
  q = sim.EventQueue()
  q.push(1.0, clock.PUSH_ARRIVE, 3)
  q.push(0.5, clock.COMPUTE_DONE, 2)
  q.push(1.0, clock.COMPUTE_DONE, 0)
  q.push(1.0, clock.PULL_ARRIVE, 1)
  q2 = sim.EventQueue.from_state_dict(pickle.loads(pickle.dumps(q.state_dict())))
  for queue in (q, q2):
    assert [queue.pop()[3] for _ in range(4)] == [2, 3, 0, 1]


def test_server_link_queues_transfers_fifo_and_reports_utilisation():
  net = costmodel.Link("test", bandwidth=1000.0, latency=0.5)
  link = sim.ServerLink(net, duplex=True)
  arrivals = [link.transfer(0.0, 100.0, 0) for _ in range(3)]
  np.testing.assert_allclose(arrivals, [0.6, 0.7, 0.8])
  assert link.transfer(0.05, 100.0, 1) == pytest.approx(0.65)  # the pull lane is free
  assert link.transfer(2.0, 100.0, 0) == pytest.approx(2.6)    # idle link: no queueing
  u = link.utilisation(4.0)
  assert u == {"push": pytest.approx(0.4 / 4.0), "pull": pytest.approx(0.1 / 4.0)}
  half = sim.ServerLink(net, duplex=False)
  half.transfer(0.0, 100.0, 0)
  assert half.transfer(0.0, 100.0, 1) == pytest.approx(0.7)  # shares one queue
  assert sim.ServerLink(None).transfer(3.0, 1e9, 0) == 3.0


def test_compute_model_is_stateless_and_seeded():
  cm = sim.ComputeModel(0.1, speeds=[1.0, 2.0], jitter_sigma=0.3)
  sp = cm.speed_factors(2, seed=0)
  a = [cm.time(sp, 0, w, n) for w in range(2) for n in range(5)]
  b = [cm.time(sp, 0, w, n) for w in range(2) for n in range(5)]
  c = [cm.time(sp, 1, w, n) for w in range(2) for n in range(5)]
  assert a == b and a != c
  z = np.random.default_rng([0, 7, 1, 3]).standard_normal()
  assert cm.time(sp, 0, 1, 3) == pytest.approx(0.1 * 2.0 * np.exp(0.3 * z))
  always = sim.ComputeModel(0.1, straggler_prob=1.0, straggler_slowdown=4.0)
  assert always.time(np.ones(1), 0, 0, 0) == pytest.approx(0.4)
  spread = sim.ComputeModel(0.1, speed_spread=0.5).speed_factors(4, seed=3)
  np.testing.assert_allclose(spread, np.exp(0.5 * np.random.default_rng([3, 11]).standard_normal(4)))
  with pytest.raises(ValueError, match="straggler_prob"):
    sim.ComputeModel(straggler_prob=2.0)


def test_event_queue_keeps_fifo_ties_across_a_state_dict_round_trip():
  """The scheduling counter must survive a checkpoint: events already queued keep their seq, so
  a later push at the same instant has to come after them (FIFO), exactly as in the queue that
  was never saved. Restarting the counter (at 0 or at the number of queued events) let the new
  event overtake the old ones. An empty queue's next time is inf, so a max_time never stops it."""
  q = sim.EventQueue()
  assert q.next_time() == float("inf")
  for w in range(3):
    q.push(1.0, clock.COMPUTE_DONE, w)
  q.pop(), q.pop()  # seq 2 (worker 2) is left, the counter is at 3
  q2 = sim.EventQueue.from_state_dict(pickle.loads(pickle.dumps(q.state_dict())))
  for queue in (q, q2):
    queue.push(1.0, clock.PUSH_ARRIVE, 7)
    queue.push(0.5, clock.PULL_ARRIVE, 8)
    assert queue.next_time() == 0.5
    assert [queue.pop()[3] for _ in range(3)] == [8, 2, 7]
    assert len(queue) == 0 and queue.next_time() == float("inf")


def test_compute_times_follow_the_documented_lognormal_and_straggler_laws():
  """time = base * speed * exp(sigma z) * (slowdown if u < p): over 4,000 stateless draws the
  log jitter has mean 0 and std 1 (in units of sigma), stragglers occur with frequency p, and the
  mean is the closed form base * speed * exp(sigma^2 / 2) * (1 - p + p s), each within 4 standard
  errors. A 'mean-one' lognormal (z - sigma / 2) or a mis-scaled slowdown shifts one of them."""
  n, base, speed, sigma, p, slow = 4000, 0.1, 2.0, 0.4, 0.2, 3.0
  sp = np.array([1.0, speed])
  jit = sim.ComputeModel(base, speeds=[1.0, speed], jitter_sigma=sigma)
  z = np.log([jit.time(sp, 5, 1, i) / (base * speed) for i in range(n)]) / sigma
  assert abs(z.mean()) < 4 / np.sqrt(n) and abs(z.std() - 1) < 4 / np.sqrt(2 * n)
  strag = sim.ComputeModel(base, speeds=[1.0, speed], straggler_prob=p, straggler_slowdown=slow)
  t = np.array([strag.time(sp, 5, 1, i) for i in range(n)])
  hit = np.isclose(t, base * speed * slow, rtol=1e-12)
  assert np.all(hit | np.isclose(t, base * speed, rtol=1e-12))  # two values only
  assert abs(hit.mean() - p) < 4 * np.sqrt(p * (1 - p) / n)
  both = sim.ComputeModel(base, speeds=[1.0, speed], jitter_sigma=sigma, straggler_prob=p,
                          straggler_slowdown=slow)
  t = np.array([both.time(sp, 5, 1, i) for i in range(n)])
  mean = base * speed * np.exp(sigma ** 2 / 2) * (1 - p + p * slow)
  second = (base * speed) ** 2 * np.exp(2 * sigma ** 2) * (1 - p + p * slow ** 2)
  assert abs(t.mean() - mean) < 4 * np.sqrt((second - mean ** 2) / n)


def test_compute_model_refuses_speeds_and_slowdowns_outside_their_domain():
  """A speed factor multiplies the step time, so 0 would make a worker's steps free and the run
  never advance; a slowdown below 1 would make a straggler faster; and a speeds list longer than
  the cluster would silently ignore its tail (a mismatched config), so each is refused."""
  with pytest.raises(ValueError, match="speeds"):
    sim.ComputeModel(speeds=[1.0, 0.0])
  with pytest.raises(ValueError, match="straggler_slowdown"):
    sim.ComputeModel(straggler_slowdown=0.5)
  cm = sim.ComputeModel(speeds=[1.0, 2.0, 3.0])
  np.testing.assert_array_equal(cm.speed_factors(3, seed=0), [1.0, 2.0, 3.0])
  for m in (2, 4):
    with pytest.raises(ValueError, match="num_workers"):
      cm.speed_factors(m, seed=0)


def test_an_ideal_link_still_counts_the_bytes_and_transfers_of_each_direction():
  """net=None makes transfers instantaneous, but the traffic itself (bytes and message counts per
  direction, kept in the checkpoint) does not depend on the network model, so it is counted
  the same as on a real link."""
  for net in (None, costmodel.Link("test", bandwidth=1000.0, latency=0.5)):
    link = sim.ServerLink(net)
    link.transfer(0.0, 100.0, 0)
    link.transfer(0.0, 100.0, 0)
    link.transfer(1.0, 30.0, 1)
    d = link.state_dict()
    assert (d["bytes"], d["transfers"]) == ([200.0, 30.0], [2, 1]), net


def test_link_utilisation_before_any_simulated_time_is_zero():
  """At sim_time 0 (a result taken before the first event, or a run whose events all happen at
  time 0) no busy time has elapsed: the utilisation is 0, not a 0 / 0 division error."""
  net = costmodel.Link("test", bandwidth=1000.0, latency=0.5)
  for duplex in (True, False):
    link = sim.ServerLink(net, duplex=duplex)
    assert link.utilisation(0.0) == {"push": 0.0, "pull": 0.0}
    link.transfer(0.0, 100.0, 0)
    assert link.utilisation(0.0) == {"push": 0.0, "pull": 0.0}


def test_simulated_time_of_asp_bsp_and_all_reduce(ds, linear):
  S = 4 * 410  # float32 parameters of the linear model
  net = costmodel.Link("slow", bandwidth=1e5, latency=1e-3)
  T = S / 1e5 + 1e-3
  base = sim.BaseSGD(0.1)
  # ASP, one worker: compute, push, pull, compute, ...: version n lands at n c + n T + (n-1) T
  s = sim.Simulator(sim.ASP(base), model=linear, dataset=ds, num_workers=1, per_worker_batch=8,
                    network=net, compute=sim.ComputeModel(0.05))
  s.run(max_server_steps=5)
  assert s.now == pytest.approx(5 * 0.05 + 5 * T + 4 * T)
  # BSP, 4 equal workers, compute 0.05: pushes queue on the server link, then pulls queue
  s = sim.Simulator(sim.BSP(base), model=linear, dataset=ds, num_workers=4, per_worker_batch=8,
                    network=net, compute=sim.ComputeModel(0.05))
  s.run(max_server_steps=3)
  occ, lat = S / 1e5, 1e-3
  ready, push_free, pull_free = [0.05] * 4, 0.0, 0.0  # FIFO queues, ties in worker order
  for _ in range(3):
    arrive = {}
    for w in sorted(range(4), key=lambda i: (ready[i], i)):
      start = max(ready[w], push_free)
      push_free = start + occ
      arrive[w] = start + occ + lat
    update = max(arrive.values())
    for w in sorted(range(4), key=lambda i: (arrive[i], i)):
      start = max(update, pull_free)
      pull_free = start + occ
      ready[w] = start + occ + lat + 0.05
  assert s.now == pytest.approx(update)
  assert s.now < 3 * (0.05 + 8 * occ + 2 * lat)  # pulls of one round overlap pushes of the next
  r = s.result().summary
  assert r["link_utilisation_push"] == pytest.approx(3 * 4 * occ / s.now)
  assert r["pushes_per_worker"] == 3 and r["pulls_per_worker"] == 3
  # bytes sent are the pushes' payload; bytes moved add the pulls
  assert r["bytes_sent_per_worker"] == 3 * r["payload_bytes"]
  assert r["bytes_per_worker"] == 6 * r["payload_bytes"]
  # all-reduce, speeds 1 and 3: step = slowest compute + ring all-reduce time (cost model)
  s = sim.Simulator(sim.AllReduce(base), model=linear, dataset=ds, num_workers=2, per_worker_batch=8,
                    network=net, compute=sim.ComputeModel(0.05, speeds=[1.0, 3.0]))
  s.run(max_server_steps=4)
  assert s.now == pytest.approx(4 * (0.15 + costmodel.all_reduce_time(S, 2, net)))
  assert s.result().summary["link_utilisation_push"] == 0.0


def _ksync_sim(ds, seed, preset="working"):
  model = models.get_model("mlp", hidden=(8,), num_classes=10)
  return sim.Simulator(sim.ksync_preset(preset, alpha0=0.05), model=model, dataset=ds,
                       num_workers=4, per_worker_batch=8, seed=seed, network="1gbit",
                       eval_every_samples=160,
                       compute=sim.ComputeModel(0.01, speed_spread=0.4, jitter_sigma=0.3,
                                                straggler_prob=0.1, straggler_slowdown=3.0))


def _trace(s):
  r = s.result()
  return (s.theta.tobytes(), r.k_trace, r.staleness, r.lr_traces, r.history, r.server_lr_trace)


def test_same_seed_same_trace_bit_for_bit_and_different_seeds_differ(ds):
  runs = []
  for seed in (0, 0, 1):
    s = _ksync_sim(ds, seed)
    s.run(max_samples=8 * 60)
    runs.append(_trace(s))
  assert runs[0] == runs[1]
  assert runs[0][0] != runs[2][0] and runs[0][1] != runs[2][1] and runs[0][3] != runs[2][3]


def _plain(x):
  if isinstance(x, dict):
    return all(isinstance(k, (str, int)) and _plain(v) for k, v in x.items())
  if isinstance(x, (list, tuple)):
    return all(_plain(v) for v in x)
  return x is None or isinstance(x, (bool, int, float, str, np.ndarray, np.generic))


@pytest.mark.parametrize("make", ["ksync", "easgd", "ssp"])
def test_checkpoint_resume_is_bit_identical(ds, linear, make):
  def build(seed=0):
    if make == "ksync":
      return _ksync_sim(ds, seed, preset="faithful")
    strat = sim.EASGD(3, sim.BaseSGD(0.1)) if make == "easgd" else sim.SSP(2, sim.BaseSGD(0.1))
    return sim.Simulator(strat, model=linear, dataset=ds, num_workers=3, per_worker_batch=8,
                         network="1gbit", eval_every_samples=120,
                         compute=sim.ComputeModel(0.01, speed_spread=0.6, jitter_sigma=0.3))
  full = build()
  full.run(max_samples=8 * 50)
  first = build()
  first.run(max_events=37)
  state = first.state_dict()
  assert _plain(state)
  state = pickle.loads(pickle.dumps(state))
  resumed = build()
  resumed.load_state_dict(state)
  # the state really arrived (a load that did nothing would rerun from t=0 and still match)
  assert first.now > 0 and resumed.now == first.now and resumed.version == first.version
  np.testing.assert_array_equal(resumed.theta, first.theta)
  resumed.run(max_samples=8 * 50)
  assert _trace(resumed) == _trace(full)


def test_only_referenced_versions_are_kept(ds, linear):
  M = 6
  for strat, bound in ((sim.ASP(sim.BaseSGD(0.1)), 2 * M + 1),
                       (sim.KSync(sim.KSyncConfig(bb=sim.BBConfig(alpha0=0.05))), 3 * M + 1)):
    s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=M, per_worker_batch=4,
                      network="1gbit", compute=sim.ComputeModel(0.01, speed_spread=1.0))
    most = 0
    for _ in range(600):  # a BB step fires compute-done twice (its extra work)
      s.step()
      most = max(most, len(s.versions))
      referenced = set(s.w_version) | set(s.w_incoming) | {s.version}
      if strat.bb is not None:
        referenced |= set(s.w_prev_version)
      assert set(s.versions) <= referenced
    assert s.version > 3 * M and most <= bound


def test_progressive_momentum_matches_the_unrolled_sum(ds, linear):
  """u_t = Σ_j γ^(t-j) Ĝ_j^(t) (dampened: × (1-γ)), spec §1.2's unrolled form.

  Ĝ_j^(t) is built from the gradients computed at version j and received before update t:
  ``additive`` (default) sums α g / k_j with k_j the fresh count; ``reaverage`` takes their mean.
  The strategy implements both with one momentum buffer.
  """
  lr, gamma = 0.1, 0.6
  for dampening, merge in ((False, "additive"), (True, "additive"), (True, "reaverage")):
    cfg = sim.KSyncConfig(gamma=gamma, dampening=dampening, k_rule=2, bb=None, stale_merge=merge,
                          lr_fallback=sim.BaseSGD(lr, decay_rate=1.0))
    strat = sim.KSync(cfg)
    s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=3, per_worker_batch=8,
                      network=None, compute=sim.ComputeModel(0.01, speeds=[1.0, 1.7, 3.1]))
    theta0 = s.theta.astype(np.float64).copy()
    received = []  # (arrival version a_i, computed version v_i, grad)
    orig = strat.on_push

    def spy(sim_, w, orig=orig, received=received):
      received.append((sim_.version, sim_.msg[w].version, sim_.msg[w].grad.astype(np.float64)))
      orig(sim_, w)

    strat.on_push = spy
    s.run(max_server_steps=12)
    T = s.version
    k = {int(v) - 1: kk for v, _, kk in s.k_trace}  # k_trace is logged after the increment
    theta = theta0.copy()
    scale = (1 - gamma) if dampening else 1.0
    for t in range(T):
      u = 0.0
      for j in range(t + 1):
        gs = [g for a, v, g in received if a <= t and v == j]
        slot = sum(gs) / (k[j] if merge == "additive" else len(gs))
        u = u + gamma ** (t - j) * scale * lr * slot
      theta -= u
    assert any(a > v for a, v, _ in received)  # stale gradients were merged
    np.testing.assert_allclose(s.theta, theta, rtol=0, atol=5e-6, err_msg=merge)


def test_reaverage_keeps_a_slot_the_mean_of_every_gradient_merged_into_it(ds, linear):
  """With ``stale_merge="reaverage"`` slot v is the mean of all gradients computed at v received
  so far (spec §1.2), so its count must grow with each merged stale gradient: a count left at
  the fresh k averages the second stale gradient of a version with the wrong weight."""
  lr, gamma = 0.1, 0.6
  cfg = sim.KSyncConfig(gamma=gamma, k_rule=2, bb=None, stale_merge="reaverage",
                        lr_fallback=sim.BaseSGD(lr, decay_rate=1.0))
  strat = sim.KSync(cfg)
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=4, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speeds=[1.0, 1.1, 2.9, 3.3]))
  theta = s.theta.astype(np.float64).copy()
  received = []  # (arrival version, computed version, grad)
  orig = strat.on_push

  def spy(sim_, w):
    received.append((sim_.version, sim_.msg[w].version, sim_.msg[w].grad.astype(np.float64)))
    orig(sim_, w)

  strat.on_push = spy
  s.run(max_server_steps=10)
  # two stale gradients of one version were merged (the case that needs the growing count)
  stale = [v for a, v, _ in received if a > v]
  assert max(stale.count(v) for v in stale) >= 2 and s.dropped == 0
  for t in range(s.version):  # u_t = sum_j gamma^(t-j) lr mean(grads of version j received by t)
    u = sum(gamma ** (t - j) * lr * np.mean([g for a, v, g in received if a <= t and v == j], 0)
            for j in range(t + 1))
    theta -= u
  np.testing.assert_allclose(s.theta, theta, rtol=0, atol=5e-6)


def test_a_bb_workers_extra_compute_is_drawn_for_the_step_it_belongs_to(ds, linear):
  """Exact nu costs one more gradient at the jittered time of the same step (spec §3.1), so with
  Armijo trials free one worker's clock is sum_n t_n + sum_{n>=1} t_n; drawing the extra work
  from another step's jitter would charge a different, wrong amount."""
  cm = sim.ComputeModel(0.05, jitter_sigma=0.5, forward_cost=0.0, extra_gradient_cost=1.0)
  s = sim.Simulator(sim.ksync_preset("working", alpha0=0.05), model=linear, dataset=ds,
                    num_workers=1, per_worker_batch=8, network=None, compute=cm)
  s.run(max_samples=8 * 12)
  t = [cm.time(s.speeds, 0, 0, n) for n in range(12)]
  assert s.strategy.bb.nu == "exact" and np.std(t) > 0.01  # jitter makes steps differ
  assert s.now == pytest.approx(sum(t) + sum(t[1:]), rel=1e-9)
  assert s.result().summary["bb_extra_compute_s"] == pytest.approx(sum(t[1:]), rel=1e-9)


def test_stale_cutoff_keeps_a_gradient_whose_weight_equals_the_cutoff(ds, linear):
  """``stale_cutoff`` drops a stale gradient once ``gamma^tau < cutoff``; at gamma = 0.5 and
  cutoff 0.25 (both exact in binary) tau = 2 is kept and tau >= 3 dropped, so an off-by-one
  (``<=``) comparison would drop the tau = 2 gradients as well."""
  cfg = sim.KSyncConfig(gamma=0.5, k_rule=1, bb=None, stale_cutoff=0.25,
                        lr_fallback=sim.BaseSGD(0.1, decay_rate=1.0))
  strat = sim.KSync(cfg)
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=3, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speeds=[1.0, 2.3, 3.7]))
  taus = []
  orig = strat.on_push

  def spy(sim_, w):
    taus.append(sim_.version - sim_.msg[w].version)
    orig(sim_, w)

  strat.on_push = spy
  s.run(max_server_steps=12)
  assert taus.count(2) > 0 and any(t >= 3 for t in taus)
  assert strat.merged == sum(1 <= t <= 2 for t in taus)
  assert s.dropped == sum(t >= 3 for t in taus)


def test_ksync_logs_the_mean_bb_step_of_the_gradients_in_each_update(ds, linear):
  """With per-worker BB steps KSync's server learning-rate trace records, for each version, the
  mean step alpha_i of the fresh gradients that made it (the step the update took on average);
  the max or another worker's step would misreport the schedule the run followed."""
  # (the BB engine of the test above, two workers: k = 2 makes every update a mean of two steps)
  cfg = dataclasses.replace(sim.ksync_preset("working", alpha0=0.05).config, k_rule=2)
  strat = sim.KSync(cfg)
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=2, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speeds=[1.0, 1.7]))
  received = []  # (arrival version, computed version, alpha)
  orig = strat.on_push

  def spy(sim_, w):
    received.append((sim_.version, sim_.msg[w].version, sim_.msg[w].alpha))
    orig(sim_, w)

  strat.on_push = spy
  s.run(max_server_steps=8)
  trace = s.result().server_lr_trace
  assert [int(v) for v, _, _ in trace] == list(range(1, s.version + 1))
  for v, _, lr in trace:
    alphas = [al for a, c, al in received if a == c == int(v) - 1]
    assert len(alphas) == 2
    assert lr == pytest.approx(np.mean(alphas), rel=1e-12)
  assert len({round(al, 9) for _, _, al in received}) > 2  # the workers' steps differ


def test_strategy_errors_name_the_argument():
  with pytest.raises(ValueError, match="drop_rate"):
    sim.DropWorker(1.0)
  with pytest.raises(ValueError, match="interval"):
    sim.EASGD(0)
  with pytest.raises(ValueError, match="gamma"):
    sim.KSyncConfig(gamma=1.0)
  with pytest.raises(ValueError, match="k_rule"):
    sim.KSyncConfig(k_rule="fixed")
  with pytest.raises(ValueError, match="preset"):
    sim.ksync_config("fast")
  with pytest.raises(ValueError, match="learning_rate"):
    sim.BaseSGD(-1.0)


@pytest.mark.parametrize("build,match", [
    (lambda: sim.BaseSGD(learning_rate="0.1"), r"learning_rate must be > 0, got '0.1'"),
    (lambda: sim.BaseSGD(learning_rate=float("inf")), r"learning_rate must be > 0, got inf"),
    (lambda: sim.ASP(0.1), r"ASP: base must be a mfopt.sim.BaseSGD or None, got 0.1 "
                           r"\(for a learning rate of 0.1: ASP\(base=BaseSGD\(0.1\)\)\)"),
    (lambda: sim.DropWorker("0.5"), r"drop_rate must be in \[0, 1\), got '0.5'"),
    (lambda: sim.KSyncConfig(dampening="no"), r"dampening must be True or False, got 'no'"),
    (lambda: sim.KSyncConfig(r0=float("nan")), r"r0 must be a number >= 0, got nan"),
    (lambda: sim.KSyncConfig(bb="cheap"), r"bb must be a mfopt.sim.bb.BBConfig or None"),
    (lambda: sim.KSyncConfig(ktest=None), r"ktest must be a mfopt.sim.ksync.KTestConfig"),
    (lambda: sim.BBConfig(alpha0=float("inf")), r"alpha0 must be > 0, got inf"),
    (lambda: sim.BBConfig(alpha_max_factor=-1), r"alpha_max_factor must be > 0, got -1"),
    (lambda: sim.KTestConfig(theta=float("inf")), r"theta must be > 0, got inf"),
    (lambda: sim.ComputeModel(base_s="0.01"), r"base_s must be >= 0, got '0.01'"),
])
def test_bad_simulator_settings_name_the_argument(build, match):
  """Strings, inf and NaN used to pass (a string failed later in a bare comparison, inf ran),
  and a learning rate given where a BaseSGD belongs failed only when simulating."""
  with pytest.raises(ValueError, match=match):
    build()


def test_max_time_runs_events_up_to_it_and_none_after(ds, linear):
  """BSP, speeds 1 and 3, compute 1 s, no network: pushes at t = 1 and 3, the update at 3.
  max_time=2 ran the t = 3 events too (the clock was checked before each event, not after)."""
  s = sim.Simulator(sim.BSP(sim.BaseSGD(0.1)), model=linear, dataset=ds, num_workers=2,
                    per_worker_batch=8, network=None, compute=sim.ComputeModel(1.0, speeds=[1, 3]))
  s.run(max_time=2.0)
  assert s.now == 1.0 and s.version == 0
  s.run(max_time=3.0)  # (the events at exactly max_time run)
  assert s.now == 3.0 and s.version == 1


def test_bad_run_limits_and_strategies_are_refused(ds, linear):
  """A NaN max_time ran forever, a negative limit returned an empty 'success', the class
  instead of an instance failed in reset, and a fixed k above the worker count ran a smaller k
  under the larger label."""
  s = sim.Simulator(sim.ASP(), model=linear, dataset=ds, num_workers=4, per_worker_batch=4,
                    network=None)
  for kw, match in [(dict(max_time=float("nan")), r"max_time must be a positive number"),
                    (dict(max_samples=-1), r"max_samples must be a positive integer, got -1"),
                    (dict(max_server_steps=0), r"max_server_steps must be a positive integer"),
                    (dict(max_samples="256"), r"max_samples must be a positive integer, got '256'")]:
    with pytest.raises(ValueError, match=match):
      s.run(**kw)
  with pytest.raises(ValueError, match=r"strategy must be a mfopt.sim strategy instance.*the class"):
    sim.simulate(sim.ASP, model=linear, dataset=ds, num_workers=4, per_worker_batch=4,
                 max_samples=16)
  with pytest.raises(ValueError, match=r"k_rule=8 is more than num_workers=4"):
    sim.simulate(sim.KSync(sim.KSyncConfig(k_rule=8)), model=linear, dataset=ds, num_workers=4,
                 per_worker_batch=4, max_samples=16, network=None)
  # (an adaptive k_min above M ran as k = M, and forced every round)
  with pytest.raises(ValueError, match=r"ktest.k_min=5 is more than num_workers=4"):
    sim.simulate(sim.KSync(sim.KSyncConfig(ktest=sim.KTestConfig(k_min=5))), model=linear,
                 dataset=ds, num_workers=4, per_worker_batch=4, max_samples=16, network=None)


def test_easgd_and_dropworker_defaults(ds, linear):
  s = sim.Simulator(sim.EASGD(10), model=linear, dataset=ds, num_workers=8, per_worker_batch=4,
                    network=None)
  assert s.strategy.a == pytest.approx(0.9 / (10 * 8))
  d = sim.Simulator(sim.DropWorker(), model=linear, dataset=ds, num_workers=7, per_worker_batch=4,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=1.0))
  d.run(max_server_steps=10)
  assert d.strategy.k == 4 and [r[2] for r in d.k_trace] == [4] * 10
  assert d.dropped > 0


@pytest.mark.parametrize("preset", ["faithful", "working"])  # nu "cheap" and "exact"
def test_bb_worker_pays_for_its_armijo_trials_and_exact_nu(ds, linear, preset):
  """Spec §3.1: each Armijo trial is one forward pass (1/3 of a gradient step by default) and
  exact ν one more gradient. One worker, ideal network: simulated time is the sum of its
  steps' compute, so it must equal the closed form from the step and backtrack counts."""
  def run(compute):
    s = sim.Simulator(sim.ksync_preset(preset, alpha0=10.0), model=linear, dataset=ds,
                      num_workers=1, per_worker_batch=8, network=None, compute=compute)
    s.run(max_samples=8 * 40)
    return s, s.result().summary

  s, r = run(sim.ComputeModel(0.05))
  steps, backtracks = r["bb_steps"], r["bb_backtracks"]
  assert steps == 40 and backtracks > 0  # alpha0 = 10 makes Armijo backtrack
  exact = s.strategy.bb.nu == "exact"
  assert exact == (preset == "working")
  # exact nu: one more gradient per step after the first (the first has no theta_prev)
  want = 0.05 * (steps + (steps - 1) * exact + (steps + backtracks) / 3)
  assert s.now == pytest.approx(want, rel=1e-9)
  assert r["bb_extra_compute_s"] == pytest.approx(want - 0.05 * steps, rel=1e-9)
  assert r["compute_s_per_step"] == pytest.approx(want / steps, rel=1e-9)
  # Both costs set to zero: the step costs one gradient, as it did before they were modelled.
  s0, r0 = run(sim.ComputeModel(0.05, forward_cost=0.0, extra_gradient_cost=0.0))
  assert s0.now == pytest.approx(0.05 * 40) and r0["bb_extra_compute_s"] == 0.0
  np.testing.assert_array_equal(s0.theta, s.theta)  # timing only: same optimisation path


def test_compute_s_per_step_is_the_mean_drawn_time_and_cu_is_zero_without_a_network(ds, linear):
  """Speed factors exp(0.3 z), jitter and stragglers are not mean-one, so Table 4's Cp is the
  mean of the drawn times (recomputed here from the stateless ComputeModel), and ASP on an
  ideal network then has Cu ~ 0 (only the steps still in flight at the end)."""
  from mfopt.sim import suite
  cm = sim.ComputeModel(0.05, speed_spread=0.3, jitter_sigma=0.2, straggler_prob=0.05,
                        straggler_slowdown=4.0)
  s = sim.Simulator(sim.ASP(sim.BaseSGD(0.1)), model=linear, dataset=ds, num_workers=4,
                    per_worker_batch=8, seed=0, network=None, compute=cm)
  s.run(max_samples=8 * 400)
  res = s.result()
  drawn = [cm.time(s.speeds, 0, w, n) for w in range(4) for n in range(int(s.w_step[w]))]
  assert res.summary["compute_s_per_step"] == pytest.approx(np.mean(drawn), rel=1e-12)
  assert res.summary["compute_s_per_step"] / 0.05 > 1.2  # the nominal Cp would be far off
  t = suite.per_step_times(res)
  assert abs(t["cu_per_local_step"]) < 0.02 * res.summary["compute_s_per_step"]


def test_a_pull_carries_the_broadcast_of_its_version(ds, linear):
  """Spec §4: a worker pulls (θ, t, k_last, r_last) as one message. With long pulls the server
  updates while one is in flight; the k a worker adopts must still be the k of its version."""
  adopted = []

  class Recording(sim.Simulator):
    def adopt(self, w, v, bcast=None):
      super().adopt(w, v, bcast)
      adopted.append((v, float(self.w_bcast[w, 0])))

  s = Recording(sim.ksync_preset("working", alpha0=0.05), model=linear, dataset=ds,
                num_workers=8, per_worker_batch=8, network="1gbit", payload_bytes=4e6,
                compute=sim.ComputeModel(0.01, speed_spread=0.5, jitter_sigma=0.3))
  s.run(max_server_steps=25)
  k_of = {0: float(s.strategy.config.ktest.k_min)}  # broadcast before the first update
  k_of.update({int(v): float(k) for v, _, k in s.result().k_trace})
  later = [(v, k) for v, k in adopted if v > 0]
  assert len(later) > 50 and len({k for _, k in later}) > 1
  assert [k for _, k in later] == [k_of[v] for v, _ in later]


def test_paired_claim_needs_every_seed_and_two_std_of_the_paired_differences():
  """SPEC's verdict rule on per-seed pairs; NaN = never reached the target."""
  from mfopt.sim import suite
  nan = float("nan")
  claim = suite.paired_claim
  # a review's case: ours reached the target in 1 of 3 seeds -> never "reproduced"
  assert claim({0: 10, 1: nan, 2: nan}, {0: 20, 1: 21, 2: 22}).startswith(
      "not reproduced at this scale (ours reached the target in 1/3")
  assert claim({0: 10}, {0: 20}) == "not reproduced at this scale (1 seed: no spread)"
  assert claim({0: 10, 1: 11, 2: 12}, {0: 20, 1: 21, 2: 22}) == "reproduced"
  # paired: a large spread across seeds but a consistent per-seed gain is reproduced ...
  assert claim({0: 10, 1: 50, 2: 90}, {0: 12, 1: 52.5, 2: 91.5}) == "reproduced"
  # ... and a gain smaller than 2 std of the paired differences is not
  assert claim({0: 10, 1: 10, 2: 10}, {0: 11, 1: 9.5, 2: 12}).startswith("not reproduced")
  # between 1 and 2 std: gains 1, 0.5, 2 (mean 1.17, sample std 0.76) are not reproduced
  assert claim({0: 10, 1: 10, 2: 10}, {0: 11, 1: 10.5, 2: 12}).startswith("not reproduced")
  assert claim({0: 10, 1: 10, 2: 10}, {0: 11, 1: 10.9, 2: 11.2}) == "reproduced"
  assert claim({0: 10, 1: 11}, {0: nan, 1: nan}).startswith("reproduced (ours reached")
  assert claim({0: 10, 1: 11, 2: 12}, {0: 20, 1: nan, 2: 22}) == (
      "reproduced (the baseline reached the target in 2/3 seeds)")
  assert claim({0: 0.9, 1: 0.8}, {0: 0.5, 1: 0.45}, lower_is_better=False) == "reproduced"
  # accuracy: NaN is a diverged run, which voids the claim (a baseline diverged in every seed
  # was "reproduced (ours reached the target ...)")
  assert claim({0: 0.9, 1: 0.8}, {0: nan, 1: nan}, lower_is_better=False,
               nan_means="diverged") == "not reproduced at this scale (2 of 4 runs diverged)"
  assert claim({0: 0.9, 1: 0.8}, {0: 0.5, 1: 0.45}, lower_is_better=False,
               nan_means="diverged") == "reproduced"
  assert suite.holds_in_every_seed({0: True}).startswith("consistent in 1 seed (not a test")
  assert suite.holds_in_every_seed({0: True, 1: False}) == (
      "not reproduced at this scale (holds in 1/2 seeds)")
  assert suite.holds_in_every_seed({0: True, 1: True}) == "reproduced"


def test_a_diverging_run_stops_at_the_evaluation_that_sees_it(ds, linear):
  # A two-layer ReLU MLP at lr 100 (a linear model's loss only grows linearly in lr): its
  # server model overflows within a few evaluations; the run stops there (not at max_samples),
  # flags it, and a checkpoint of the stopped run stays stopped.
  mlp = models.get_model("mlp", hidden=(16, 16), num_classes=10)

  def build():
    return sim.Simulator(sim.ASP(sim.BaseSGD(100.0)), model=mlp, dataset=ds, num_workers=4,
                         per_worker_batch=8, network=None, eval_every_samples=64,
                         compute=sim.ComputeModel(0.01))
  s = build()
  s.run(max_samples=64 * 40)
  res = s.result()
  assert res.summary["diverged"] and res.summary["diverged_at_samples"] == s.samples
  assert s.samples < 64 * 40
  assert not np.isfinite(res.history[-1]["test_loss"])
  assert all(np.isfinite(h["test_loss"]) for h in res.history[:-1])
  again = build()
  again.load_state_dict(pickle.loads(pickle.dumps(s.state_dict())))
  again.run(max_samples=64 * 40)
  assert again.samples == s.samples and again.result().summary["diverged"]
  fine = sim.Simulator(sim.ASP(sim.BaseSGD(0.05)), model=linear, dataset=ds, num_workers=4,
                       per_worker_batch=8, network=None, eval_every_samples=64,
                       compute=sim.ComputeModel(0.01))
  fine.run(max_samples=64 * 4)
  assert fine.result().summary["diverged"] is False and fine.samples == 64 * 4


def test_suite_tables_count_diverged_runs():
  rows = [{"k": "a", "seed": s, "diverged": s == 2, "acc": [0.8, 0.9, float("nan")][s]}
          for s in range(3)]
  rows += [{"k": "b", "seed": s, "diverged": True, "acc": float("nan")} for s in range(3)]
  table = {r["k"]: r for r in suite.aggregate(rows, ("k",), ("acc",))}
  assert table["a"]["diverged"] == 1 and table["b"]["diverged"] == 3
  assert suite.pm(table["a"], "acc") == "0.85 ± 0.071 (2/3; 1 diverged)"
  assert suite.pm(table["b"], "acc") == "diverged (3/3)"


def test_simulate_checkpoints_inside_auto_checkpoint_and_returns_a_finished_run(ds, linear,
                                                                                 tmp_path):
  # What the runner sets up for every experiment: the simulated run saves into the policy's
  # next run directory; a rerun finds it finished and returns the same result without
  # simulating (no row logged again).
  from mfopt import checkpoint

  def go():
    rows = []
    with checkpoint.auto_checkpoint(tmp_path / "ckpts", min_interval_s=0.0):
      res = sim.simulate(sim.ASP(sim.BaseSGD(0.05)), model=linear, dataset=ds, num_workers=4,
                         per_worker_batch=8, max_samples=8 * 120, eval_every_samples=200,
                         compute=sim.ComputeModel(0.01, jitter_sigma=0.2), on_log=rows.append)
    return res, rows

  first, rows1 = go()
  saved = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
  assert len(saved) == 1 and saved[0].startswith("000-")
  again, rows2 = go()
  assert len(rows1) > 1 and rows1 == first.history[:len(rows1)] and rows2 == []
  assert again.history == first.history
  assert repr(sorted(again.summary.items())) == repr(sorted(first.summary.items()))  # nan-safe
  # the time spent simulating is the saved run's, not the seconds the rerun took to load it
  assert again.wall_s == first.wall_s > 0


def test_a_strategy_that_never_releases_its_workers_stalls_loudly(ds, linear):
  """A user strategy whose on_push applies the gradient but never sends the worker the model
  emptied the event queue after one round; simulate returned as if finished (64 of 4,000
  samples). It now names the stall."""
  class NoSend(sim.ASP):
    def on_push(self, s, w):
      self._update(s, s.msg[w].grad)  # (no s.send(w))
      s.record_update(k=1)

  with pytest.raises(RuntimeError, match=r"simulation stalled: no event is left at 32 samples, "
                                         r"server version 4, .*Strategy 'ASP.*must eventually"):
    sim.simulate(NoSend(sim.BaseSGD(0.05)), model=linear, dataset=ds, num_workers=4,
                 per_worker_batch=8, max_samples=8 * 120, compute=sim.ComputeModel(0.01))


def test_a_strategy_subclass_must_list_its_own_constructor_settings(ds, linear):
  """SETTINGS are a simulated run's checkpoint fingerprint; a subclass inherited its parent's,
  so its own argument changed on resume went unnoticed. Refused before anything runs; listed,
  it is in the fingerprint."""
  class StaleLR(sim.SSP):
    def __init__(self, staleness=3, base=None, alpha=1.0):
      super().__init__(staleness, base)
      self.alpha = alpha

  kw = dict(model=linear, dataset=ds, num_workers=4, per_worker_batch=8, max_samples=64,
            compute=sim.ComputeModel(0.01))
  with pytest.raises(ValueError, match=r"StaleLR.__init__ takes \['alpha'\] that its SETTINGS "
                                       r"\('staleness', 'base'\) does not list; add them \(e.g. "
                                       r"SETTINGS = SSP.SETTINGS \+ \('alpha',\)\)"):
    sim.simulate(StaleLR(alpha=0.5), **kw)

  class Listed(StaleLR):
    SETTINGS = sim.SSP.SETTINGS + ("alpha",)

  sim.simulate(Listed(alpha=0.5), **kw)
  assert Listed(alpha=0.5).settings()["alpha"] == 0.5


def test_simulate_checkpoints_every_n_events_when_the_policy_says(ds, linear, tmp_path):
  """--checkpoint-every N (the policy's ``every``) spaces a simulated run's saves by N events;
  it was ignored (always 2000-event chunks: one save for a short run)."""
  from mfopt import checkpoint

  def saves(every):
    root = tmp_path / f"every{every}"
    with checkpoint.auto_checkpoint(root, every=every, keep=1000):
      sim.simulate(sim.ASP(sim.BaseSGD(0.05)), model=linear, dataset=ds, num_workers=4,
                   per_worker_batch=8, max_samples=8 * 120, compute=sim.ComputeModel(0.01))
    (run,) = root.iterdir()
    return sorted(int(p.name) for p in run.iterdir() if p.name.isdigit())

  assert len(saves(None)) == 1
  assert len(saves(50)) > 3


def test_run_resumable_saves_at_the_interval_and_always_at_the_end(ds, linear, tmp_path):
  from mfopt import checkpoint
  s = sim.Simulator(sim.ASP(sim.BaseSGD(0.05)), model=linear, dataset=ds, num_workers=4,
                    per_worker_batch=8, compute=sim.ComputeModel(0.01))
  saves = []
  checkpoint.run_resumable(s, tmp_path / "c", chunk_events=50, min_interval_s=1e9,
                           on_checkpoint=saves.append, max_samples=8 * 100)
  assert s.samples == 8 * 100 and len(saves) == 1 and saves[0] > 1  # chunks ran, one save
  # max_events is the chunking, not a limit: named, instead of a TypeError from engine.run
  with pytest.raises(ValueError, match=r"max_events=100 is not a limit it supports"):
    checkpoint.run_resumable(s, tmp_path / "d", chunk_events=50, max_events=100)


def test_easgd_arithmetic_matches_a_numpy_replay_of_its_events(ds, linear):
  """EASGD (TF EAO): the simulator's local steps and exchanges, replayed in NumPy from the
  recorded gradients in the order they happened, give the same local copies and centre."""
  events = []

  class Recorded(sim.EASGD):
    def on_compute_done(self, s, w):
      events.append(("step", w, s.out[w].grad.copy(), np.float32(self.base.lr(s.epoch))))
      super().on_compute_done(s, w)

    def on_push(self, s, w):
      events.append(("push", w))
      super().on_push(s, w)

  m, interval = 3, 4
  s = sim.Simulator(Recorded(interval=interval, base=sim.BaseSGD(0.1, decay_rate=1.0)),
                    model=linear, dataset=ds, num_workers=m, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=0.5))
  theta0 = s.theta.copy()
  s.run(max_samples=8 * 60)
  assert sum(e[0] == "push" for e in events) >= m  # every worker exchanged at least once
  a = np.float32(0.9 / (interval * m))  # TF's default moving rate
  local, center_loc, center = np.tile(theta0, (m, 1)), np.tile(theta0, (m, 1)), theta0.copy()
  for e in events:
    if e[0] == "step":
      _, w, g, eta = e
      local[w] = local[w] - eta * g - a * (local[w] - center_loc[w])
    else:
      w = e[1]
      delta = local[w] - center
      center_loc[w] = center
      local[w] = local[w] - a * delta
      center = center + a * delta
  np.testing.assert_allclose(s.strategy.local, local, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s.theta, center, rtol=1e-6, atol=1e-7)
  assert np.abs(center - theta0).max() > 1e-3  # the centre moved


def test_a_simulated_run_resumes_only_its_own_checkpoints(tmp_path):
  """The checkpoint fingerprint named the strategy only ('ASP'): a run with another learning
  rate, compute model or duplex setting came back with the first run's results. Each
  setting is in it now, and the same settings still resume."""
  from mfopt import checkpoint
  ds = data.load("digits")
  model = models.get_model("mlp", hidden=(8,), num_classes=10)

  def go(lr=0.05, compute=None, duplex=True, strategy=None):
    with checkpoint.auto_checkpoint(tmp_path):
      return sim.simulate(strategy or sim.ASP(sim.BaseSGD(lr)), model=model, dataset=ds,
                          num_workers=2, per_worker_batch=8, max_samples=160, seed=0,
                          compute=compute, duplex=duplex).summary

  first = go()
  again = go()  # the finished run comes back
  assert again["sim_time_s"] == first["sim_time_s"] and again["samples"] == first["samples"]
  for kw, field in ((dict(lr=5.0), "settings.base.learning_rate: 0.05 -> 5.0"),
                    (dict(compute=sim.ComputeModel(1.0)), "compute.base_s: "),
                    (dict(duplex=False), "duplex: True -> False")):
    with pytest.raises(checkpoint.ConfigMismatchError, match=re.escape(field)):
      go(**kw)
  ksync = [sim.ksync_preset("working", alpha0=a) for a in (0.05, 0.1)]
  assert ksync[0].settings() != ksync[1].settings()  # nested dataclass fields (config.bb.alpha0)
  assert ksync[0].settings()["config"]["bb"]["alpha0"] == 0.05


def _spy_pushes(strategy):
  """Records (server version, message version, gradient) of every push the server sees."""
  received, on_push = [], strategy.on_push

  def spy(sim_, w):
    m = sim_.msg[w]
    received.append((sim_.version, m.version, m.grad.astype(np.float64).copy()))
    on_push(sim_, w)

  strategy.on_push = spy
  return received


def test_dropworker_steps_with_the_mean_of_its_first_k_fresh_gradients(ds, linear):
  """DropWorker's update replayed in NumPy from the pushes: the first k = ceil(M/2) fresh
  gradients of each version averaged (dividing by M instead of k passed every test), stale
  ones dropped. M = 5 gives k = 3, where ceil and round differ."""
  strat = sim.DropWorker(base=sim.BaseSGD(0.1, decay_rate=1.0))
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=5, per_worker_batch=4,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=1.0))
  theta0 = s.theta.astype(np.float64).copy()
  received = _spy_pushes(strat)
  s.run(max_server_steps=12)
  assert strat.k == 3
  theta, fresh, t, dropped = theta0, [], 0, 0
  for version, v, g in received:
    assert version == t
    if v != t:
      dropped += 1
      continue
    fresh.append(g)
    if len(fresh) == 3:
      theta, fresh, t = theta - 0.1 * np.mean(fresh, axis=0), [], t + 1
  assert t == 12 and dropped == s.dropped > 0
  np.testing.assert_allclose(s.theta, theta, rtol=0, atol=2e-6)


def test_sim_epochs_and_mean_staleness_are_what_they_say(ds, linear):
  """The summary's epochs are samples / N for M > 1 (server steps x b / N passed every test),
  and the mean staleness is the staleness histogram's mean (dividing by the number of distinct
  staleness values did too)."""
  strat = sim.ASP(sim.BaseSGD(0.05, decay_rate=1.0))
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=4, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=0.5),
                    eval_every_samples=96)
  s.run(max_samples=8 * 60)
  res = s.result()
  summary = res.summary
  assert summary["samples"] >= 8 * 60
  assert summary["epochs"] == pytest.approx(summary["samples"] / len(ds.train))
  assert [r["epoch"] for r in res.history] == pytest.approx(
      [r["samples"] / len(ds.train) for r in res.history])
  pairs = [(int(t), int(n)) for t, n in res.staleness.items()]
  assert len(pairs) > 2  # (several staleness values: a mean over them would differ)
  assert summary["mean_staleness"] == pytest.approx(
      sum(t * n for t, n in pairs) / sum(n for _, n in pairs))


def test_base_sgd_decays_once_per_epoch():
  """lr = LR x DR^floor(epoch), a staircase (DR^epoch, smooth, passed every test)."""
  base = sim.BaseSGD(0.1, decay_rate=0.99)
  assert base.lr(0.0) == base.lr(0.5) == base.lr(0.999) == pytest.approx(0.1)
  assert base.lr(1.0) == base.lr(1.7) == pytest.approx(0.099)
  assert base.lr(2.0) == pytest.approx(0.1 * 0.99 ** 2)


def test_half_duplex_link_reports_the_shared_lanes_busy_fraction_for_both_directions():
  """A half-duplex link carries pushes and pulls on one lane, so each direction's utilisation
  is that lane's busy time over the simulated time (0.3 s of 4 s here), not a share of it."""
  net = costmodel.Link("test", bandwidth=1000.0, latency=0.5)
  half = sim.ServerLink(net, duplex=False)
  half.transfer(0.0, 100.0, 0)
  half.transfer(0.0, 100.0, 1)
  half.transfer(1.0, 100.0, 0)  # busy 0.1 s each: 0.3 s on the one lane
  u = half.utilisation(4.0)
  assert u == {"push": pytest.approx(0.3 / 4.0), "pull": pytest.approx(0.3 / 4.0)}


def _logged_asp_run(ds, linear, eval_every, max_samples):
  """ASP on 2 equal workers (b = 8): the history, and (samples, loss) of every finished step."""
  steps = []

  class Recorded(sim.ASP):
    def on_compute_done(self, s, w):
      steps.append((s.samples, s.out[w].loss))
      super().on_compute_done(s, w)

  s = sim.Simulator(Recorded(sim.BaseSGD(0.05, decay_rate=1.0)), model=linear, dataset=ds,
                    num_workers=2, per_worker_batch=8, network=None,
                    compute=sim.ComputeModel(0.01), eval_every_samples=eval_every)
  s.run(max_samples=max_samples)
  return s.result().history, steps


def test_the_final_summary_evaluates_the_model_the_run_ends_on(ds, linear):
  """One worker, a slow link: a gradient's samples count when it is computed, its server
  step comes a push later. Stopped by server steps, the last logged row had this sample count
  but an older server version, and the summary reported that model's loss as final."""
  net = costmodel.Link("slow", bandwidth=8000.0, latency=0.25)
  s = sim.Simulator(sim.ASP(sim.BaseSGD(0.5)), model=linear, dataset=ds, num_workers=1,
                    per_worker_batch=4, compute=sim.ComputeModel(0.5), network=net,
                    eval_every_samples=8)
  s.run(max_server_steps=6)
  r = s.result()
  assert r.summary["server_steps"] == 6 == r.history[-1]["server_step"]
  assert r.summary["test_loss"] == s.evaluate()["test_loss"]
  assert [row["server_step"] for row in r.history].count(6) == 1
  assert any(row["samples"] == r.history[-1]["samples"] and row["server_step"] < 6
             for row in r.history[:-1])  # the stale row the summary used to read


def test_evaluations_land_at_the_first_sample_count_past_each_multiple(ds, linear):
  """Rows are due at multiples of eval_every_samples (20, 40, 60, 80): each is logged at the
  first sample count (a multiple of b = 8) that reaches it, so 24, 40, 64, 80. Rescheduling
  from the sample count of the last row (48, 72) or waiting to pass a due count exactly
  reached (48 instead of 40) drifts off that grid."""
  history, _ = _logged_asp_run(ds, linear, eval_every=20, max_samples=80)
  want = [int(np.ceil(20 * i / 8)) * 8 for i in range(1, 5)]
  assert want == [24, 40, 64, 80]
  assert [r["samples"] for r in history] == want


def test_train_loss_of_a_row_is_the_mean_over_the_steps_since_the_previous_row(ds, linear):
  """A row's train_loss averages the losses of every step finished since the last row (3, 2,
  3 and 2 steps here), so it is not the noisy loss of the step that happened to trigger it."""
  history, steps = _logged_asp_run(ds, linear, eval_every=20, max_samples=80)
  bounds = [0] + [r["samples"] for r in history]
  for lo, hi, row in zip(bounds, bounds[1:], history):
    losses = [loss for n, loss in steps if lo < n <= hi]
    assert len(losses) == (hi - lo) // 8 >= 2
    assert np.ptp(losses) > 1e-4  # distinct losses: the last one alone is not their mean
    assert row["train_loss"] == pytest.approx(np.mean(losses), rel=1e-9)


def test_easgd_exchanges_after_every_interval_th_local_step(ds, linear):
  """Spec §5 (TF ElasticAverageOptimizer): a worker pushes its local copy after its local
  steps number tau_c, 2 tau_c, ...; exchanging after step 1, tau_c + 1, ... would make the
  first exchange before any local progress and one exchange too many."""
  interval = 3
  strat = sim.EASGD(interval, sim.BaseSGD(0.1, decay_rate=1.0))
  s = sim.Simulator(strat, model=linear, dataset=ds, num_workers=2, per_worker_batch=8,
                    network=None, compute=sim.ComputeModel(0.01, speeds=[1.0, 1.7]))
  at = [[], []]  # local step count at each push, per worker
  push = s.push

  def spy(w):
    at[w].append(int(strat.local_steps[w]))
    push(w)

  s.push = spy
  s.run(max_samples=8 * 20)
  for w in range(2):
    n = int(strat.local_steps[w])
    assert n >= 2 * interval + 1 and n % interval != 0  # (n = 3q would not tell 0 from 1)
    assert at[w] == list(range(interval, n + 1, interval))
    assert s.pushes[w] == n // interval


def test_a_bb_step_is_not_doubled_when_the_broadcast_k_did_not_grow(ds, linear):
  """ensmallen's double_on_k_increase doubles α only when the k adopted with a pull exceeds the
  previous one. With a fixed k = 2 it never grows, so turning the rule on must change
  nothing; treating an equal k as grown would double α at every step after the first."""
  def run(double):
    cfg = sim.ksync_config("working", alpha0=0.05, k_rule=2)  # (the bb of an earlier test)
    cfg = dataclasses.replace(cfg, bb=dataclasses.replace(cfg.bb, double_on_k_increase=double))
    s = sim.Simulator(sim.KSync(cfg), model=linear, dataset=ds, num_workers=2, per_worker_batch=8,
                      network=None, compute=sim.ComputeModel(0.01))
    s.run(max_server_steps=8)
    return s

  off, on = run(False), run(True)
  assert on.bb_stats["bb_applied"] > 0  # steps with a previous version, where it could fire
  assert on.lr_traces == off.lr_traces
  assert on.bb_stats == off.bb_stats
  np.testing.assert_array_equal(on.theta, off.theta)


def test_easgd_workers_use_their_base_momentum(ds, linear):
  """EASGD(base=BaseSGD(momentum=0.9)) ran plain SGD (the momentum was ignored; a review). With
  one worker that never exchanges (interval past the run) and a negligible elastic rate, its
  local copy follows heavy-ball SGD on its own gradients: ASP with the same base on 1 worker."""
  base = sim.BaseSGD(0.1, decay_rate=1.0, momentum=0.9)
  common = dict(model=linear, dataset=ds, num_workers=1, per_worker_batch=8, network=None)
  e = sim.Simulator(sim.EASGD(10 ** 6, base, moving_rate=1e-12), **common)
  e.run(max_events=12)
  steps = int(e.w_step[0])
  a = sim.Simulator(sim.ASP(base), **common)
  a.run(max_server_steps=steps)
  assert steps >= 5
  np.testing.assert_allclose(e.strategy.local[0], a.theta, rtol=1e-5, atol=1e-6)
  plain = sim.Simulator(sim.ASP(sim.BaseSGD(0.1, decay_rate=1.0)), **common)
  plain.run(max_server_steps=steps)
  assert np.abs(plain.theta - a.theta).max() > 1e-3  # momentum matters on this path
  # a checkpoint round trip keeps each worker's momentum
  d = e.state_dict()
  e2 = sim.Simulator(sim.EASGD(10 ** 6, base, moving_rate=1e-12), **common)
  e2.load_state_dict(d)
  e.run(max_events=4)
  e2.run(max_events=4)
  np.testing.assert_array_equal(e.strategy.local, e2.strategy.local)
  del d["strategy"]["opts"]  # written while EASGD ignored its momentum: refused, not mixed
  with pytest.raises(ValueError, match="before EASGD used its base momentum"):
    e2.load_state_dict(d)


def test_link_utilisation_counts_only_elapsed_busy_time(ds, linear):
  """Transfers queued past the current time counted as busy already: half duplex, BSP, 4
  workers, 1 s per message reported 1.116 (a review). Transfers run back to back from their
  request, so the busy time still ahead of sim_time is free_at - sim_time."""
  slow = costmodel.Link("slow", 2600.0, 0.5)  # 1,640 B messages (410 float32): 0.63 s each
  for duplex in (False, True):
    s = sim.Simulator(sim.BSP(sim.BaseSGD(0.1, decay_rate=1.0)), model=linear, dataset=ds,
                      num_workers=4, per_worker_batch=8, network=slow, duplex=duplex)
    s.run(max_server_steps=3)
    u = s.result().summary
    busy_ahead = [max(0.0, f - s.now) for f in s.link.free_at]
    want = [(b - a) / s.now for b, a in zip(s.link.busy, busy_ahead)]
    assert 0 < u["link_utilisation_push"] <= 1 and 0 < u["link_utilisation_pull"] <= 1
    assert u["link_utilisation_push"] == pytest.approx(want[0])
    assert u["link_utilisation_pull"] == pytest.approx(want[1] if duplex else want[0])
    assert any(a > 0 for a in busy_ahead)  # (the case that exceeded 1: pulls still queued)


def test_simulated_time_that_never_advances_is_refused_with_max_time(ds, linear, tmp_path):
  """base_s = 0 and no network time: every event at time 0, and run(max_time=...) spun
  forever, also chunked by run_resumable (its max_events is no end) and on a zero-latency link
  with no payload. (An alarm turns a regression into a failure, not a hung suite.)"""
  import signal

  def hung(*_):
    raise TimeoutError("run(max_time) did not return: the clock never advances")

  old = signal.signal(signal.SIGALRM, hung)
  signal.alarm(60)
  try:
    for network, payload in ((None, None), (costmodel.Link("ideal", 1e9, 0.0), 0)):
      s = sim.Simulator(sim.ASP(sim.BaseSGD()), model=linear, dataset=ds, num_workers=2,
                        per_worker_batch=4, network=network, compute=sim.ComputeModel(0.0),
                        payload_bytes=payload)
      with pytest.raises(ValueError, match="max_time: simulated time never advances"):
        s.run(max_time=1.0)
      with pytest.raises(ValueError, match="max_time: simulated time never advances"):
        from mfopt import checkpoint
        checkpoint.run_resumable(s, tmp_path / str(payload), chunk_events=50, max_time=1.0)
      s.run(max_time=1.0, max_samples=16)  # another limit ends it
      assert s.samples >= 16
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_result_between_runs_changes_nothing(ds, linear):
  """result() mid-run appended a row to the run's history and emptied its train-loss window,
  so the rest of the curve changed (a review); and an eval interval smaller than a step's
  samples logged extra rows at sample-less events (arrivals): one row per sample count."""
  kw = dict(model=linear, dataset=ds, num_workers=3, per_worker_batch=8, network="1gbit")
  a = sim.Simulator(sim.ASP(sim.BaseSGD()), eval_every_samples=50, **kw)
  a.run(max_samples=120)
  before = list(a.history)
  mid = a.result()  # (the last row is at 100: result() evaluates one at 120)
  assert a.history == before and mid.history[-1]["samples"] == 120 and a.window
  a.run(max_samples=240)
  b = sim.Simulator(sim.ASP(sim.BaseSGD()), eval_every_samples=50, **kw)
  b.run(max_samples=240)
  assert a.history == b.history
  c = sim.Simulator(sim.ASP(sim.BaseSGD()), eval_every_samples=5, **kw)
  c.run(max_samples=240)
  samples = [r["samples"] for r in c.history]
  assert len(samples) == len(set(samples)) and samples == sorted(samples)


@pytest.mark.parametrize("make", [lambda: sim.ASP(), lambda: sim.SSP(), lambda: sim.EASGD(2),
                                  lambda: sim.BSP()], ids=["ASP", "SSP", "EASGD", "BSP"])
def test_every_server_version_is_in_the_k_trace(ds, linear, make):
  """SPEC: every run reports its k trace. ASP, SSP and EASGD recorded none (mean_k was NaN in
  the async tables); each of their versions comes from one worker (k = 1), BSP's from all M."""
  s = sim.Simulator(make(), model=linear, dataset=ds, num_workers=4, per_worker_batch=4,
                    network=None, compute=sim.ComputeModel(0.01, speed_spread=1.0))
  s.run(max_server_steps=12)
  result = s.result()
  k = 4 if isinstance(s.strategy, sim.BSP) else 1
  assert [int(v) for v, _, _ in result.k_trace] == list(range(1, s.version + 1))
  assert s.version >= 12 and {kk for _, _, kk in result.k_trace} == {k}
  assert result.summary["mean_k"] == k
  times = [t for _, t, _ in result.k_trace]
  assert times == sorted(times) and times[-1] <= result.summary["sim_time_s"]


def test_suite_run_passes_the_runs_workers_epochs_evaluation_and_payload(monkeypatch):
  """suite.run turns the config into simulator arguments: the run's own worker count and epoch
  budget (async_scaling varies both), evaluation every eval_every_epochs of the *training* set,
  and a payload of 4 bytes per float32 parameter; a diverged run's final metrics become NaN."""
  import types
  from mfopt.sim import run as run_lib
  seen = {}

  def fake(strategy, **kw):
    seen.update(kw)
    return run_lib.SimResult("s", [], {"diverged": True, "test_accuracy": 0.1, "test_loss": 2.3,
                                       "final_train_loss": 2.2}, [], {}, [], [])

  monkeypatch.setattr(run_lib, "simulate", fake)
  c = suite.base_config(quick=True)
  c.epochs, c.eval_every_epochs, c.payload_params, c.progress = 2.0, 0.5, 1000, False
  dataset = types.SimpleNamespace(train=range(1000), test=range(200))
  res = suite.run(c, None, dataset=dataset, model=None, network=None, seed=3, num_workers=2,
                  epochs=1.5)
  assert (seen["num_workers"], seen["max_samples"], seen["eval_every_samples"]) == (2, 1500, 500)
  assert (seen["payload_bytes"], seen["seed"], seen["per_worker_batch"]) == (4000, 3, 16)
  assert all(np.isnan(res.summary[k]) for k in ("test_accuracy", "test_loss", "final_train_loss"))
  suite.run(c, None, dataset=dataset, model=None, network=None, seed=0)
  assert (seen["num_workers"], seen["max_samples"]) == (c.num_workers, 2000)


def test_to_target_counts_worker_steps_as_samples_over_the_global_batch():
  """The seed's "training steps (counted by the worker)" at the first evaluation reaching the
  target are samples / (M b): 640 samples at M = 4, b = 16 are 10 steps, not 160."""
  from mfopt.sim import run as run_lib
  hist = [{"test_accuracy": 0.2, "server_step": 3, "sim_time": 1.0, "samples": 320},
          {"test_accuracy": 0.5, "server_step": 7, "sim_time": 3.5, "samples": 640},
          {"test_accuracy": 0.6, "server_step": 9, "sim_time": 5.0, "samples": 960}]
  res = run_lib.SimResult("s", hist, {"num_workers": 4, "per_worker_batch": 16}, [], {}, [], [])
  assert suite.to_target(res, 0.45) == {"steps_to_target": 7.0, "time_to_target": 3.5,
                                        "samples_to_target": 640.0, "worker_steps_to_target": 10.0,
                                        "target_at_first_eval": False}
  # reached at the first evaluation: only an upper bound, flagged, counted per group and named
  first = suite.to_target(res, 0.1)
  assert first["target_at_first_eval"] and first["samples_to_target"] == 320.0
  assert not suite.to_target(res, 0.9)["target_at_first_eval"]  # (never reached)
  rows = [{"strategy": "ASP", "workers": m, "seed": s, **suite.to_target(res, t)}
          for m, t in ((1, 0.1), (2, 0.45)) for s in (0, 1)]
  rows[1]["target_at_first_eval"] = False
  table = suite.aggregate(rows, ("strategy", "workers"), ("samples_to_target",))
  assert [r["target_at_first_eval"] for r in table] == [1, 0]
  line, = suite.first_eval_lines(table, ("strategy", "workers"))
  assert line.startswith("- **Reached the target at the first evaluation**: strategy=ASP "
                         "workers=1 (1/2 seeds). Their time, samples and steps to target are")
  assert suite.first_eval_lines(table[1:], ("strategy", "workers")) == []
  rows[1]["target_at_first_eval"] = True  # both seeds of the group: counted, not flagged
  both = suite.aggregate(rows, ("strategy", "workers"), ("samples_to_target",))
  assert [r["target_at_first_eval"] for r in both] == [2, 0]
  assert "strategy=ASP workers=1 (2/2 seeds)." in suite.first_eval_lines(
      both, ("strategy", "workers"))[0]


def test_suite_groups_and_selects_rows_on_every_key():
  """Tables group by all their keys (network and strategy): pooling two networks' runs would
  average unlike settings; per_seed selects rows matching every given key, not any of them."""
  rows = [{"net": n, "s": s, "seed": seed, "t": t}
          for n, s, seed, t in [("a", "X", 0, 1.0), ("a", "X", 1, 3.0), ("b", "X", 0, 10.0),
                                ("b", "X", 1, 14.0), ("a", "Y", 0, 7.0)]]
  table = {(r["net"], r["s"]): r for r in suite.aggregate(rows, ("net", "s"), ("t",))}
  assert set(table) == {("a", "X"), ("b", "X"), ("a", "Y")}
  assert table[("a", "X")]["t_mean"] == 2.0 and table[("b", "X")]["t_mean"] == 12.0
  assert table[("b", "X")]["t_std"] == pytest.approx(np.std([10.0, 14.0], ddof=1))
  assert suite.per_seed(rows, "t", net="a", s="X") == {0: 1.0, 1: 3.0}
  assert suite.per_seed(rows, "t", net="b", s="X") == {0: 10.0, 1: 14.0}


def test_paired_claim_uses_the_sample_std_of_the_differences():
  """Two seeds with gains 1 and 2.5: mean 1.75, sample std (ddof=1) 1.06, so 2 std = 2.12 is
  not exceeded (not reproduced); the population std 0.75 would have called it reproduced."""
  d = np.array([1.0, 2.5])
  assert d.mean() < 2 * d.std(ddof=1) and d.mean() > 2 * d.std()
  assert suite.paired_claim({0: 10.0, 1: 10.0}, {0: 11.0, 1: 12.5}).startswith("not reproduced")


def test_suite_strategies_and_full_config_follow_the_seeds_tables():
  """The full preset uses Table 3's decay 0.99 per epoch and ResNet101's EASGD interval 10;
  each registry entry gets its own config field (SSP its staleness), the reaverage variant its
  stale merge, and the decay-schedule variant of the seed's model the baselines' schedule."""
  c = suite.base_config(quick=False)
  assert (c.decay_rate, c.easgd_interval) == (0.99, 10)
  c.ssp_staleness, c.easgd_interval = 5, 7
  assert suite.STRATEGIES["SSP"](c).staleness == 5
  assert suite.STRATEGIES["EASGD"](c).interval == 7
  assert suite.STRATEGIES["KSync[working,reaverage]"](c).config.stale_merge == "reaverage"
  assert suite.STRATEGIES["KSync[working]"](c).config.stale_merge == "additive"
  decay = suite.ksync_variant("working", bb=False)(c).config
  assert decay.bb is None
  assert decay.lr_fallback == sim.BaseSGD(c.learning_rate, c.decay_rate, None)


def test_ksync_presets_match_the_specs_defaults_and_remedies():
  """faithful is the spec's [A] table (gamma 0.9 undampened, theta 0.9, 95 %, k in [2, M], cheap
  nu, Armijo 0.1 / 0.5 / 10, clamp [1e-6, 10 alpha_0], no floor); working adds dampening,
  exact nu, k_max = 8 and the floor 1e-3 alpha_0 (section 7), and nothing else."""
  f = sim.ksync_config("faithful", alpha0=0.07)
  assert (f.gamma, f.dampening, f.stale_merge, f.stale_cutoff) == (0.9, False, "additive", None)
  kt = f.ktest
  assert (kt.theta, kt.confidence, kt.ci_mode, kt.k_min, kt.k_max) == (
      0.9, 0.95, "upper_signed", 2, None)
  bb = f.bb
  assert (bb.alpha0, bb.nu, bb.armijo_c, bb.backtrack, bb.max_bt) == (0.07, "cheap", 0.1, 0.5, 10)
  assert (bb.clamp, bb.alpha_min, bb.alpha_max_factor, bb.alpha_floor_factor) == (
      True, 1e-6, 10.0, None)
  w = sim.ksync_config("working", alpha0=0.07)
  assert w.dampening is True and w.ktest.k_max == 8
  assert (w.bb.nu, w.bb.alpha_floor_factor, w.bb.alpha0) == ("exact", 1e-3, 0.07)
  same = dataclasses.replace(w, dampening=False, ktest=dataclasses.replace(w.ktest, k_max=None),
                             bb=dataclasses.replace(w.bb, nu="cheap", alpha_floor_factor=None))
  assert same == f
  assert sim.ksync_preset("working", label="mine").label == "mine"
  assert sim.ksync_preset("working").label == "KSync[working]"
