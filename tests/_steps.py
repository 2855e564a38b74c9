"""A shared test helper: a transform's trajectory on a fixed linear gradient field."""

import jax
import jax.numpy as jnp
import numpy as np
import optax


def run_linear_field(tx: optax.GradientTransformation, steps: int = 60):
  """``steps`` jitted updates of ``w`` (6 values in [-1, 1]) under the gradient ``2 w + 0.1``;
  returns the final ``w`` (NumPy) and the optimizer state."""
  p = {"w": jnp.linspace(-1.0, 1.0, 6)}
  s, update = tx.init(p), jax.jit(tx.update)
  for _ in range(steps):
    u, s = update(jax.tree.map(lambda a: 2.0 * a + 0.1, p), s, p)
    p = optax.apply_updates(p, u)
  return np.asarray(p["w"]), s


def worker_grid_trajectory(tx: optax.GradientTransformation, offsets, steps: int = 4):
  """Parameters after each of ``steps`` updates of ``tx`` by every worker of a (data, local)
  worker grid, as the library's worker vmap runs it (its axis names): ``offsets`` is
  ``(1, W, D)``, worker ``i``'s gradient ``2 w + offsets[0, i]``, ``w`` starting at ``D``
  values in [-1, 1]. Returns ``(1, W, steps, D)``."""
  from mfopt import parallel

  def one(off):
    def step(carry, _):
      p, s = carry
      u, s = tx.update(2.0 * p + off, s, p)
      p = optax.apply_updates(p, u)
      return (p, s), p

    p = jnp.linspace(-1.0, 1.0, off.shape[-1])
    return jax.lax.scan(step, (p, tx.init(p)), length=steps)[1]

  f = jax.vmap(jax.vmap(one, axis_name=parallel.LOCAL_AXIS), axis_name=parallel.DATA_AXIS)
  return np.asarray(jax.jit(f)(jnp.asarray(offsets, jnp.float32)))
