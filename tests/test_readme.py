"""The README's Python example runs as written and does what its text says."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_example_trains_synchronously_and_counts_its_all_reduces(capsys):
  blocks = _python_blocks()
  assert len(blocks) == 1, "a new README example needs its own check here"
  namespace: dict = {}
  exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102 (our own README)
  result, mfopt = namespace["result"], namespace["mfopt"]
  totals = mfopt.comm_totals(result.state.opt_state)
  # One all-reduce of every float32 parameter per step (sync_gradients), counted independently.
  num_params = sum(int(np.prod(x.shape[1:])) for x in jax.tree.leaves(result.state.params))
  assert totals["all_reduces"] == 400 and totals["all_gathers"] == 0
  assert totals["all_reduce_bytes"] == 400 * 4 * num_params
  assert result.summary["test_accuracy"] > 0.85  # digits, 10 classes: chance is 0.1
  assert str(totals["all_reduces"]) in capsys.readouterr().out
