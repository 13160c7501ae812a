"""Synchronisation bugs injected into kernels, for the checker's tests.

``inject(primitive, k, how)`` patches ``mpmd_map`` (in the test process
only) so that every launch traced inside it has the ``k``-th equation of
``primitive`` (counted in trace order, nested jaxprs included, over all of
the launch's meshes) dropped, doubled, or its wait weakened: the bugs people
write (a missing wait, a missing or extra signal, a wait for too little).
"""

import contextlib

import numpy as np
import pytest

import mpmd
from mpmd import api
from mpmd._jax import pallas_primitives, tree_util
from mpmd._lowering import jaxpr_util
from mpmd._primitives import mpmd_map as prim

DROP, TWICE, WEAKEN = "drop", "twice", "weaken"


def _rule(primitive: str, k: int, how: str):
  seen = [0]

  def rule(eqn, invals):
    if eqn.primitive.name != primitive:
      return None
    seen[0] += 1
    if seen[0] != k + 1:
      return None
    if how == DROP:
      return [] if eqn.primitive.multiple_results else [invals[0]]
    if how == TWICE:
      jaxpr_util.bind_rewritten(eqn, invals, rule)
      return jaxpr_util.bind_rewritten(eqn, invals, rule)
    if how == WEAKEN:  # a semaphore_wait for one less
      assert eqn.primitive is pallas_primitives.semaphore_wait_p
      tree = eqn.params["args_tree"]
      parts = list(tree.unflatten(invals))
      parts[2] = parts[2] - np.int32(1)
      flat, tree = tree_util.tree_flatten(parts)
      return jaxpr_util.bind_rewritten(eqn, flat, rule, args_tree=tree)
    raise ValueError(how)

  return rule, seen


@contextlib.contextmanager
def inject(primitive: str, k: int, how: str = DROP):
  """Launches traced inside have the bug; yields a list whose element says
  whether the ``k``-th equation existed (so a test knows the bug is in)."""
  original = api._bind
  found = [False]

  def bind(launch, operands, jaxprs, out_avals, cpu_path):
    rule, seen = _rule(primitive, k, how)
    new = []
    for mesh, jaxpr in zip(launch.meshes, jaxprs, strict=True):
      with prim.tracing_context(mesh, launch.meshes):
        new.append(jaxpr_util.rewrite(jaxpr, rule))
    found[0] = found[0] or seen[0] > k
    return original(launch, operands, tuple(new), out_avals, cpu_path)

  api._bind = bind
  try:
    yield found
  finally:
    api._bind = original


def assert_found_and_replays(build, args, primitive, k, how, *, schedules):
  """The bug (``how`` the ``k``-th ``primitive``) injected into the kernel
  that ``build()`` jits: ``mpmd.explore`` over ``schedules`` schedules finds
  it as a LaunchError, and replaying that schedule raises it again."""
  with inject(primitive, k, how) as injected:
    f = build()
    report = mpmd.explore(f, *args, schedules=schedules, max_failures=1)
  assert injected[0], "the kernel has no such equation: no bug was injected"
  assert report.failures, f"{how} {primitive} #{k} was not found"
  failure = report.failures[0]
  assert isinstance(failure.error, mpmd.LaunchError)
  with inject(primitive, k, how):
    with pytest.raises(type(failure.error)):
      mpmd.replay(f, *args, schedule=failure.schedule)
