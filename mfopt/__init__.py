"""mfopt: distributed-training optimizers as Optax transformations.

Public API (SPEC.md): transforms compose with ``optax.chain``; every
communicating transform takes an ``axis_name`` (``None`` = one worker).
"""

from mfopt import comm, data, models, parallel, report, train
from mfopt.comm import CommStats, comm_totals, sync_gradients
from mfopt.parallel import DATA_AXIS, LOCAL_AXIS, WORKER_AXES, make_mesh

# [issue 3: MF exports]
from mfopt import bn_analysis, mf
from mfopt.mf import (check_mf_conditions, linear_scaling_rule, mf_adam, mf_nesterov, mf_sgd,
                      noise_scale, scale_by_mf_adam, scale_by_mf_nesterov, scale_by_mf_sgd)
# [issue 4: averaging exports]
from mfopt import averaging, theory  # noqa: E402
from mfopt.averaging import (PeriodController, adpsgd_period, averaging_metrics,  # noqa: E402
                             block_momentum, constant_period, periodic_averaging,
                             scheduled_period, sync_trace)
from mfopt.qsgd import qsgd  # noqa: E402
# [issue 5: simulator exports]
from mfopt import sim  # noqa: E402  simulated asynchronous parameter-server cluster (seed 002)
# [issue 6: adabound exports]
from mfopt import adabound as _adabound_module  # noqa: E402
from mfopt.adabound import (adabound, hybrid_adabound_lars, linear_scaling_adabound,  # noqa: E402
                            scale_by_adabound, scale_by_linear_scaling_adabound)
from mfopt import batchnorm, metrics, precision  # noqa: E402
# [issue 8: perf exports]
from mfopt import fastpath  # noqa: E402

__version__ = "0.1.0"
