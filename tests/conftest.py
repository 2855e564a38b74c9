"""Test setup: 8 fake CPU devices and a persistent compilation cache, before JAX initialises.

Multi-device code is tested on fake CPU devices (ARCHITECTURE.md). The device
count must be set before any JAX backend starts, and XLA_FLAGS is never
overwritten after import, so it is done here, at collection time.
"""

import os
import pathlib

import jax

NUM_DEVICES = 8
os.environ.pop("MFOPT_LOWERING", None)  # tests pick their lowering explicitly (fit default: vmap)
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
jax.config.update("jax_platforms", "cpu")

from mfopt.runner import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get("MFOPT_JAX_CACHE")
                         or pathlib.Path(__file__).resolve().parents[1] / ".jax_cache")
