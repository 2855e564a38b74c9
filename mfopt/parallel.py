"""The worker mesh: worker-stacked state, virtual workers, and the per-worker map.

Layout (ARCHITECTURE.md). Every per-worker quantity (parameters, optimizer state,
BatchNorm statistics, batches) carries a leading worker axis of size ``W``,
sharded over the 1-D mesh axis :data:`DATA_AXIS`. When ``W`` exceeds the number
of devices ``D`` (``W`` must be a multiple of ``D``), each device holds ``W / D``
*virtual workers*, mapped with ``jax.vmap(axis_name=LOCAL_AXIS)`` inside
``jax.shard_map`` over ``DATA_AXIS``. A collective over all workers therefore
names both axes, :data:`WORKER_AXES`; transforms receive that tuple as their
``axis_name``.

Two facts of JAX 0.10/0.11 this module respects:

* ``shard_map`` runs with ``check_vma=False``: with the default check, any
  collective naming the ``vmap`` axis inside ``shard_map`` is rejected.
* ``jax.make_mesh`` defaults to Explicit axis types, under which host-side
  indexing of a worker-stacked array fails; the mesh here uses Auto axis types,
  and inputs are ``device_put`` with the ``NamedSharding`` ``shard_map`` expects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mfopt import _checks

DATA_AXIS = "data"
LOCAL_AXIS = "local"
WORKER_AXES = (DATA_AXIS, LOCAL_AXIS)


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh named :data:`DATA_AXIS` over ``devices`` (default: all devices of all processes)."""
  if devices is not None and isinstance(devices, Iterable) and not isinstance(devices, str):
    devices = list(devices)  # (a generator was consumed by the check below: "got []")
  if devices is not None and (isinstance(devices, (int, str)) or not isinstance(devices, Iterable)
                              or not all(isinstance(d, jax.Device) for d in devices)):
    raise ValueError(f"devices must be a sequence of jax.Device (e.g. jax.devices()[:4]) or "
                     f"None for all devices, got {devices!r}")
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise ValueError("devices must be a non-empty sequence, got []")
  repeated = [d for i, d in enumerate(devices) if d in devices[:i]]
  if repeated:
    raise ValueError(f"devices must be distinct, got {repeated[0]!r} "
                     f"{devices.count(repeated[0])} times in {devices!r}")
  return jax.make_mesh((len(devices),), (DATA_AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def worker_mesh(num_workers: int) -> Mesh:
  """The largest mesh that ``num_workers`` split over evenly, with as many devices from each process.

  ``num_workers`` workers need a mesh whose size divides ``num_workers``. In one process
  this is the first ``k`` devices, ``k`` the largest divisor of ``num_workers`` not above
  the device count (6 workers on 8 devices: 6 devices, one worker each). In a job of ``P``
  processes every process must own the same share of the workers (each feeds and
  checkpoints its own rows), so the mesh is the first ``k`` devices of every process, ``k``
  the largest divisor of ``num_workers / P`` not above a process's device count (6 workers
  on 2 processes x 4 devices: 3 + 3 devices; the first ``W`` of all 8 devices would put
  4 workers on one process and 2 on the other). Raises ``ValueError`` when ``num_workers``
  is not a multiple of ``P``: one worker cannot span processes.
  """
  num_workers = _checks.positive_int("num_workers", num_workers)
  procs = jax.process_count()
  if num_workers % procs:
    raise ValueError(
        f"num_workers must be a multiple of the process count {procs} (every process trains "
        f"an equal share of the workers), got {num_workers}")
  by_process: dict[int, list[jax.Device]] = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  per_process = min(len(v) for v in by_process.values())
  share = num_workers // procs
  k = max(j for j in range(1, per_process + 1) if share % j == 0)
  return make_mesh([d for p in sorted(by_process) for d in by_process[p][:k]])


def local_workers(num_workers: int, mesh: Mesh) -> int:
  """Virtual workers per device; raises unless ``num_workers`` is a positive multiple of the device count."""
  num_devices = mesh.shape[DATA_AXIS]
  _checks.positive_int("num_workers", num_workers)
  if num_workers % num_devices:
    raise ValueError(
        f"num_workers must be a multiple of the device count {num_devices} "
        f"(workers are split evenly over the '{DATA_AXIS}' mesh axis), got {num_workers}")
  return num_workers // num_devices


def worker_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a worker-stacked array: leading axis over :data:`DATA_AXIS`."""
  return NamedSharding(mesh, P(DATA_AXIS))


def shard_workers(tree: Any, mesh: Mesh) -> Any:
  """Places a worker-stacked tree on the mesh (leading axis sharded over workers).

  In a multi-process run each process passes only the rows of *its* workers
  (the workers on its addressable devices, in mesh order), and the global array
  is assembled with ``jax.make_array_from_process_local_data``.
  """
  sharding = worker_sharding(mesh)
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def process_worker_slice(num_workers: int, mesh: Mesh) -> slice:
  """The rows of the worker axis that this process feeds (all of them in one process)."""
  per_device = local_workers(num_workers, mesh)
  devices = list(mesh.devices.flat)
  mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
  if mine != list(range(mine[0], mine[-1] + 1)):
    raise ValueError("this process's devices must be contiguous in the mesh")
  return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def stack_workers(tree: Any, num_workers: int) -> Any:
  """Replicates a single-worker tree into a worker-stacked one (identical replicas).

  Host (NumPy) leaves stay on the host as zero-copy broadcast views, so that
  :func:`shard_workers` sends each device only its own replicas (``jnp.broadcast_to`` would
  first materialise all ``num_workers`` replicas on one device); other leaves (device arrays,
  typed PRNG keys) are broadcast with ``jnp``.
  """
  _checks.positive_int("num_workers", num_workers)

  def one(x):
    shape = (num_workers,) + np.shape(x)
    if isinstance(x, (np.ndarray, np.generic)):
      return np.broadcast_to(x, shape)
    return jnp.broadcast_to(x, shape)

  return jax.tree.map(one, tree)


def per_worker(fn: Callable[..., Any], mesh: Mesh, num_workers: int) -> Callable[..., Any]:
  """Maps ``fn`` over the worker axis of its (worker-stacked) arguments.

  ``fn`` sees one worker's slice of every argument and may call collectives over
  :data:`WORKER_AXES` (or over either axis alone). Arguments and results are
  worker-stacked and sharded over :data:`DATA_AXIS`. The result is not jitted;
  wrap it in ``jax.jit``.
  """
  return per_device(jax.vmap(fn, axis_name=LOCAL_AXIS), mesh, num_workers)


def per_device(fn: Callable[..., Any], mesh: Mesh, num_workers: int) -> Callable[..., Any]:
  """Runs ``fn`` once per device on that device's block of workers (leading axis ``W/devices``).

  The lower-level sibling of :func:`per_worker`: ``fn`` chooses how to map over its
  device's workers (``vmap`` with ``axis_name=LOCAL_AXIS`` for collectives, ``lax.map``, ...)
  and may call collectives over :data:`DATA_AXIS`. Arguments and results are worker-stacked
  and sharded over :data:`DATA_AXIS`. Not jitted.
  """
  local_workers(num_workers, mesh)
  return jax.shard_map(fn, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS),
                       check_vma=False)


def unstack_worker(tree: Any, index: int = 0) -> Any:
  """Worker ``index``'s slice of a worker-stacked tree, fetched to the host.

  In a multi-process run the slice of a global array is one program over all its devices
  (JAX returns it replicated, so every process can read it): every process must call this,
  and every process gets the same slice (test_multiprocess reads each of 6 workers on 3 + 3
  devices back in both processes).
  """
  _checks.nonnegative_int("index", index)
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(tree) if np.ndim(x)}
  if sizes and index >= min(sizes):  # (JAX clamps an out-of-range index: another worker's data)
    raise ValueError(f"index must be < the number of workers {min(sizes)}, got {index}")
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x[index])), tree)


def worker_mean(tree: Any) -> Any:
  """Mean over the worker axis (in float32 for floating leaves), as a jnp tree."""
  def one(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return x[0]
  return jax.tree.map(one, tree)
