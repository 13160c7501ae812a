"""What the lockstep path (and jax 0.10's simulator launches) rely on
XLA:CPU to do, or not to do.

The lockstep path runs every device's kernel as one XLA program whose
devices meet in collectives. XLA is free to simplify and reorder what it
is given, and two of its freedoms would break it; each helper here denies
XLA one, and ``tests/lowering/test_xla_cpu.py`` checks on the compiled
program that it still does (a test fails, rather than a launch hanging, if
a new XLA sees through one):

* ``witness``: XLA computes only the elements of a value that are used (an
  element of an elementwise result it computes from the operands alone). A
  collective that should wait for a whole result is handed one element of
  it behind an optimization barrier. (jaxlib 0.10.2's XLA fuses through
  the barrier when nothing else reads the value whole; in an exchange the
  ring shift that carries the data does.) On jax 0.10 the callbacks that
  enter and leave the simulator take witnesses of a launch's operands and
  results, which orders them (``lowering/supervised.py``).
* ``arrival``: XLA folds what it can compute when compiling. A count that
  every device knows when traced is a constant, so what reads it (the
  failure report of a short wait) may run before the collective that
  should come first; a device that raises there never reaches the
  collective, and the others wait for it forever. A value derived from the
  collective's result cannot be folded, and exists only once it has run.
"""

import jax
import jax.numpy as jnp
from jax import lax

from mpmd._lowering import packing


def witness(x: jax.Array) -> jax.Array:
  """One element of ``x``, computed only once all of ``x`` is: XLA would
  otherwise compute just that element from ``x``'s operands."""
  return jnp.ravel(lax.optimization_barrier(x))[:1]


def arrival(value: jax.Array) -> jax.Array | None:
  """True, computed from ``value``'s first element in a way XLA does not
  fold: it exists only once the collective that produced ``value`` has
  run (None for an empty ``value``)."""
  if value.size == 0:
    return None
  first = jnp.ravel(packing.wire(jnp.ravel(value)[:1]))[:1]
  if first.dtype == jnp.bool_:
    first = first.astype(jnp.uint8)
  word = packing.WORDS[packing.byte_width(first.dtype)]
  bits = lax.bitcast_convert_type(first, word)
  return (bits[0] | 1) != 0
