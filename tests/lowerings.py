"""Cross-lowering a function on this CPU host (imported by module name:
tests/ is on pytest's pythonpath)."""

import jax


def tpu_text(f, *args) -> str:
  """The StableHLO module of ``jax.jit(f)(*args)`` lowered for TPU."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
