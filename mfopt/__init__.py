"""mfopt: distributed-training optimizers as Optax transformations.

Public API (SPEC.md): transforms compose with ``optax.chain``; every
communicating transform takes an ``axis_name`` (``None`` = one worker).

``mfopt.adabound`` and ``mfopt.qsgd`` are the transforms SPEC.md names, which shadow their
modules as package attributes: ``import mfopt.qsgd as q`` gives the function. Import the
modules' other names directly (``from mfopt.qsgd import quantize``) or use the aliases
``mfopt._adabound_module`` and ``mfopt._qsgd_module``.
"""

# Infrastructure: worker mesh, data, models, the generic train step, reliability.
from mfopt import (checkpoint, comm, costmodel, data, distributed, models, parallel, report,
                   train)
from mfopt.comm import CommStats, chain, comm_totals, differentiable_gates, sync_gradients
from mfopt.parallel import DATA_AXIS, LOCAL_AXIS, WORKER_AXES, make_mesh

# Seed 000: momentum-like factors, and the §3.1 BatchNorm analysis.
from mfopt import bn_analysis, mf
from mfopt.mf import (check_mf_conditions, linear_scaling_rule, mf_adam, mf_nesterov, mf_sgd,
                      noise_scale, scale_by_mf_adam, scale_by_mf_nesterov, scale_by_mf_sgd)

# Seeds 001 and 003: periodic averaging (CPSGD, ADPSGD), block momentum, QSGD, theory.
from mfopt import averaging, theory
from mfopt.averaging import (PeriodController, adpsgd_period, averaging_metrics,
                             block_momentum, constant_period, periodic_averaging,
                             scheduled_period, sync_trace, variance_trace)
from mfopt import qsgd as _qsgd_module  # (the transform below shadows the module's name)
from mfopt.qsgd import qsgd

# Seed 002: the simulated asynchronous parameter-server cluster.
from mfopt import sim

# Seed 004: AdaBound, linear-scaling AdaBound -> LARS, mixed precision, BatchNorm strategies.
# (``mfopt.adabound`` is the transform; the module is ``mfopt._adabound_module``.)
from mfopt import adabound as _adabound_module
from mfopt.adabound import (adabound, hybrid_adabound_lars, hybrid_lars_learning_rate,
                            hybrid_switch_step, linear_scaling_adabound, linear_scaling_bounds,
                            scale_by_adabound, scale_by_linear_scaling_adabound)
from mfopt import batchnorm, metrics, precision

# Performance: synchronous workers as one replica with per-worker-group BatchNorm.
from mfopt import fastpath

__version__ = "0.1.0"
