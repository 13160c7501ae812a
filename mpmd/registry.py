"""Named, lowerable demos of kernels for the ``mpmd lower`` command.

``mpmd.demos`` registers small factories that return a jittable function
and example arguments; ``mpmd lower NAME --platform tpu`` lowers one. A
factory runs only when asked for, so registering costs nothing at import.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


class Demo(NamedTuple):
  """A lowerable demo: ``jax.jit(fn).trace(*args).lower(...)``."""

  fn: Callable[..., Any]
  args: tuple[Any, ...]
  # Platforms the demo is meant for, e.g. ("tpu", "cpu").
  platforms: Sequence[str]
  # Simulated CPU devices the demo needs (for shard_map demos).
  num_devices: int = 1
  # A plain-JAX function of the same args, to check a run against.
  reference: Callable[..., Any] | None = None


DemoFactory = Callable[[], Demo]
_DEMOS: dict[str, DemoFactory] = {}


def register_demo(
  name: str,
) -> Callable[[Callable[[], Demo]], Callable[[], Demo]]:
  """Decorator: registers ``make() -> Demo`` under ``name``."""

  def decorator(make: Callable[[], Demo]) -> Callable[[], Demo]:
    if name in _DEMOS:
      raise ValueError(f"register_demo: {name!r} is already registered")
    _DEMOS[name] = make
    return make

  return decorator


def registered() -> dict[str, DemoFactory]:
  """The demos registered so far, by name (``mpmd.demos`` registers the
  built-in ones when imported)."""
  return dict(_DEMOS)


def check(demo: Demo) -> str:
  """Runs a demo and compares it with its reference: ``"max |err| 0"``."""
  got = jax.jit(demo.fn)(*demo.args)
  if demo.reference is None:
    return "ran (no reference)"
  want = demo.reference(*demo.args)
  err = max(
    float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32))))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  )
  return f"max |error| {err:.3g}"
