"""The ``Example:`` blocks of mfopt's docstrings run and print what they say.

Docstring examples are the first code a researcher copies, and they state numbers (a clipped
step, a bound, a period): an update rule changed without its example is caught here.
"""

import doctest
import importlib
import pkgutil

import pytest

import mfopt


def _modules_with_examples() -> list[str]:
  finder = doctest.DocTestFinder()
  names = []
  for info in pkgutil.walk_packages(mfopt.__path__, "mfopt."):
    module = importlib.import_module(info.name)
    if any(t.examples for t in finder.find(module)):
      names.append(info.name)
  return names


MODULES = _modules_with_examples()


def test_the_public_transforms_have_examples():
  # The finder really finds them (a parser change that finds none would pass every case).
  assert {"mfopt.mf", "mfopt.adabound", "mfopt.averaging", "mfopt.comm"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           report=True, verbose=False)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
