"""async_convergence: seed 002 Figs. 9-11 / Table 4 analogue in the simulated parameter-server cluster.

Command: ``python -m experiments async_convergence [--quick] [--workdir DIR] [key=value ...]``

Every algorithm (ASP, BSP, SSP s=3, EASGD, DropWorker 50 %, ring all-reduce, and
the seed's adaptive k-sync model in its ``faithful`` and ``working`` presets, the latter also
with ``stale_merge="reaverage"``: 9 in all)
trains the same MLP on mnist1d from the same initialisation with the same
per-worker data streams for the same number of samples, on 10 and 100 Gbit/s
server links. Reported: final test accuracy, server steps / simulated time /
samples to a target test accuracy (mean ± std over seeds), the Table 4
analogue (simulated compute "Cp" and everything else "Cu" per local step),
staleness, k and server-link utilisation. **All times are simulated** (mfopt.sim);
timing emulates ResNet101/Cifar100 (seed Tables 2 and 4) while the optimisation
runs on the small model, a mixed-scale simulation stated in the report.

Hardware/runtime: CPU; full preset (16 workers, 30 epochs, 3 seeds, 2 networks,
9 algorithms = 54 runs) 194 s on a quiet 2-core CPU (2026-11-24; 111 s on 2026-11-25; earlier 20-40 min at load
~20); ``--quick`` < 25 s.
Expected (paper): the seed's model needs fewer steps and less time than every
baseline, with a larger gain at 100 Gbit/s than at 10 Gbit/s.
Measured (2026-11-25, full preset, ``python -m experiments async_convergence progress=false``,
111 s; BB workers charged for their Armijo trials and, from their second step, exact-ν
gradients): not reproduced. KSync[working] never reached 0.45 test accuracy in 30 epochs (0/3
seeds, both networks); KSync[working,reaverage] reached it in 644 +- 120 / 468 +- 100 simulated
s (10 / 100 Gbit/s) against ASP's 169 +- 18 / 66 +- 2 s and SSP's 217 +- 28 / 93 +- 23 s.
"""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections
import numpy as np

from mfopt import costmodel, report, runner
from mfopt.sim import suite

# names it can build; the runner refuses others before anything runs
CHOICES = suite.CHOICES

SEED_MODEL = "KSync[working]"
#: the seed's model as the issue defines it (``working``) and with the spec's re-averaging merge
SEED_MODELS = (SEED_MODEL, "KSync[working,reaverage]")


def get_config(quick: bool = False) -> ml_collections.ConfigDict:
  """Config. Command: ``python -m experiments async_convergence`` (``--quick`` for CI).

  Hardware: CPU. Runtime: full preset (54 simulated runs) measured 194 s (2026-11-24) and 111 s
  (2026-11-25) on a quiet 2-core CPU; quick < 25 s.
  Expected metric: simulated time to the target test accuracy per algorithm and network.
  """
  c = suite.base_config(quick)
  c.networks = ("100gbit",) if quick else ("10gbit", "100gbit")
  c.strategies = (("ASP", "BSP", "all-reduce", SEED_MODEL) if quick else tuple(suite.STRATEGIES))
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  suite.validate_base(c, c.strategies)
  runner.require_choice(c, "networks", ("1gbit", "10gbit", "100gbit", "nvlink", "ndr400"))


FIELDS = ("test_accuracy", "final_train_loss", "steps_to_target", "time_to_target",
          "samples_to_target", "server_steps", "sim_time_s", "mean_staleness", "mean_k",
          "link_utilisation_push", "time_per_local_step", "cp_per_local_step", "cu_per_local_step",
          "exchanges_per_worker", "bytes_per_worker")


def run(c: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
  ds, model = suite.load(c)
  log = report.JsonlWriter(workdir / "metrics.jsonl")
  rows, curves_time, curves_step, staleness = [], {}, {}, {}
  for net in c.networks:
    curves_time[net], curves_step[net] = {}, {}
    for name in c.strategies:
      for seed in c.seeds:
        def on_log(row, name=name, net=net, seed=seed):
          log({"network": net, "strategy": name, "seed": seed, **row})
        res = suite.run(c, suite.STRATEGIES[name](c), dataset=ds, model=model, network=net,
                        seed=seed, desc=f"{net}/{name}/seed{seed}", on_log=on_log)
        s = res.summary
        row = {"network": net, "strategy": name, "seed": seed, "diverged": s["diverged"],
               **{k: s[k] for k in ("test_accuracy", "final_train_loss", "server_steps", "sim_time_s",
                                    "mean_staleness", "mean_k", "link_utilisation_push",
                                    "exchanges_per_worker", "bytes_per_worker")},
               **suite.to_target(res, c.target_accuracy), **suite.per_step_times(res)}
        rows.append(row)
        if seed == c.seeds[0]:
          curves_time[net][name] = ([h["sim_time"] for h in res.history],
                                    [h["test_accuracy"] for h in res.history])
          curves_step[net][name] = ([h["server_step"] for h in res.history],
                                    [h["test_accuracy"] for h in res.history])
          staleness[f"{net}/{name}"] = res.staleness
        print(f"{net:8s} {name:16s} seed {seed}: acc {s['test_accuracy']:.3f}, "
              f"simulated time {s['sim_time_s']:.1f} s, to target {row['time_to_target']:.1f} s")
  table = suite.aggregate(rows, ("network", "strategy"), FIELDS)
  claims = _claims(c, table, rows)
  report.write_json(workdir / "results.json", {"time_unit": suite.TIME_UNIT, "runs": rows,
                                               "table": table, "claims": claims,
                                               f"staleness_seed{c.seeds[0]}": staleness})
  report.plot_curves(workdir / "accuracy_vs_time.png", curves_time, xlabel="simulated time (s)",
                     ylabel="test accuracy", title=f"test accuracy vs simulated time (seed {c.seeds[0]})")
  report.plot_curves(workdir / "accuracy_vs_step.png", curves_step, xlabel="server step",
                     ylabel="test accuracy",
                     title=f"test accuracy vs server step (simulated, seed {c.seeds[0]})")
  _write_report(c, workdir, ds, table, claims)
  return {"table": table, "claims": claims}


def _claims(c, table, rows) -> list[dict[str, Any]]:
  by = {(r["network"], r["strategy"]): r for r in table}
  ours_names = [m for m in SEED_MODELS if m in c.strategies]
  out = []
  for ours in ours_names:
    for net in c.networks:
      me = by[(net, ours)]
      for name in c.strategies:
        if name.startswith("KSync"):
          continue
        other = by[(net, name)]
        for f in ("time_to_target", "samples_to_target"):
          out.append({"network": net, "claim": f"{ours} needs less {f.split('_')[0]} to target "
                      f"than {name}", "ours": suite.pm(me, f), "baseline": suite.pm(other, f),
                      "verdict": suite.paired_claim(
                          suite.per_seed(rows, f, network=net, strategy=ours),
                          suite.per_seed(rows, f, network=net, strategy=name))})
    if len(c.networks) >= 2 and "ASP" in c.strategies:
      # slowest and fastest link by bandwidth, in any order given (networks[0] and [-1]
      # compared the other way round when the tuple was given fastest first)
      by_speed = sorted(c.networks, key=lambda n: costmodel.link(n).bandwidth)
      lo, hi = by_speed[0], by_speed[-1]
      out.append(_gain_claim(rows, ours, lo, hi))
  return out


def _gain_claim(rows, ours: str, lo: str, hi: str) -> dict[str, Any]:
  """"The gain of ours over ASP in time to target is larger on the faster network", per seed:
  gain = ASP's time / ours (same seed and network), judged on the paired difference of the two
  networks' gains by SPEC.md's rule. Every seed must reach the target in all four runs. (A
  ratio of means compared ASP's mean over every seed with ours over the seeds that reached
  the target, and called one seed of three "consistent in sign".)"""
  t = {(net, name): suite.per_seed(rows, "time_to_target", network=net, strategy=name)
       for net in (lo, hi) for name in ("ASP", ours)}
  seeds = sorted(set.intersection(*(set(v) for v in t.values())))
  missed = []
  for (net, name), by_seed in t.items():
    miss = sum(not np.isfinite(v) for v in by_seed.values())
    if miss:
      missed.append(f"{name} on {net} missed it in {miss}/{len(by_seed)} seeds")
  gains = {net: np.array([t[(net, "ASP")][s] / t[(net, ours)][s] for s in seeds])
           for net in (lo, hi)}

  def show(net):
    g = gains[net]
    if not seeds or not np.isfinite(g).all():
      return f"{net}: n/a"
    return f"{net}: {g.mean():.3g}x" + (f" ± {g.std(ddof=1):.2g}" if len(g) > 1 else "")

  if missed or not seeds:
    verdict = ("not decidable (target not reached in every seed: " + "; ".join(missed) + ")"
               if missed else "not decidable (no seeds)")
  elif len(seeds) < 2:
    verdict = "not reproduced at this scale (1 seed: no spread)"
  else:
    d = gains[hi] - gains[lo]
    verdict = ("reproduced" if d.mean() > 0 and d.mean() > 2 * d.std(ddof=1)
               else "not reproduced at this scale")
  return {"network": f"{lo} vs {hi}", "claim": f"the gain of {ours} over ASP in time to target "
          "(ASP's time / ours, per seed) is larger on the faster network",
          "ours": show(hi), "baseline": show(lo), "verdict": verdict}


def _write_report(c, workdir, ds, table, claims) -> None:
  model_desc = f"MLP hidden {tuple(c.hidden)}, float32"
  lines = ["# async_convergence: seed 002 Figs. 9-11 / Table 4 analogue (simulated)\n"]
  lines += suite.setup_lines(c, ds, model_desc, c.networks,
                             f"- Target test accuracy: {c.target_accuracy:g}. Cells are mean ± std "
                             "over seeds; '(n/N)' when only n of N seeds reached the target. Samples to target = "
                             "worker steps x per-worker batch (the seed's 'steps counted by the "
                             "worker'); server steps are not comparable across algorithms (ASP "
                             "updates per gradient, BSP per M gradients).\n")
  lines += suite.first_eval_lines(table, ("network", "strategy"))
  cells = []
  for r in table:
    cells.append({"network": r["network"], "strategy": r["strategy"],
                  "acc": suite.pm(r, "test_accuracy"), "steps": suite.pm(r, "steps_to_target"),
                  "time": suite.pm(r, "time_to_target"), "samples": suite.pm(r, "samples_to_target"),
                  "stale": f"{r['mean_staleness_mean']:.3g}", "k": f"{r['mean_k_mean']:.3g}",
                  "util": f"{r['link_utilisation_push_mean']:.2f}",
                  "cp": f"{r['cp_per_local_step_mean']:.3g}",
                  "cu": f"{r['cu_per_local_step_mean']:.3g}",
                  "exch": f"{r['exchanges_per_worker_mean']:.4g}",
                  "bytes": f"{r['bytes_per_worker_mean']:.3g}"})
  lines.append("## Convergence (simulated time)\n")
  lines.append(report.markdown_table(
      cells, ["network", "strategy", "acc", "steps", "time", "samples", "stale", "k", "util"],
      ["network", "algorithm", "final test acc", "server steps to target",
       "simulated s to target", "samples to target", "mean staleness", "mean k",
       "server link utilisation (push)"]))
  lines.append("\n## Table 4 analogue: simulated time per local step\n")
  lines.append(f"Cp = mean simulated compute per local step as drawn (nominal {c.compute_s:g} s "
               "times speed factors, jitter and stragglers, which are not mean-one; the seed's "
               "BB workers also pay 1/3 step per Armijo trial and, with exact ν, one more "
               "gradient); Cu = simulated time per local step - Cp (communication, link "
               "queueing, barriers; server updates and k-tests take no simulated time). Seed Table 4, "
               "ResNet101/Cifar100 (32 workers): Cu = 8.11 s (ASP), 15.11 s (BSP), 12.11 s (SSP), "
               "9.11 s (ours), 6.81 s (DropWorker), 4.31 s (EAO) at 10 Gbit/s and 0.21 / 0.79 / "
               "0.66 / 0.3 / 0.53 / 0.03 s at 100 Gbit/s.\n")
  lines.append(report.markdown_table(cells, ["network", "strategy", "cp", "cu", "exch", "bytes"],
                                     ["network", "algorithm", "Cp per local step (s)",
                                      "Cu per local step (s)",
                                      "exchanges per worker (push + pull; all-reduce: "
                                      "collectives)", "bytes moved per worker (pushed + pulled; "
                                      "all-reduce: its payload once)"]))
  lines.append("\n## Seed claims\n")
  lines.append(report.markdown_table(claims, ["network", "claim", "ours", "baseline", "verdict"]))
  lines.append("\n![accuracy vs simulated time](accuracy_vs_time.png)\n")
  lines.append("![accuracy vs server step](accuracy_vs_step.png)\n")
  (workdir / "report.md").write_text("\n".join(lines) + "\n")
