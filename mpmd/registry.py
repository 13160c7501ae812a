"""Named, lowerable demos of kernels for the ``mpmd lower`` command.

A kernel module registers a small factory that returns a jittable function
and example arguments; ``mpmd lower NAME --platform tpu`` lowers it. The
factory runs only when asked for, so registering costs nothing at import.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Demo(NamedTuple):
  """A lowerable demo: ``jax.jit(fn).trace(*args).lower(...)``."""

  fn: Callable[..., Any]
  args: tuple[Any, ...]
  # Platforms the demo is meant for, e.g. ("tpu", "cpu").
  platforms: Sequence[str]
  # Simulated CPU devices the demo needs (for shard_map demos).
  num_devices: int = 1


_DEMOS: dict[str, Callable[[], Demo]] = {}


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


def demos() -> dict[str, Callable[[], Demo]]:
  """All registered demos, by name (kernels imported first)."""
  import mpmd.kernels  # noqa: F401  (kernels register on import)

  return dict(_DEMOS)
