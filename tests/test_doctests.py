"""The ``Example:`` blocks of mfopt's docstrings run and print what they say.

Docstring examples are the first code a researcher copies, and they state numbers (a clipped
step, a bound, a period): an update rule changed without its example is caught here.

Each docstring runs in a fresh, empty namespace (``globs={}``), as it would when pasted into a
new session: an example must import what it uses (``>>> import mfopt`` then ``mfopt.mf_sgd``,
or ``>>> from mfopt.precision import get_policy``). With the module's own globals, as
``doctest.testmod(module)`` gives by default, an unqualified ``mf_sgd(...)`` would pass here and
raise NameError for the user.
"""

import doctest
import importlib
import pkgutil
import sys
import types

import pytest

import mfopt

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules_with_examples() -> list[str]:
  finder = doctest.DocTestFinder()
  names = []
  for info in pkgutil.walk_packages(mfopt.__path__, "mfopt."):
    module = importlib.import_module(info.name)
    if any(t.examples for t in finder.find(module, globs={})):
      names.append(info.name)
  return names


MODULES = _modules_with_examples()


def _run_examples(module: types.ModuleType, report: bool = True) -> doctest.TestResults:
  # globs={}: the finder gives each docstring its own copy of an empty namespace, so no example
  # sees the module's globals or another docstring's names.
  return doctest.testmod(module, globs={}, optionflags=_FLAGS, report=report, verbose=False)


def test_the_public_transforms_have_examples():
  # The finder really finds them (a parser change that finds none would pass every case).
  assert {"mfopt.mf", "mfopt.adabound", "mfopt.averaging", "mfopt.comm"} <= set(MODULES)


_PROBE = '''
import mfopt
from mfopt import linear_scaling_rule

def unqualified():
  """>>> linear_scaling_rule(0.05, 128)(256)
  0.1
  """

def qualified():
  """>>> import mfopt
  >>> mfopt.linear_scaling_rule(0.05, 128)(256)
  0.1
  """
'''


def test_examples_do_not_see_the_module_globals(monkeypatch):
  # The guard itself: an example calling a name its module imported, unqualified, fails; one
  # that imports what it uses passes. (With the module's globals, both would pass.)
  probe = types.ModuleType("mfopt_doctest_probe")
  monkeypatch.setitem(sys.modules, probe.__name__, probe)
  exec(_PROBE, probe.__dict__)
  result = _run_examples(probe, report=False)
  assert (result.failed, result.attempted) == (1, 3)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = _run_examples(module)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
