r"""Multi-worker BatchNorm strategies (seed 004 §2.2.3, Table 3.4).

During training every strategy but ``"sync"`` normalises each worker's fixed-size batch with
*that worker's* batch statistics (no communication). They differ in the population statistics
used for evaluation:

``"last_batch"`` (the seed's strategy)
    no moving average: the models run with ``bn_momentum=0``, so each worker's stored
    statistics are those of its last training batch; before evaluation the population
    statistics are their all-worker mean in float32,
    :math:`\mu = \frac1W\sum_w \mu_w`, :math:`\sigma^2 = \frac1W\sum_w \sigma^2_w`
    (the seed's "statistical average over all GPUs"; ``pooled=True`` adds the between-worker
    variance of the means, giving the variance of the union of the last batches).
``"moving_average"``
    flax's per-worker exponential moving average (momentum 0.9), averaged over workers in
    float32 for evaluation.
``"sync"``
    cross-worker synchronised BN: the models' ``bn_axis_name`` is the worker axes, so every
    worker normalises with the statistics of the global batch (an all-reduce per BN layer per
    step; flax exchanges ``E[x]`` and ``E[x^2]``), and keeps the moving average.

The all-worker mean is one logical all-reduce of the statistics (float32), done once before
evaluation; with worker-stacked state it is :func:`population_statistics`.

Seed: 004 §2.2.3 item 1), Table 3.4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mfopt import parallel

__all__ = ["STRATEGIES", "BNStrategy", "get_strategy", "population_statistics"]

STRATEGIES = ("last_batch", "moving_average", "sync")


@dataclasses.dataclass(frozen=True)
class BNStrategy:
  """One BN strategy: the model arguments it needs and how evaluation statistics are formed."""

  name: str
  bn_momentum: float
  synchronized: bool
  pooled: bool = False

  def model_kwargs(self, axis_name: Any = parallel.WORKER_AXES) -> dict[str, Any]:
    """``bn_momentum`` and ``bn_axis_name`` for ``mfopt.models.get_model``.

    ``axis_name``: the worker axes a ``"sync"`` strategy reduces its statistics over, the names
    your own ``shard_map``/``vmap`` binds (default: the library's ``("data", "local")``; a
    one-axis ``shard_map`` over ``"data"`` needs ``axis_name="data"``)."""
    return {"bn_momentum": self.bn_momentum,
            "bn_axis_name": axis_name if self.synchronized else None}


def get_strategy(name: str, *, pooled: bool = False) -> BNStrategy:
  """``"last_batch"`` | ``"moving_average"`` | ``"sync"`` (see the module docstring).

  ``pooled`` (a bool) applies to ``"last_batch"`` only, whose statistics are batch
  statistics; the others refuse it (it was accepted and dropped)."""
  if not isinstance(pooled, bool):
    raise ValueError(f"pooled must be a bool, got {pooled!r}")
  if pooled and name in STRATEGIES and name != "last_batch":
    raise ValueError(f"pooled=True applies to the 'last_batch' strategy only (the union of the "
                     f"workers' last batches), got pooled=True with {name!r}")
  if name == "last_batch":
    return BNStrategy(name, 0.0, False, pooled)
  if name == "moving_average":
    return BNStrategy(name, 0.9, False)
  if name == "sync":
    return BNStrategy(name, 0.9, True)
  raise ValueError(f"BN strategy must be one of {STRATEGIES}, got {name!r}")


def population_statistics(model_state: Any, strategy: BNStrategy | str = "last_batch") -> Any:
  """Evaluation statistics from worker-stacked ``model_state`` (leading axis ``W``).

  All-worker mean in float32 of every ``mean`` and ``var`` leaf; with ``pooled`` the ``var``
  leaves get ``+ Var_w[mean_w]`` (population variance of the union of equal-size batches).
  The result has no worker axis (feed it to ``mfopt.train.make_eval_fn``).

  ``model_state`` must be stacked: a ``mean``/``var`` leaf of one replica (``(C,)``) was
  averaged over its channels into a scalar, which flax's BatchNorm then broadcast in
  evaluation without complaint; it is refused, naming the leaf and its shape.
  """
  if isinstance(strategy, str):
    strategy = get_strategy(strategy)
  for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]:
    name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
    if name in ("mean", "var") and jnp.ndim(leaf) < 2:
      raise ValueError(
          f"model_state must be worker-stacked (leading axis W), got "
          f"{jax.tree_util.keystr(path)} of shape {tuple(jnp.shape(leaf))}: a BatchNorm "
          "statistic has a channel axis, so a stacked one has at least 2 dimensions")

  def mean32(x):
    return jnp.mean(jnp.asarray(x).astype(jnp.float32), axis=0)

  if not strategy.pooled:
    return jax.tree.map(mean32, model_state)

  def pooled(tree):
    if isinstance(tree, Mapping):  # (a flax FrozenDict too: it fell through to the plain mean)
      if set(tree) >= {"mean", "var"}:
        means = jnp.asarray(tree["mean"]).astype(jnp.float32)
        out = {k: mean32(v) for k, v in tree.items()}
        out["var"] = out["var"] + jnp.var(means, axis=0)
        return out
      return {k: pooled(v) for k, v in tree.items()}
    return jax.tree.map(mean32, tree)

  return pooled(dict(model_state))
