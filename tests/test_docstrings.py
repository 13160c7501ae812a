"""Docstring examples run: every ``>>>`` example of the package, on CPU.

The examples assume the usual imports (``jax``, ``jnp``, ``pl``, ``pltpu``,
``plgpu``, ``mpmd``, ``functools``, ``P`` for ``PartitionSpec``,
``NamedSharding``), which they get here as globals.
"""

import doctest
import functools
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpmd

_GLOBALS = dict(
  jax=jax,
  jnp=jnp,
  pl=pl,
  pltpu=pltpu,
  plgpu=plgpu,
  mpmd=mpmd,
  functools=functools,
  P=P,
  NamedSharding=NamedSharding,
)
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_FLAGS |= doctest.IGNORE_EXCEPTION_DETAIL


def _modules() -> list[str]:
  names = ["mpmd"]
  for package in ("mpmd", "mpmd._primitives", "mpmd._lowering", "mpmd.kernels"):
    path = importlib.import_module(package).__path__
    for info in pkgutil.walk_packages(path, package + "."):
      names.append(info.name)
  return sorted(set(names))


def _examples(name: str) -> list[doctest.DocTest]:
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  tests = finder.find(module, name, extraglobs=_GLOBALS)
  return [t for t in tests if t.examples]


_WITH_EXAMPLES = [n for n in _modules() if _examples(n)]


def test_the_public_api_has_runnable_examples():
  for name in ("mpmd.api", "mpmd.meshes", "mpmd.targets"):
    assert name in _WITH_EXAMPLES
  assert "mpmd.simulators" in _WITH_EXAMPLES


@pytest.mark.parametrize("name", _WITH_EXAMPLES)
def test_docstring_examples(name):
  runner = doctest.DocTestRunner(optionflags=_FLAGS)
  for test in _examples(name):
    runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.attempted > 0
  assert result.failed == 0, f"{result.failed} docstring examples failed"
