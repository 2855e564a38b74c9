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
