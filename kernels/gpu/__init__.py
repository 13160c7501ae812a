"""Pipelined GPU kernels on ``mpmd_map`` (Mosaic GPU; simulated on CPU).

* :func:`pipeline`: software pipeline inside one GPU mesh.
* :func:`warp_specialized_pipeline`: the same contract split across a memory
  mesh (TMA copies) and a compute mesh (the body), assembled into one
  ``mpmd_map`` call by :func:`warp_specialized_kernel`.
* :func:`matmul`: Hopper-style tiled matmul (TMA, swizzled SMEM, WGMMA) on
  either pipeline; :func:`fused_matmul` adds a fused ``activation(a @ b + c)``
  epilogue.
"""

from mpmd.kernels.gpu.fused_matmul import fused_matmul as fused_matmul
from mpmd.kernels.gpu.matmul import matmul as matmul
from mpmd.kernels.gpu.pipeline import (
  WarpSpecializedPipeline as WarpSpecializedPipeline,
)
from mpmd.kernels.gpu.pipeline import pipeline as pipeline
from mpmd.kernels.gpu.pipeline import (
  warp_specialized_kernel as warp_specialized_kernel,
)
from mpmd.kernels.gpu.pipeline import (
  warp_specialized_pipeline as warp_specialized_pipeline,
)

__all__ = [
  "WarpSpecializedPipeline",
  "fused_matmul",
  "matmul",
  "pipeline",
  "warp_specialized_kernel",
  "warp_specialized_pipeline",
]
