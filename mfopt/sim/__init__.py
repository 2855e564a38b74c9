"""mfopt.sim: a deterministic *simulated* asynchronous parameter-server cluster (seed 002).

Time in this package is simulated (a virtual clock); gradients are real. See
:mod:`mfopt.sim.run` for the event model, tie-breaking and checkpointing,
:mod:`mfopt.sim.server` for the strategies, :mod:`mfopt.sim.ksync` for the
k-test and :mod:`mfopt.sim.bb` for the per-worker Barzilai-Borwein step.
"""

from mfopt.sim.bb import BBConfig, make_bb_step
from mfopt.sim.clock import ComputeModel, EventQueue, ServerLink
from mfopt.sim.ksync import KTestConfig, Welford, choose_k, k_test
from mfopt.sim.presets import PRESETS, ksync_config, ksync_preset
from mfopt.sim.run import SimResult, Simulator, simulate
from mfopt.sim.server import (ASP, BSP, EASGD, SSP, AllReduce, BaseSGD, DropWorker, KSync,
                              KSyncConfig, Strategy)

__all__ = [
    "ASP", "BSP", "EASGD", "SSP", "AllReduce", "BaseSGD", "DropWorker", "KSync", "KSyncConfig",
    "Strategy", "BBConfig", "make_bb_step", "ComputeModel", "EventQueue", "ServerLink",
    "KTestConfig", "Welford", "choose_k", "k_test", "PRESETS", "ksync_config", "ksync_preset",
    "SimResult", "Simulator", "simulate",
]
