"""Names for the types in mpmd's public signatures.

``Mesh``: a Pallas mesh that programs run on: ``pltpu.TensorCoreMesh``
(``mpmd.tensorcore_mesh``), ``plsc.VectorSubcoreMesh`` /
``plsc.ScalarSubcoreMesh``, or ``plgpu.Mesh``.

``Interpret``: how a launch runs (``interpret=``): None (compiled on TPU and
GPU, the CPU fallback on CPU), True (the HLO interpreter), a
``pltpu.InterpretParams`` (the TPU simulator) or an
``mpmd.GPUInterpretParams`` (the Mosaic GPU simulator).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from mpmd._jax import pallas_core

if TYPE_CHECKING:
  from jax.experimental.pallas import tpu as pltpu

  import mpmd

Mesh: TypeAlias = pallas_core.Mesh
Interpret: TypeAlias = (
  "None | bool | pltpu.InterpretParams | mpmd.GPUInterpretParams"
)
MeshAndFn: TypeAlias = tuple[Mesh, Callable[..., None]]
