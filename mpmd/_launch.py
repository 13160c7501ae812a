"""The launch record: ``mpmd_map``'s arguments, checked in one pass.

``check_launch`` reads each argument of ``mpmd_map`` once, in the order the
checks have always run (an argument with two faults reports the same one),
and returns a ``Launch``: the frozen record that every call of the function
``mpmd_map`` returns reads (tracing, the CPU path choice, ``bind``). Nothing
after it sees ``meshes_and_fns`` or an unchecked argument. What depends on
the operands or on the context of a call (input types, output avals under
``shard_map``) is checked per call, in ``mpmd.api``.
"""

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpmd._arguments import (
  as_out_type,
  canonical_owner,
  check_aliases_arg,
  check_interpret,
  check_meshes_and_fns,
  check_options,
  check_scratch_owners,
  check_scratch_spaces,
  scratch_aval,
)
from mpmd._jax import FrozenDict, state_types, tree_util
from mpmd._lowering import paths
from mpmd.types import Interpret, Mesh


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What the kernels are traced with besides the operands: one function
  per mesh, called as ``fn(*inputs, *outputs, *scratch)``. With the
  operand and output types of a call, the key of the traced-kernels cache:
  it holds only what tracing reads (hashable, compared by identity of the
  functions)."""

  meshes: tuple[Mesh, ...]
  fns: tuple[Callable[..., None], ...]
  out_tree: tree_util.PyTreeDef
  # A sequence of out types gives each kernel one Ref per output; any other
  # tree (one type, a dict) is one argument.
  is_output_sequence: bool
  scratch_avals: tuple[Any, ...]
  scratch_tree: tree_util.PyTreeDef
  name: str | None


@dataclasses.dataclass(frozen=True)
class Launch:
  """``mpmd_map``'s arguments, checked: the same for every call of the
  function it returns."""

  kernels: Kernels
  # The out_types leaves, each a jax.ShapeDtypeStruct or a memory-space
  # type; their avals are taken per call (under shard_map they say how the
  # outputs vary).
  out_types: tuple[Any, ...]
  input_output_aliases: FrozenDict  # {input index: output index}
  compiler_params: Any
  interpret: Interpret  # False is None: CPU has no native path
  debug: bool
  cost_estimate: Any
  metadata: FrozenDict | None
  # Layout transforms of scratch (swizzled / tiled SMEM), by scratch leaf:
  # the simulators allocate the logical buffer and need them.
  scratch_transforms: tuple[Any, ...]

  @property
  def meshes(self) -> tuple[Mesh, ...]:
    return self.kernels.meshes

  @property
  def name(self) -> str | None:
    return self.kernels.name


def check_launch(
  meshes_and_fns: Any,
  out_types: Any,
  *,
  scratch_types: Any,
  input_output_aliases: Any,
  compiler_params: Any,
  interpret: Any,
  debug: bool,
  cost_estimate: Any,
  name: Any,
  metadata: Any,
) -> Launch:
  """``mpmd_map``'s arguments (the same names) as a ``Launch``, or the
  TypeError / ValueError / NotImplementedError of the first one at fault,
  in this order: meshes and functions, out types, scratch types, name,
  compiler params, cost estimate, metadata, aliases, interpret."""
  meshes, fns = check_meshes_and_fns(meshes_and_fns)
  gpu = paths.is_gpu_mesh(meshes[0])
  flat_out_types, out_tree = _checked_out_types(out_types)
  scratch_avals, scratch_tree = _checked_scratch(
    scratch_types, meshes, fns, gpu
  )
  check_options(
    name=name,
    compiler_params=compiler_params,
    cost_estimate=cost_estimate,
    metadata=metadata,
    gpu=gpu,
  )
  aliases = check_aliases_arg(input_output_aliases)
  interpret = _checked_interpret(interpret, meshes)
  kernels = Kernels(
    meshes=meshes,
    fns=fns,
    out_tree=out_tree,
    is_output_sequence=isinstance(out_types, Sequence),
    scratch_avals=scratch_avals,
    scratch_tree=scratch_tree,
    name=name,
  )
  return Launch(
    kernels=kernels,
    out_types=flat_out_types,
    input_output_aliases=aliases,
    compiler_params=compiler_params,
    interpret=interpret,
    debug=debug,
    cost_estimate=cost_estimate,
    metadata=None if metadata is None else FrozenDict(metadata),
    scratch_transforms=_scratch_transforms(scratch_avals),
  )


def _checked_out_types(out_types) -> tuple[tuple[Any, ...], Any]:
  """The output types, flattened and each checked; their tree."""
  flat, tree = tree_util.tree_flatten(out_types)
  return tuple(as_out_type(t, i) for i, t in enumerate(flat)), tree


def _checked_scratch(scratch_types, meshes, fns, gpu: bool):
  """The scratch types as avals (owned where they must be), checked against
  the meshes and the platform's memory spaces; their tree."""
  flat, tree = tree_util.tree_flatten(scratch_types)
  avals = [canonical_owner(scratch_aval(t, i)) for i, t in enumerate(flat)]
  # (Parameter names only for a message: read if one is raised.)
  check_scratch_owners(avals, meshes, lambda: _scratch_names(fns, tree))
  check_scratch_spaces(avals, gpu)
  return tuple(avals), tree


def _scratch_names(fns, tree: tree_util.PyTreeDef) -> tuple[str, ...]:
  """Per scratch leaf, what the kernels call the parameter that holds it
  (``"'sem'"``; ``"'a' / 'b'"`` where kernels differ; ``""`` where no
  signature says), for messages: kernels take their scratch last, one
  parameter per element of a sequence, or by keyword for a mapping."""
  n = tree.num_leaves
  top = tree.unflatten(range(n))
  names: list[set[str]] = [set() for _ in range(n)]
  if isinstance(top, Mapping):
    for key, sub in top.items():
      for leaf in tree_util.tree_leaves(sub):
        names[leaf].add(str(key))
  elif isinstance(top, Sequence):
    for fn in fns:
      params = _positional_names(fn)
      if params is None or len(params) < len(top):
        continue
      for name, sub in zip(params[len(params) - len(top) :], top, strict=True):
        for leaf in tree_util.tree_leaves(sub):
          names[leaf].add(name)
  return tuple(" / ".join(map(repr, sorted(s))) for s in names)


def _positional_names(fn) -> list[str] | None:
  """``fn``'s positional parameters, None if it has ``*args`` or no
  signature."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return None
  if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
    return None
  positional = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
  )
  return [p.name for p in params if p.kind in positional]


def _checked_interpret(interpret: Any, meshes) -> Interpret:
  if interpret is False:
    interpret = None  # CPU has no native path: False means "the default".
  check_interpret(interpret, meshes)
  return interpret


def _scratch_transforms(scratch_avals) -> tuple[Any, ...]:
  return tuple(
    a.transforms if isinstance(a, state_types.TransformedRef) else ()
    for a in scratch_avals
  )
