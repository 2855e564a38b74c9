"""Deviceless XLA:GPU compilation: the compiled GPU program of a step, on a machine without a GPU.

``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...,
topology="1x1xN")`` gives N *compile-only* GPU devices described by an XLA ``TargetConfig``
(``experiments/gpu_specs/h100_sxm.txtpb``: an H100 SXM5 80GB). A ``jax.jit`` function lowered
with ``jax.ShapeDtypeStruct`` arguments sharded over a mesh of those devices compiles with
XLA:GPU's full pipeline (SPMD partitioning, collective passes, fusion, layout assignment,
buffer assignment), exactly as for a real N-GPU machine, minus autotuning (which needs a GPU).
Nothing is executed: this gives the *structure* of the GPU program (collective ops with
their dtypes and bytes, copies, buffer sizes), never a timing.

Used by ``python -m experiments.bench_comm --platform gpu-aot`` (issue 8: "the compiled HLO on
GPU shows bf16 all-reduce operands where ``comm_dtype`` asks for them") and
``python -m experiments.bench_gpu_hlo``.

Needs the JAX CUDA plugin of the installed JAX version (its compiler lives there), which is
large (about 5 GB with the CUDA wheels) and not a dependency of mfopt;
``bash scripts/gpu_aot.sh`` builds a separate virtual environment ``.venv-gpu-aot`` with it.
The process must use ``jax_platforms="cpu"`` so that JAX does not try to open a CUDA device;
the host arrays the benchmarks build live on CPU, and only their shapes and shardings travel
to the GPU mesh (:func:`abstract_on`).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import numpy as np

from mfopt import _checks

SPECS_DIR = Path(__file__).resolve().parent / "gpu_specs"
TARGETS = {"h100": SPECS_DIR / "h100_sxm.txtpb"}
PLUGIN_HINT = ('pip install "jax-cuda12-plugin[with-cuda]==$(python -c "import jax; '
               'print(jax.__version__)")"   (or: bash scripts/gpu_aot.sh)')


def unavailable_reason() -> str | None:
  """``None`` when deviceless CUDA compilation can run here, else why not (with the fix)."""
  import importlib.util
  for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):  # the CUDA PJRT plugins
    try:
      if importlib.util.find_spec(name) is not None:
        return None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
      break
  return f"the JAX CUDA plugin is not installed: {PLUGIN_HINT}"


def topology_devices(num_devices: int, target: str = "h100") -> list[Any]:
  """``num_devices`` compile-only GPU devices of ``target`` (a key of :data:`TARGETS`)."""
  if target not in TARGETS:
    raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
  _checks.positive_int("num_devices", num_devices)
  reason = unavailable_reason()
  if reason is not None:
    raise RuntimeError(f"deviceless GPU compilation is not available: {reason}")
  import jax
  from jax.experimental import topologies
  if jax.config.jax_platforms != "cpu":
    # With the CUDA plugin installed, JAX would otherwise try to open a GPU for its default
    # backend; the compile-only devices below need none.
    raise RuntimeError("set jax_platforms='cpu' before the first JAX call (JAX_PLATFORMS=cpu), "
                       f"got {jax.config.jax_platforms!r}")
  config = TARGETS[target].read_text()
  topo = topologies.get_topology_desc(platform="cuda", target_config=config,
                                      topology=f"1x1x{num_devices}")
  return list(topo.devices)


def abstract_on(tree: Any, mesh) -> Any:
  """``tree``'s arrays as ``ShapeDtypeStruct`` with the same ``PartitionSpec`` on ``mesh``."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  def leaf(a):
    spec = getattr(getattr(a, "sharding", None), "spec", PartitionSpec())
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree.map(leaf, tree)


def memory(compiled) -> dict[str, int] | None:
  """Buffer sizes XLA assigned to a compiled program (per device), or ``None`` if not given."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  (a backend without the analysis)
    return None
  if m is None:
    return None
  return {"argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes)}


_THUNK = re.compile(r"^(?P<indent>\s*)\d+:\s+(?P<kind>k\w+)")


def thunk_census(text: str) -> dict[str, Any]:
  """What XLA:GPU's runtime launches, from its thunk sequence dump (``--xla_dump_to``'s
  ``*.thunk_sequence_after_thunk_passes.txt``; the HLO text does not show command buffers).

  Top-level thunks run one by one; a ``kCommandBuffer`` thunk is one CUDA graph whose commands
  are the indented lines under it. Returns ``command_buffers``, ``commands_in_buffers``,
  ``thunks_outside`` (top-level thunks other than command buffers: each its own launch),
  ``outside_by_kind`` and ``all_by_kind`` (counts per thunk kind, e.g. ``kConvolution``).
  """
  outside: collections.Counter = collections.Counter()
  everywhere: collections.Counter = collections.Counter()
  buffers = inside = 0
  for line in text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    kind = m.group("kind")
    if kind != "kCommandBuffer":
      everywhere[kind] += 1
    if m.group("indent"):
      inside += 1
    elif kind == "kCommandBuffer":
      buffers += 1
    else:
      outside[kind] += 1
  return {"command_buffers": buffers, "commands_in_buffers": inside,
          "thunks_outside": sum(outside.values()), "outside_by_kind": dict(outside),
          "all_by_kind": dict(everywhere)}


def compile_with_thunks(lowered, compiler_options: dict[str, Any] | None = None
                        ) -> tuple[Any, dict[str, Any] | None]:
  """``lowered.compile(compiler_options=...)`` with XLA's dump on, and the :func:`thunk_census`
  of the compiled program (``None`` if this XLA wrote no thunk sequence)."""
  import tempfile
  with tempfile.TemporaryDirectory(prefix="mfopt_xla_dump_") as dump:
    compiled = lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": dump})
    files = sorted(Path(dump).glob("*thunk_sequence_after_thunk_passes.txt"))
    # One compile, one module; should XLA dump a helper module too, the step is the largest.
    census = (thunk_census(max(files, key=lambda f: f.stat().st_size).read_text())
              if files else None)
  return compiled, census
