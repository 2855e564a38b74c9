"""XLA:CPU deadlock with many queued steps of an in-process all-reduce: a pure-JAX reproducer.

Why mfopt's ``train.fit`` waits for the step ``MAX_STEPS_IN_FLIGHT`` back (mfopt/train.py).
No mfopt code: a jitted ``shard_map`` step with one ``psum`` over ``--devices`` CPU devices,
dispatched ``--steps`` times without waiting (JAX's asynchronous dispatch queues them), then
``block_until_ready``. With jaxlib 0.10.2 on 8 devices and no limit, the process aborts: some
device threads wait at the all-reduce's rendezvous for devices whose part never starts, and XLA
ends the process after its collective timeout ("Termination timeout for `all reduce ...`").
``--limit K`` waits for the step K back after each dispatch, as fit does, and finishes.

    python scripts/xla_cpu_deadlock_repro.py                 # 8 devices, 2000 steps, no limit
    python scripts/xla_cpu_deadlock_repro.py --limit 8       # fit's bound: finishes

The script sets XLA's collective timeouts to 1 s (warning) and ``--timeout`` seconds (abort,
default 5) unless XLA_FLAGS is already set. Exit code 0: finished; 134 (SIGABRT): the abort.
Measured 2026-11-25 on a 2-core VM, jaxlib 0.10.2 (BENCHMARKS.md, session 14): without a
limit it aborted on 2, 4 and 8 devices (2 of 2 runs each); limits of 8 to 30 finished.
"""

import argparse
import os
import sys


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--steps", type=int, default=2000)
  p.add_argument("--limit", type=int, default=0, help="wait for the step LIMIT back (0: never)")
  p.add_argument("--timeout", type=int, default=5, help="XLA's collective abort timeout, s")
  p.add_argument("--width", type=int, default=256)
  a = p.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 "
                        f"--xla_cpu_collective_call_terminate_timeout_seconds={a.timeout}")
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", a.devices)
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((a.devices,), ("x",))

  def step(w, x):
    g = jax.lax.psum(x.T @ jnp.tanh(x @ w), "x") / a.devices  # one all-reduce per step
    return w - 0.01 * g, jnp.sum(g)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P())),
              donate_argnums=0)
  w = jnp.zeros((a.width, a.width))
  x = jax.device_put(jnp.ones((a.devices * 16, a.width)), NamedSharding(mesh, P("x")))
  outs = []
  for _ in range(a.steps):
    w, out = f(w, x)
    outs.append(out)
    if a.limit and len(outs) > a.limit:
      jax.block_until_ready(outs[-1 - a.limit])
  jax.block_until_ready(w)
  print(f"finished {a.steps} steps on {a.devices} devices, limit {a.limit or 'none'} "
        f"(jax {jax.__version__})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
