"""Multi-process (multi-host) start-up: ``jax.distributed.initialize`` from flags or the environment.

One process per host (or per GPU), all running the same command. Each process
calls :func:`initialize` before touching any JAX device; afterwards
``jax.devices()`` lists the devices of every process, ``mfopt.parallel.make_mesh()``
builds the global mesh over all of them, and :func:`mfopt.train.fit` feeds each
process's devices only the rows of its own workers (``parallel.process_worker_slice``,
assembled with ``jax.make_array_from_process_local_data``; each process reads and augments
only its own workers' rows, ``WorkerBatcher.batch(step, workers)``, with per-example
augmentation seeds, so the batches do not depend on the process layout; a batch-wide
``ArraySource`` ``augment`` draws the whole batch and keeps the rows). Checkpoints are
written by all processes into one shared directory (orbax).

Where the settings come from, first match wins:

1. explicit arguments (the runner's ``--coordinator``, ``--num-processes``,
   ``--process-id`` flags);
2. ``MFOPT_COORDINATOR`` (``host:port``), ``MFOPT_NUM_PROCESSES``,
   ``MFOPT_PROCESS_ID`` (set by ``scripts/launch_local.py``);
3. JAX's own cluster detection (SLURM, Open MPI, Kubernetes, cloud TPU), used
   when none of the above is set and ``MFOPT_DISTRIBUTED=1`` asks for it
   (runner flag ``--distributed``); e.g. ``srun`` with one task per GPU.

Failure handling is JAX's coordination service: every process sends heartbeats
to the coordinator; when a process dies, the others are aborted with an error
after ``heartbeat_timeout_s`` (JAX's default is 100 s; set
``MFOPT_HEARTBEAT_TIMEOUT`` or the argument lower to fail faster), instead of
hanging in a collective. A process whose peers never join waits ``initialization_timeout_s``
(300 s; ``MFOPT_INIT_TIMEOUT``) and says first what it waits for.

On CPU (tests, laptops) the cross-process collectives need gloo:
:func:`initialize` selects it (``jax_cpu_collectives_implementation="gloo"``)
unless ``cpu_collectives`` says otherwise. ``MFOPT_NUM_CPU_DEVICES`` sets the
number of fake CPU devices per process (``jax_num_cpu_devices``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

ENV_COORDINATOR = "MFOPT_COORDINATOR"
ENV_NUM_PROCESSES = "MFOPT_NUM_PROCESSES"
ENV_PROCESS_ID = "MFOPT_PROCESS_ID"
ENV_HEARTBEAT = "MFOPT_HEARTBEAT_TIMEOUT"
ENV_NUM_CPU_DEVICES = "MFOPT_NUM_CPU_DEVICES"
ENV_AUTO = "MFOPT_DISTRIBUTED"
ENV_INIT_TIMEOUT = "MFOPT_INIT_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins the job (``None`` fields: left to JAX's cluster detection)."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  heartbeat_timeout_s: int | None = None


def _int_or_none(name: str, value) -> int | None:
  if value is None or value == "":
    return None
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be an integer, got {value!r}") from None
  return number


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, heartbeat_timeout_s: int | None = None,
            environ=None) -> DistributedConfig | None:
  """The settings from arguments, then the environment; ``None`` for a single-process run.

  Raises ``ValueError`` naming the bad setting (a partial or inconsistent set,
  a process id out of range, a malformed address) before anything starts.
  """
  env = os.environ if environ is None else environ
  address = coordinator_address or env.get(ENV_COORDINATOR) or None
  count = _int_or_none("num_processes", num_processes if num_processes is not None
                       else env.get(ENV_NUM_PROCESSES))
  pid = _int_or_none("process_id", process_id if process_id is not None else env.get(ENV_PROCESS_ID))
  heartbeat = _int_or_none("heartbeat_timeout_s", heartbeat_timeout_s if heartbeat_timeout_s
                           is not None else env.get(ENV_HEARTBEAT))
  if heartbeat is not None and heartbeat <= 0:
    raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat!r}")
  given = {"coordinator_address": address, "num_processes": count, "process_id": pid}
  if all(v is None for v in given.values()):
    if env.get(ENV_AUTO) == "1":
      return DistributedConfig(None, None, None, heartbeat)  # JAX detects the cluster
    return None
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"multi-process settings are incomplete: {', '.join(missing)} missing "
                     f"(got {given}); pass all three or none")
  if count < 1:
    raise ValueError(f"num_processes must be >= 1, got {count!r}")
  if not 0 <= pid < count:
    raise ValueError(f"process_id must be in [0, {count}), got {pid!r}")
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator_address must look like host:port, got {address!r}")
  return DistributedConfig(address, count, pid, heartbeat)


def configure_cpu(num_cpu_devices: int | None = None, cpu_collectives: str | None = "gloo") -> None:
  """CPU-only settings that must precede backend start-up: fake devices and gloo collectives."""
  count = _int_or_none("num_cpu_devices", num_cpu_devices if num_cpu_devices is not None
                       else os.environ.get(ENV_NUM_CPU_DEVICES))
  if count is not None:
    if count < 1:
      raise ValueError(f"num_cpu_devices must be >= 1, got {count!r}")
    jax.config.update("jax_num_cpu_devices", count)
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_s: int | None = None,
               num_cpu_devices: int | None = None, cpu_collectives: str | None = "gloo",
               initialization_timeout_s: int | None = None,
               exit_on_error: bool = True) -> DistributedConfig | None:
  """Joins the multi-process job if one is configured; returns its settings (``None``: single process).

  Call before any other JAX call that touches devices. Idempotent.

  With ``exit_on_error`` (default), an uncaught exception ends this process at once after its
  traceback is printed (exit code 1; 130 for Ctrl-C) instead of by Python's normal exit, whose
  ``jax.distributed.shutdown`` waits (5 minutes) at a barrier that the other processes, stuck
  in a collective with this one, never reach: one process's error hung the whole job for 5
  minutes, then every process aborted and the launcher named the wrong one. Now the others
  stop at the heartbeat timeout. (It sets ``sys.excepthook``; pass ``False`` to keep yours.)

  Args:
    coordinator_address: ``host:port`` of process 0's coordination service.
    num_processes: total number of processes.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    heartbeat_timeout_s: seconds without heartbeats after which the job is
      aborted (JAX's default 100 when ``None``).
    num_cpu_devices: fake CPU devices per process (CPU runs only).
    cpu_collectives: CPU cross-process collectives implementation ("gloo").
    initialization_timeout_s: how long to wait for all processes to join (``None``:
      ``MFOPT_INIT_TIMEOUT``, else 300 s).
    exit_on_error: end the process at once on an uncaught exception (above).

  Example:
    Every process, before building the mesh:

    >>> import os, mfopt
    >>> mfopt.distributed.initialize("10.0.0.1:8476", 2, int(os.environ["RANK"]))  # doctest: +SKIP
  """
  settings = resolve(coordinator_address, num_processes, process_id, heartbeat_timeout_s)
  configure_cpu(num_cpu_devices, cpu_collectives if settings is not None else None)
  if settings is None:
    return None
  if jax.distributed.is_initialized():  # joined already (here or by the caller)
    return settings
  timeout = _int_or_none("initialization_timeout_s", initialization_timeout_s
                         if initialization_timeout_s is not None
                         else os.environ.get(ENV_INIT_TIMEOUT))
  timeout = 300 if timeout is None else timeout
  if timeout <= 0:
    raise ValueError(f"initialization_timeout_s must be positive, got {timeout!r}")
  kwargs = {"initialization_timeout": timeout}
  if settings.heartbeat_timeout_s is not None:
    kwargs["heartbeat_timeout_seconds"] = settings.heartbeat_timeout_s
  if settings.process_id == 0:
    _check_port_free(settings.coordinator_address)
  # (a process whose peers failed before joining waited 300 s in silence)
  where = ("the cluster's coordinator (detected by JAX)" if settings.coordinator_address is None
           else f"{settings.coordinator_address}")
  pid = "?" if settings.process_id is None else settings.process_id
  print(f"mfopt.distributed: process {pid} joining {settings.num_processes or 'the'} processes "
        f"at {where} (waits up to {timeout} s, {ENV_INIT_TIMEOUT})", file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(settings.coordinator_address, settings.num_processes,
                               settings.process_id, **kwargs)
  except ValueError as e:
    if settings.coordinator_address is not None or "coordinator_address" not in str(e):
      raise
    # (JAX's own words, "coordinator_address should be defined.", did not say why or what to do)
    raise ValueError(
        f"--distributed ({ENV_AUTO}=1): JAX detected no cluster here (SLURM, Open MPI, "
        "Kubernetes JobSet, ...), so it has no coordinator address; outside such a job pass "
        "--coordinator HOST:PORT --num-processes N --process-id I (or scripts/launch_local.py "
        f"on one machine). JAX said: {e}") from None
  # the coordinator's count won; in auto-detect mode (SLURM, ...) there is no count to compare
  # (comparing None failed every job that mode started)
  if settings.num_processes is not None and jax.process_count() != settings.num_processes:
    raise ValueError(f"num_processes (--num-processes) is {settings.num_processes} here but the "
                     f"job that process 0 started has {jax.process_count()} processes; give "
                     "every process the same value")
  if exit_on_error and jax.process_count() > 1:
    _exit_on_uncaught_error()
  return settings


#: Seconds a failing process waits for the others to fail too (:func:`exit_now`).
EXIT_BARRIER_S = 5.0


def exit_now(code: int) -> None:
  """In a job of several processes, ends a failing one (``code != 0``) at once, skipping
  ``jax.distributed.shutdown``'s barrier (see :func:`initialize`); returns otherwise.

  Unless every process is failing: it first waits up to :data:`EXIT_BARRIER_S` at a
  coordination barrier, and if all arrive (a config error, Ctrl-C forwarded to all) it
  returns, and they exit normally together. Process 0 ending at once there took the
  coordination service with it, and the others aborted (SIGABRT) before printing their own
  error. A finished process (``code == 0``) must take the shutdown barrier."""
  if not (code and jax.distributed.is_initialized() and jax.process_count() > 1):
    return
  if _every_process_arrives("mfopt_exit_now", EXIT_BARRIER_S):
    return
  print(f"mfopt.distributed: process {jax.process_index()} ends with exit code {code} without "
        "the shutdown barrier (the others stop at their heartbeat timeout)", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _every_process_arrives(barrier: str, timeout_s: float) -> bool:
  """Whether every process reaches the coordination service's ``barrier`` within
  ``timeout_s`` (JAX's distributed client; False where it cannot be asked)."""
  try:
    from jax._src import distributed as jax_distributed  # noqa: PLC0415  (no public barrier)
    jax_distributed.global_state.client.wait_at_barrier(barrier, int(timeout_s * 1000))
    return True
  except Exception:  # noqa: BLE001  (timed out, a peer gone, or no client)
    return False


def _exit_on_uncaught_error() -> None:
  previous = sys.excepthook
  if getattr(previous, "mfopt_exits", False):
    return

  def hook(exc_type, exc, tb):
    try:
      previous(exc_type, exc, tb)
    finally:
      exit_now(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

  hook.mfopt_exits = True
  sys.excepthook = hook


def _check_port_free(address: str) -> None:
  """Process 0 hosts the coordination service on ``address``'s port (on every interface); a
  port in use crashed it inside gRPC with a segfault. Say so first."""
  import socket  # noqa: PLC0415
  port = int(address.rsplit(":", 1)[1])
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    # SO_REUSEADDR as gRPC binds it: the last job's TIME_WAIT connections on the port do not
    # count (a rerun on a fixed port was refused for about a minute); a listener still does.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(("", port))
    except OSError as e:
      raise ValueError(f"coordinator port {port} (--coordinator {address}) is in use on this "
                       f"host ({e.strerror}); pick a free port for the job") from e

