"""jax-mpmd: different functions on different meshes in one kernel launch."""

from mpmd import _jax as _jax  # checks the jax pin first
