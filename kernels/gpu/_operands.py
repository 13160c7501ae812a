"""Operands of the GPU pipelines: block dimensions and specs, GMEM windows,
TMA copies into SMEM, and the output side (stores when a block changes)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from mpmd.kernels._common import check_int
from mpmd.kernels.gpu._steps import (
  GridEntry,
  any_steps,
  count_steps,
  i32,
  is_static,
  unravel,
  when,
)

# Buffers per streamed output: the body fills one while the TMA engine drains
# the other.
OUTPUT_SLOTS = 2


class _DimKind(enum.Enum):
  """How a block dimension's index becomes a GMEM window."""

  BLOCKED = enum.auto()  # index * size, size elements
  ELEMENT = enum.auto()  # index is the first element, size elements
  SQUEEZED = enum.auto()  # the index itself; the dimension is dropped


@dataclasses.dataclass(frozen=True)
class _Dim:
  """One block dimension: how its index becomes a GMEM window."""

  kind: _DimKind
  size: int  # Elements in the window (1 when squeezed).

  def window(self, index: jax.Array):
    if self.kind is _DimKind.BLOCKED:
      return pl.ds(index * self.size, self.size)
    if self.kind is _DimKind.ELEMENT:
      return pl.ds(index, self.size)
    return index  # An integer index drops the dimension.


def _make_dim(where: str, dim: Any) -> _Dim:
  if dim is None or isinstance(dim, pl.Squeezed):
    return _Dim(_DimKind.SQUEEZED, 1)
  if isinstance(dim, pl.Blocked):
    dim = dim.block_size
  if isinstance(dim, pl.Element):
    if tuple(dim.padding) != (0, 0):
      raise NotImplementedError(
        f"{where}: pl.Element block dimensions with padding are not "
        f"supported, got padding={dim.padding}"
      )
    kind, size = _DimKind.ELEMENT, dim.block_size
  elif isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
    kind, size = _DimKind.BLOCKED, dim
  elif isinstance(dim, pl.BoundedSlice):
    raise NotImplementedError(
      f"{where}: pl.BoundedSlice block dimensions are not supported"
    )
  else:
    raise TypeError(
      f"{where}: expected block dimensions as ints, pl.Blocked, pl.Element, "
      f"pl.Squeezed or None, got {dim!r}"
    )
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
    raise TypeError(f"{where}: expected an int block size, got {size!r}")
  if size <= 0:
    raise ValueError(f"{where}: expected positive block sizes, got {size}")
  return _Dim(kind, int(size))


@dataclasses.dataclass(frozen=True)
class Operand:
  """A validated block spec of one pipeline operand."""

  in_smem: bool  # False: the whole GMEM ref is passed to the body.
  dims: tuple[_Dim, ...] | None  # None: one block, the whole operand.
  index_map: Callable[..., Any] | None  # None: always block (0, ...).
  transforms: tuple[Any, ...]
  delay_release: int
  invariant: bool  # The block does not depend on the grid indices.

  @property
  def streamed(self) -> bool:
    """Copied block by block, through a ring of SMEM buffers."""
    return self.in_smem and not self.invariant

  @property
  def once(self) -> bool:
    """Copied once: its block does not depend on the grid indices."""
    return self.in_smem and self.invariant

  def resolve(self, shape: Sequence[int]) -> tuple[_Dim, ...]:
    if self.dims is None:
      return tuple(_Dim(_DimKind.BLOCKED, int(s)) for s in shape)
    return self.dims

  def smem_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(
      d.size for d in self.resolve(shape) if d.kind is not _DimKind.SQUEEZED
    )

  def block_indices(self, indices, ndim: int) -> tuple[jax.Array, ...]:
    if self.index_map is None:
      return (jnp.int32(0),) * ndim
    out = self.index_map(*indices)
    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(out) != ndim:
      raise ValueError(
        f"pipeline: expected index_map to return {ndim} block indices (one "
        f"per block dim), got {len(out)}"
      )
    return tuple(jnp.asarray(i).astype(jnp.int32) for i in out)

  def gmem_block(self, gmem_ref, indices):
    dims = self.resolve(gmem_ref.shape)
    windows = tuple(
      d.window(i)
      for d, i in zip(dims, self.block_indices(indices, len(dims)), strict=True)
    )
    return gmem_ref.at[windows]

  def copy_in(self, gmem_ref, indices, smem_ref, barrier_ref) -> None:
    plgpu.copy_gmem_to_smem(
      self.gmem_block(gmem_ref, indices), smem_ref, barrier_ref
    )

  def smem(self, slots: int, ref_type: Any) -> Any:
    return plgpu.SMEM(
      (slots, *self.smem_shape(ref_type.shape)),
      ref_type.dtype,
      transforms=self.transforms,
    )


def _depends_on_indices(index_map: Callable[..., Any], ndim: int) -> bool:
  """Whether any block index returned by ``index_map`` uses a grid index."""
  index_aval = jax.ShapeDtypeStruct((), jnp.int32)
  jaxpr = jax.make_jaxpr(index_map)(*(index_aval,) * ndim).jaxpr
  dependent = set(jaxpr.invars)

  def uses(v):
    return not isinstance(v, jex_core.Literal) and v in dependent

  for eqn in jaxpr.eqns:
    # Conservative for nested jaxprs: any dependent input taints every output.
    if any(map(uses, eqn.invars)):
      dependent.update(eqn.outvars)
  return any(map(uses, jaxpr.outvars))


def _in_smem(where: str, memory_space: Any) -> bool:
  if memory_space in (None, plgpu.SMEM, pl.MemorySpace.DEFAULT):
    return True
  if memory_space in (plgpu.GMEM, pl.MemorySpace.ANY):
    return False
  raise ValueError(
    f"{where}: expected memory_space SMEM (copied block by block) or "
    f"GMEM (passed through), got {memory_space}"
  )


def _make_operand(where: str, spec: Any, grid: tuple[GridEntry, ...]):
  if not isinstance(spec, pl.BlockSpec):
    raise TypeError(
      f"{where}: expected a pl.BlockSpec or plgpu.BlockSpec, got "
      f"{type(spec).__name__}"
    )
  in_smem = _in_smem(where, spec.memory_space)
  if spec.pipeline_mode is not None:
    raise NotImplementedError(
      f"{where}: pipeline_mode= is not supported; use max_concurrent_steps"
    )
  if getattr(spec, "collective_axes", ()):
    raise NotImplementedError(
      f"{where}: collective_axes (cluster multicast) is not supported"
    )
  delay_release = check_int(
    where, "delay_release", getattr(spec, "delay_release", 0), minimum=0
  )
  if not in_smem:
    return Operand(False, None, None, (), 0, True)
  dims = None
  if spec.block_shape is not None:
    dims = tuple(_make_dim(where, d) for d in spec.block_shape)
  index_map = spec.index_map
  invariant = index_map is None or not _depends_on_indices(index_map, len(grid))
  return Operand(
    in_smem=True,
    dims=dims,
    index_map=index_map,
    transforms=tuple(getattr(spec, "transforms", ())),
    delay_release=delay_release,
    invariant=invariant,
  )


def make_operands(where, specs, grid, kind) -> tuple[Operand, ...]:
  # A lone spec stands for a one-element sequence (as upstream accepts).
  if isinstance(specs, pl.BlockSpec):
    specs = (specs,)
  return tuple(
    _make_operand(f"{where}: {kind}[{i}]", s, grid) for i, s in enumerate(specs)
  )


def check_refs(
  where: str, operands: Sequence[Operand], refs: Sequence[Any], kind: str
) -> None:
  if len(operands) != len(refs):
    raise ValueError(
      f"{where}: expected {len(operands)} {kind} refs (one per spec), got "
      f"{len(refs)}"
    )
  for i, (op, ref) in enumerate(zip(operands, refs, strict=True)):
    if not op.in_smem or op.dims is None:
      continue
    shape = tuple(ref.shape)
    if len(shape) != len(op.dims):
      raise ValueError(
        f"{where}: {kind}[{i}] expected rank {len(op.dims)} (one dim per "
        f"block dim), got shape {shape}"
      )
    block = tuple(
      d.size if d.kind is not _DimKind.SQUEEZED else None for d in op.dims
    )
    for d, s in zip(op.dims, shape, strict=True):
      if d.kind is _DimKind.BLOCKED and s % d.size:
        raise ValueError(
          f"{where}: {kind}[{i}] expected a shape divisible by its "
          f"block_shape {block}, got {shape}"
        )
      if d.size > s:
        raise ValueError(
          f"{where}: {kind}[{i}] expected a shape at least its block_shape "
          f"{block}, got {shape}"
        )


class Inputs:
  """Copies input blocks from GMEM into SMEM buffers.

  A streamed input (its block follows the grid) cycles through ``slots``
  buffers: step ``s`` goes into slot ``s % slots`` and its copies arrive on
  that slot's "loaded" barrier. An index-invariant input is copied once, into
  one buffer, and arrives on the "loaded once" barrier. A GMEM input is
  passed to the body as it is.

  The "loaded" barriers are one array shared by every streamed input or, with
  ``per_input_barriers``, one array per input (the body then waits on each
  itself, and an input with nothing to copy gets an arrival instead).
  """

  def __init__(
    self, operands, gmem_refs, scratch, grid, slots, per_input_barriers=False
  ):
    self.operands = operands
    self.gmem_refs = gmem_refs
    self.smem_refs = scratch["in_smem"]
    self.loaded = scratch["loaded"]
    self.loaded_once = scratch["loaded_once"]
    self.grid = grid
    self.slots = slots
    self.per_input_barriers = per_input_barriers
    self.streamed = [op.streamed for op in operands]

  @staticmethod
  def scratch_types(
    operands, ref_types, slots, per_input_barriers=False
  ) -> dict[str, Any]:
    """The SMEM buffers and barriers of ``operands`` over ``ref_types``."""
    num_streamed = sum(op.streamed for op in operands)
    num_once = sum(op.once for op in operands)
    if per_input_barriers:
      loaded = [plgpu.Barrier(num_barriers=slots) for _ in operands]
    elif num_streamed:
      loaded = [plgpu.Barrier(num_arrivals=num_streamed, num_barriers=slots)]
    else:
      loaded = []
    return dict(
      in_smem=[
        op.smem(slots if op.streamed else 1, t) if op.in_smem else None
        for op, t in zip(operands, ref_types, strict=True)
      ],
      loaded=loaded,
      loaded_once=plgpu.Barrier(num_arrivals=num_once) if num_once else None,
    )

  def slot(self, step: jax.Array) -> jax.Array:
    return lax.rem(step, jnp.int32(self.slots))

  def barrier(self, i: int, slot: jax.Array) -> Any:
    """Input ``i``'s "loaded" barrier of ``slot`` (None: none is needed)."""
    if not self.loaded:
      return None
    return self.loaded[i if self.per_input_barriers else 0].at[slot]

  def load_once(self) -> None:
    """Starts the copies of the index-invariant blocks."""
    zeros = (jnp.int32(0),) * len(self.grid)
    for op, gmem, smem in zip(
      self.operands, self.gmem_refs, self.smem_refs, strict=True
    ):
      if op.once:
        op.copy_in(gmem, zeros, smem.at[0], self.loaded_once)

  def wait_once(self) -> None:
    if self.loaded_once is not None:
      plgpu.barrier_wait(self.loaded_once)

  def copy(self, i: int, indices, slot: jax.Array) -> None:
    """Starts the copy of streamed input ``i``'s block at ``indices``."""
    self.operands[i].copy_in(
      self.gmem_refs[i],
      indices,
      self.smem_refs[i].at[slot],
      self.barrier(i, slot),
    )

  def load(self, step: jax.Array, delay: int | None = None) -> None:
    """Starts the copies of ``step``'s streamed blocks (only those whose
    ``delay_release`` is ``delay``, if given)."""
    indices = unravel(step, self.grid)
    slot = self.slot(step)
    for i, op in enumerate(self.operands):
      if op.streamed and (delay is None or op.delay_release == delay):
        self.copy(i, indices, slot)

  def fill(self, num_steps: GridEntry, fetch: Callable[[jax.Array], None]):
    """Calls ``fetch(step)`` for the first ``slots`` steps (the prologue)."""
    for step in range(self.slots):
      # A traced grid may have fewer steps than slots.
      when(
        is_static(num_steps) or step < num_steps,
        functools.partial(fetch, jnp.int32(step)),
      )

  def wait(self, slot: jax.Array) -> None:
    """Waits for the streamed blocks of ``slot`` (shared barriers only)."""
    if self.loaded and not self.per_input_barriers:
      plgpu.barrier_wait(self.loaded[0].at[slot])

  def body_refs(self, slot: jax.Array) -> list[Any]:
    return [
      smem.at[slot if op.streamed else 0] if op.in_smem else gmem
      for op, gmem, smem in zip(
        self.operands, self.gmem_refs, self.smem_refs, strict=True
      )
    ]


def _differs(a: Sequence[jax.Array], b: Sequence[jax.Array]) -> jax.Array:
  return functools.reduce(
    jnp.logical_or,
    (x != y for x, y in zip(a, b, strict=True)),
    jnp.bool_(False),
  )


class Outputs:
  """Stores output blocks when their block index changes.

  A run is a maximal range of consecutive steps with the same output block.
  All steps of a run see the same SMEM buffer (so the body may accumulate);
  the block is stored once, after the last step of its run. Runs alternate
  between two buffers so that a store overlaps the next run.
  """

  def __init__(self, operands, gmem_refs, smem_refs, grid):
    self.operands = operands
    self.gmem_refs = gmem_refs
    self.smem_refs = smem_refs
    self.grid = grid
    self.num_steps = count_steps(grid)
    self.streamed = [op.streamed for op in operands]

  @staticmethod
  def scratch_types(operands, ref_types) -> dict[str, Any]:
    """The SMEM buffers of ``operands`` over ``ref_types``."""
    return dict(
      out_smem=[
        op.smem(1 if op.invariant else OUTPUT_SLOTS, t) if op.in_smem else None
        for op, t in zip(operands, ref_types, strict=True)
      ]
    )

  def init_runs(self):
    return tuple(jnp.int32(0) for _ in self.operands)

  def body_refs(self, runs):
    refs = []
    for op, gmem, smem, run in zip(
      self.operands, self.gmem_refs, self.smem_refs, runs, strict=True
    ):
      if not op.in_smem:
        refs.append(gmem)
      elif op.invariant:
        refs.append(smem.at[0])
      else:
        refs.append(smem.at[lax.rem(run, jnp.int32(OUTPUT_SLOTS))])
    return refs

  def before_body(self):
    if any(self.streamed):
      # The buffer this run writes was stored two runs ago: every store but
      # the newest must have finished reading SMEM.
      plgpu.wait_smem_to_gmem(OUTPUT_SLOTS - 1, wait_read_only=True)

  def after_body(self, step, indices, runs):
    """Stores the blocks whose run ends at ``step``; returns the new runs."""
    if not any(self.streamed):
      return runs
    plgpu.commit_smem()
    last = i32(self.num_steps) - 1
    next_indices = unravel(jnp.minimum(step + 1, last), self.grid)
    new_runs = []
    for op, gmem, smem, run, streamed in zip(
      self.operands,
      self.gmem_refs,
      self.smem_refs,
      runs,
      self.streamed,
      strict=True,
    ):
      if not streamed:
        new_runs.append(run)
        continue
      ndim = len(op.resolve(gmem.shape))
      ends = jnp.logical_or(
        step == last,
        _differs(
          op.block_indices(indices, ndim),
          op.block_indices(next_indices, ndim),
        ),
      )
      slot = lax.rem(run, jnp.int32(OUTPUT_SLOTS))

      @pl.when(ends)
      def _store(op=op, gmem=gmem, smem=smem, slot=slot):
        plgpu.copy_smem_to_gmem(smem.at[slot], op.gmem_block(gmem, indices))
        plgpu.commit_smem_to_gmem_group()

      new_runs.append(run + ends.astype(jnp.int32))
    return tuple(new_runs)

  def finish(self):
    """Stores the index-invariant outputs and waits for every store."""
    invariant = [
      (op, gmem, smem)
      for op, gmem, smem in zip(
        self.operands, self.gmem_refs, self.smem_refs, strict=True
      )
      if op.once
    ]

    def store():
      plgpu.commit_smem()
      zeros = (jnp.int32(0),) * len(self.grid)
      for op, gmem, smem in invariant:
        plgpu.copy_smem_to_gmem(smem.at[0], op.gmem_block(gmem, zeros))
      plgpu.commit_smem_to_gmem_group()

    if invariant:
      # A traced grid may have no steps: the body never wrote the block.
      when(any_steps(self.num_steps), store)
    if invariant or any(self.streamed):
      plgpu.wait_smem_to_gmem(0)
