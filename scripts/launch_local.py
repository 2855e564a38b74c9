#!/usr/bin/env python
"""Launch N cooperating JAX processes on this machine (127.0.0.1) and report which one died.

Usage::

  python scripts/launch_local.py -n 2 --cpu-devices 4 -- -m experiments quickstart --quick \\
      --workdir runs/qs-2proc

Everything after ``--`` is passed to this Python interpreter, once per process,
with ``MFOPT_COORDINATOR=127.0.0.1:<free port>``, ``MFOPT_NUM_PROCESSES``,
``MFOPT_PROCESS_ID`` (and ``MFOPT_NUM_CPU_DEVICES``, ``MFOPT_HEARTBEAT_TIMEOUT``
if given) in its environment; ``mfopt.distributed.initialize`` (called by the
experiment runner) reads them and selects gloo CPU collectives. Each output line
is prefixed with ``[p<i>]``.

When a process exits non-zero or is killed, the launcher says which one and how
(``process 1 (pid 4242) died: killed by SIGKILL``), waits up to ``--grace``
seconds for the others (JAX's coordination service aborts them once heartbeats
stop), reports how each ended, kills any still running, and exits non-zero. SIGTERM or
SIGINT to the launcher (also during that grace period) is passed on to every process; any
still running 10 s later is killed. Signals and kills go to each process's group, so what a
process started itself is stopped with it.
This is for one machine; on a cluster use the scheduler (README: "Multi-host /
GPU cluster launch").
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def _ephemeral_start() -> int:
  """The first port of the kernel's ephemeral range (Linux; its default elsewhere)."""
  try:
    return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768


def free_port() -> int:
  """A free TCP port for the coordinator, drawn below the kernel's ephemeral range. The port
  is free now and bound seconds later (once JAX starts); a port the kernel hands out (bind to
  0) could meanwhile go to another job's gloo or gRPC socket, which draw from that range."""
  lo = _ephemeral_start()
  rng = random.SystemRandom()
  for _ in range(100 if lo > 11000 else 0):
    port = rng.randrange(10000, lo)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return s.getsockname()[1]
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def exit_code(p: subprocess.Popen) -> int | None:
  """``p``'s exit code (negative: the signal that killed it), or None while it runs, without
  reaping it (``Popen.poll`` reaps). An unreaped child keeps its pid, and so its process
  group's id, from being handed to another process before the launcher has signalled that
  group; once reaped, a reused pid could have put an unrelated process group under the
  launcher's SIGKILL. :func:`main` reaps every child at the end (``Popen.wait``)."""
  if p.returncode is not None:
    return p.returncode
  info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  if info is None or info.si_pid == 0:  # still running
    return None
  return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _note_exit(p: subprocess.Popen, exited_at: dict[int, float]) -> None:
  """Records when ``p`` exits (without reaping it, as :func:`exit_code`). The main loop polls
  every 50 ms, and a process that failed took the others down within that time (its error
  ends it at once; their collectives with it then fail): by poll order, the launcher named
  process 0 as the one that died first."""
  try:
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
  except ChildProcessError:  # (reaped already: the end of main)
    return
  exited_at.setdefault(p.pid, time.monotonic())


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, b""):
    out.write(f"{prefix} {line.decode(errors='replace')}")
    out.flush()
  stream.close()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("--cpu-devices", type=int, default=None,
                      help="fake CPU devices per process (jax_num_cpu_devices)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  parser.add_argument("--heartbeat-timeout", type=int, default=None,
                      help="seconds without heartbeats before JAX aborts the job (JAX default 100)")
  parser.add_argument("--grace", type=float, default=30.0,
                      help="seconds the survivors get to exit after one process dies")
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- then the arguments for python (e.g. -m experiments quickstart)")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1, got {args.num_processes}")
  if not command:
    parser.error("give the python arguments after --")
  port = args.port or free_port()
  # The handler only records the signal; the loop below stops the processes. Stopping them
  # inside the handler could deadlock: a signal landing inside the loop's Popen.poll() left
  # that Popen's wait lock held, and the handler's p.wait() blocked on it forever (CI saw the
  # launcher hang after "got SIGTERM"). Installed before the first child starts: a signal
  # between the starts and the handlers used to kill the launcher alone (exit -15), leaving
  # the children (own sessions) running.
  received: list[int] = []
  signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
  signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
  procs = []
  pumps = []
  exited_at: dict[int, float] = {}  # pid -> when it exited (_note_exit)
  for i in range(args.num_processes):
    env = dict(os.environ, MFOPT_COORDINATOR=f"127.0.0.1:{port}",
               MFOPT_NUM_PROCESSES=str(args.num_processes), MFOPT_PROCESS_ID=str(i))
    if args.cpu_devices is not None:
      env["MFOPT_NUM_CPU_DEVICES"] = str(args.cpu_devices)
    if args.heartbeat_timeout is not None:
      env["MFOPT_HEARTBEAT_TIMEOUT"] = str(args.heartbeat_timeout)
    # start_new_session: a terminal's Ctrl-C reaches the launcher only, which forwards it
    # once (a second SIGINT hit the children inside their KeyboardInterrupt cleanup)
    p = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}]", sys.stdout), daemon=True)
    t.start()
    pumps.append(t)
    threading.Thread(target=_note_exit, args=(p, exited_at), daemon=True).start()
  print(f"launch_local: started {len(procs)} processes (pids "
        f"{', '.join(str(p.pid) for p in procs)}), coordinator 127.0.0.1:{port}", flush=True)

  def report(message: str) -> None:
    print(f"launch_local: {message}", file=sys.stderr, flush=True)

  def signal_group(p: subprocess.Popen, signum: int) -> None:
    # Each child leads its own process group (start_new_session), so its pid is the group's
    # id: signalling the group also reaches what the child started (a data loader, a shell
    # pipeline), which signalling the pid alone left running after the launcher exited.
    try:
      os.killpg(p.pid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone: nothing left in it
      pass

  def kill_leftovers() -> None:
    for p in procs:  # (each signalled before it is reaped: see exit_code)
      signal_group(p, signal.SIGKILL)
      p.wait()

  def stop(signum: int) -> int:
    # SIGTERM/SIGINT to the launcher (a scheduler's cancel, Ctrl-C): pass it on, then kill
    # whoever is left; the children used to be left running, re-parented to init.
    name = signal.Signals(signum).name
    report(f"got {name}; stopping the {len(procs)} processes")
    for p in procs:
      signal_group(p, signum)
    deadline = time.monotonic() + min(args.grace, 10.0)
    while time.monotonic() < deadline and any(exit_code(p) is None for p in procs):
      time.sleep(0.05)
    kill_leftovers()
    return 128 + signum

  first_failure = None
  while True:
    if received:
      return stop(received[0])
    codes = [exit_code(p) for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:  # the earliest to exit (several can be found dead at one poll)
      first_failure = min(failed, key=lambda i: exited_at.get(procs[i].pid, math.inf))
      break
    if all(c == 0 for c in codes):
      for p in procs:
        p.wait()  # (reaped: exit_code only looks)
      for t in pumps:
        t.join(timeout=5)
      report(f"all {len(procs)} processes finished")
      return 0
    time.sleep(0.05)

  dead = procs[first_failure]
  code = exit_code(dead)
  report(f"process {first_failure} (pid {dead.pid}) died: {describe_exit(code)}")
  deadline = time.monotonic() + args.grace
  while time.monotonic() < deadline and any(exit_code(p) is None for p in procs):
    if received:  # a cancel during the grace period is still a cancel (it used to be dropped)
      return stop(received[0])
    time.sleep(0.05)
  for i, p in enumerate(procs):
    if i == first_failure:
      continue
    if exit_code(p) is None:
      signal_group(p, signal.SIGKILL)  # (reaped in kill_leftovers, after every group's kill)
      report(f"process {i} (pid {p.pid}) did not exit within {args.grace:g} s; killed it")
    else:
      report(f"process {i} (pid {p.pid}) then ended: {describe_exit(exit_code(p))}")
  kill_leftovers()  # what the children started, if it outlived them
  for t in pumps:
    t.join(timeout=5)
  return code if code > 0 else 128 + (-code)


if __name__ == "__main__":
  sys.exit(main())
