"""``mfopt.parallel.worker_mesh`` in one process (the multi-process layout: test_multiprocess)."""

import jax
import pytest

import mfopt
from mfopt import parallel


@pytest.mark.parametrize("num_workers,size", [
    (1, 1), (2, 2), (3, 3), (6, 6), (7, 7), (8, 8), (9, 3), (12, 6), (16, 8), (24, 8), (96, 8)])
def test_worker_mesh_is_the_largest_dividing_prefix_of_the_devices(num_workers, size):
  assert len(jax.devices()) == 8
  mesh = parallel.worker_mesh(num_workers)
  assert list(mesh.devices.flat) == jax.devices()[:size]
  assert num_workers % mesh.shape[parallel.DATA_AXIS] == 0
  # the brute-force rule: no larger prefix of the devices divides num_workers
  assert all(num_workers % k for k in range(size + 1, 9))
  assert parallel.local_workers(num_workers, mesh) == num_workers // size


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "8"])
def test_worker_mesh_names_a_bad_worker_count(bad):
  with pytest.raises(ValueError, match=rf"num_workers must be a positive integer, got {bad!r}"):
    parallel.worker_mesh(bad)


def test_worker_mesh_refuses_workers_that_do_not_split_over_the_processes(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"num_workers must be a multiple of the process count 2 "
                                       r"\(every process trains an equal share.*got 3"):
    parallel.worker_mesh(3)


def test_make_mesh_takes_any_iterable_of_devices_and_scheduled_period_names_the_item():
  """A generator of devices was consumed by make_mesh's type check and then refused as
  "got []"; scheduled_period's errors said "periods[i]" literally instead of the index."""
  mesh = mfopt.make_mesh(d for d in jax.devices()[:3])
  assert mesh.devices.tolist() == jax.devices()[:3]
  with pytest.raises(ValueError, match=r"periods\[1\] must be a positive integer, got 0"):
    mfopt.scheduled_period((20, 0), (100,))
  with pytest.raises(ValueError, match=r"boundaries\[0\] must be a positive integer, got -5"):
    mfopt.scheduled_period((20, 5), (-5,))


def test_unstack_worker_refuses_the_first_index_past_the_last_worker():
  """Index W (one past the last of W workers) is refused: JAX clamps an out-of-range index, so
  it would silently return worker W-1's slice; index W-1 is the last worker's own row."""
  import jax.numpy as jnp
  import numpy as np
  stacked = {"w": jnp.arange(8.0).reshape(4, 2)}
  np.testing.assert_array_equal(parallel.unstack_worker(stacked, 3)["w"], [6.0, 7.0])
  with pytest.raises(ValueError, match=r"index must be < the number of workers 4, got 4"):
    parallel.unstack_worker(stacked, 4)


def test_make_mesh_refuses_an_empty_device_list_by_name():
  """An empty device list is refused by make_mesh with the argument's name, not by a failure
  inside jax.make_mesh about a zero-sized mesh."""
  with pytest.raises(ValueError, match=r"devices must be a non-empty sequence, got \[\]"):
    parallel.make_mesh([])
