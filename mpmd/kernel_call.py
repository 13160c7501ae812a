"""``mpmd.kernel``: upstream's public ``pl.kernel``, on ``mpmd_map``.

``pl.kernel(body, out_type, mesh=...)`` is Pallas' public entry for mesh
kernels, and its list form ``pl.kernel(body=[f, g], mesh=[m1, m2], ...)``
the public multi-mesh entry (``pl.core_map`` is deprecated from jax 0.12).
``mpmd.kernel`` takes the same call and means the same, running through our
``mpmd_map``: code written for upstream moves over by changing ``pl.`` to
``mpmd.``. It patches nothing in JAX.
"""

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from mpmd import _jax
from mpmd._lowering import paths
from mpmd.api import mpmd_map
from mpmd.types import Interpret


class _NotGiven:
  """An argument left out (``None`` is a value some of them take)."""

  def __repr__(self) -> str:
    return "<not given>"


_NOT_GIVEN: Any = _NotGiven()


def kernel(
  body: Callable | Sequence[Callable] = _NOT_GIVEN,
  out_type: Any = _NOT_GIVEN,
  *,
  mesh: Any,
  scratch_types: Any = _NOT_GIVEN,
  compiler_params: Any = None,
  interpret: Interpret = None,
  cost_estimate: Any = None,
  debug: bool = False,
  name: str | None = None,
  metadata: dict[str, str] | None = None,
  out_shape: Any = _NOT_GIVEN,
  scratch_shapes: Any = _NOT_GIVEN,
) -> Callable[..., Any]:
  """Upstream's ``pl.kernel``: a kernel ``body`` over a ``mesh``, or one
  body per mesh in one launch.

  The same call as ``jax.experimental.pallas.kernel`` (jax 0.10.2 to 0.12),
  three forms of it:

  - ``mpmd.kernel(body, out_type, mesh=mesh, ...)``: a function that runs
    ``body`` over ``mesh``;
  - ``mpmd.kernel(out_type=..., mesh=mesh, ...)``: a decorator that makes
    one of a body;
  - ``mpmd.kernel(body=[f, g], mesh=[m1, m2], ...)``: ``f`` runs over
    ``m1`` and ``g`` over ``m2``, in one launch (``mpmd_map``'s
    ``[(m1, f), (m2, g)]``).

  Each body is called as ``body(*in_refs, *out_refs, *scratch_refs)`` and
  returns None, as with ``mpmd.mpmd_map``, which runs it: everything
  ``mpmd_map`` accepts and does holds here (meshes, Refs, jit, vmap, the CPU
  fallback, cross-lowering).

  Args:
    body: a kernel function, or a non-empty sequence of them (one per mesh
      of ``mesh``); left out, ``kernel`` returns a decorator.
    out_type: a pytree of ``jax.ShapeDtypeStruct``, JAX types or
      memory-space annotated types: the outputs (default ``()``: none).
    mesh: a Pallas mesh (``mpmd.tensorcore_mesh``, SparseCore meshes,
      ``plgpu.Mesh``), or a sequence of them as long as ``body``.
    scratch_types: a pytree of scratch types (``pltpu.VMEM(shape, dtype)``,
      semaphore types, ...; ``type @ mesh`` with several TPU meshes).
    compiler_params: ``pltpu.CompilerParams`` / ``plgpu.CompilerParams``.
    interpret: as ``mpmd_map``'s: None (default) compiles natively on TPU /
      GPU and runs the CPU fallback on CPU (``False``, upstream's default,
      means the same); True the HLO interpreter; a ``pltpu.InterpretParams``
      / ``mpmd.GPUInterpretParams`` that simulator. Inside
      ``pltpu.force_tpu_interpret_mode()``, TPU kernels run in the TPU
      simulator, as upstream's do.
    cost_estimate: a ``pl.CostEstimate`` for XLA's scheduler.
    debug: print the kernel jaxprs and, on CPU, which path runs and why.
    name: the kernel's name in HLO and profiles.
    metadata: string key/values attached to the launch.
    out_shape: ``out_type``'s earlier name in ``pl.kernel``, accepted too.
    scratch_shapes: ``scratch_types``' earlier name, accepted too.

  Returns:
    With ``body``: a function of the inputs (arrays or Refs) returning the
    outputs, structured as ``out_type``. Without: a decorator taking the
    body and returning that function.

  Raises:
    TypeError: ``body`` (or one of its entries) is not callable; both an
      argument and its earlier name are given.
    ValueError: ``body`` and ``mesh`` do not pair up: a sequence of bodies
      with one mesh, one body (or the decorator) with a sequence of meshes,
      sequences of different lengths, or empty ones.
    Everything ``mpmd.mpmd_map`` raises, when the function is called.

  Example (one body; then one body per mesh, in one launch)::

    >>> def double(x_hbm, o_hbm, buf):
    ...   pltpu.sync_copy(x_hbm, buf)
    ...   buf[...] *= 2
    ...   pltpu.sync_copy(buf, o_hbm)
    >>> f = mpmd.kernel(
    ...     double, jax.ShapeDtypeStruct((8, 128), jnp.float32),
    ...     mesh=mpmd.tensorcore_mesh("core", num_cores=1),
    ...     scratch_types=[pltpu.VMEM((8, 128), jnp.float32)])
    >>> f(jnp.ones((8, 128)))[0, :3]
    Array([2., 2., 2.], dtype=float32)
    >>> left = mpmd.tensorcore_mesh("left", num_cores=1)
    >>> right = mpmd.tensorcore_mesh("right", num_cores=1)
    >>> def fill(row, value):
    ...   def body(o_hbm, left_buf, right_buf):
    ...     buf = left_buf if row == 0 else right_buf
    ...     buf[...] = jnp.full(buf.shape, value, jnp.float32)
    ...     pltpu.sync_copy(buf, o_hbm.at[row])
    ...   return body
    >>> g = mpmd.kernel(
    ...     body=[fill(0, 1.0), fill(1, 2.0)], mesh=[left, right],
    ...     out_type=jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
    ...     scratch_types=[(pltpu.VMEM @ left)((8, 128), jnp.float32),
    ...                    (pltpu.VMEM @ right)((8, 128), jnp.float32)])
    >>> g()[:, 0, 0]
    Array([1., 2.], dtype=float32)
  """
  out_type = _renamed("out_type", out_type, "out_shape", out_shape, ())
  scratch_types = _renamed(
    "scratch_types", scratch_types, "scratch_shapes", scratch_shapes, ()
  )

  def launch(meshes_and_fns):
    return mpmd_map(
      meshes_and_fns,
      out_type,
      scratch_types=scratch_types,
      compiler_params=compiler_params,
      interpret=_forced_interpret(interpret, [m for m, _ in meshes_and_fns]),
      debug=debug,
      cost_estimate=cost_estimate,
      name=name,
      metadata=metadata,
    )

  if body is _NOT_GIVEN:
    if _is_sequence(mesh):
      raise ValueError(
        "mpmd.kernel: mesh cannot be a sequence when using kernel as a "
        f"decorator; got {_describe(mesh)}. Pass the bodies as a sequence "
        "too: mpmd.kernel(body=[f, g], mesh=[m1, m2], ...)"
      )

    def decorator(fn):
      return launch([(mesh, _checked_body(fn, "the decorated function"))])

    return decorator
  return launch(_meshes_and_fns(body, mesh))


def _meshes_and_fns(body, mesh) -> list[tuple[Any, Callable]]:
  """``mpmd_map``'s pairs for ``mpmd.kernel(body, mesh=mesh)``: one body
  over one mesh, or a sequence of bodies over as many meshes."""
  if _is_sequence(body):
    bodies = [_checked_body(b, f"'body[{i}]'") for i, b in enumerate(body)]
    if not bodies:
      raise ValueError("mpmd.kernel: expected a non-empty 'body', got []")
    if not _is_sequence(mesh):
      raise ValueError(
        "mpmd.kernel: mesh must be a sequence when body is a sequence of "
        f"callables; expected 'mesh' to be a sequence of {len(bodies)} "
        f"meshes, got {_describe(mesh)}"
      )
    if len(mesh) != len(bodies):
      raise ValueError(
        "mpmd.kernel: body and mesh sequences must have the same length; "
        f"got {len(bodies)} bodies and {len(mesh)} meshes"
      )
    return list(zip(mesh, bodies, strict=True))
  fn = _checked_body(body, "'body'")
  if _is_sequence(mesh):
    raise ValueError(
      "mpmd.kernel: mesh cannot be a sequence when body is a single "
      f"callable; got {_describe(mesh)}. Pass one body per mesh: "
      "mpmd.kernel(body=[f, g], mesh=[m1, m2], ...)"
    )
  return [(mesh, fn)]


def _renamed(name: str, value, old_name: str, old_value, default):
  """An argument given by its name or its earlier one (not both)."""
  if value is not _NOT_GIVEN and old_value is not _NOT_GIVEN:
    raise TypeError(
      f"mpmd.kernel: got both '{name}' and its earlier name '{old_name}'; "
      f"pass '{name}' only"
    )
  if value is not _NOT_GIVEN:
    return value
  return default if old_value is _NOT_GIVEN else old_value


def _is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
  return isinstance(value, Sequence) and not isinstance(value, str)


def _checked_body(fn, what: str) -> Callable:
  if not callable(fn):
    raise TypeError(
      f"mpmd.kernel: expected {what} to be a kernel function (a callable), "
      f"got {type(fn).__name__}: {fn!r}"
    )
  return fn


def _describe(value) -> str:
  if _is_sequence(value):
    return f"a {type(value).__name__} of {len(value)}"
  return type(value).__name__


def _forced_interpret(interpret: Interpret, meshes) -> Interpret:
  """``pltpu.force_tpu_interpret_mode()``'s settings for TPU kernels, as
  upstream's ``pl.kernel`` does (they would not fit a GPU kernel)."""
  forced = _jax.config.pallas_tpu_interpret_mode_context_manager.value
  if forced is None or any(paths.is_gpu_mesh(m) for m in meshes):
    return interpret
  return forced
