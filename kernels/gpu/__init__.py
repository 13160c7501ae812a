"""Pipelined GPU kernels on ``mpmd_map`` (Mosaic GPU; simulated on CPU).

* :func:`pipeline`: software pipeline inside one GPU mesh.
* :func:`warp_specialized_pipeline`: the same contract split across a memory
  mesh (TMA copies) and a compute mesh (the body), assembled into one
  ``mpmd_map`` call by :func:`warp_specialized_kernel`.
* :func:`emit_pipeline` and :func:`emit_pipeline_warp_specialized`: drop-ins
  for upstream's ``plgpu`` functions of the same names (the second runs the
  warp-specialized pipeline on the thread axis of one mesh).
* :func:`matmul`: Hopper-style tiled matmul (TMA, swizzled SMEM, WGMMA) on
  either pipeline; :func:`fused_matmul` adds a fused ``activation(a @ b + c)``
  epilogue.
"""

from mpmd.kernels.gpu.fused_matmul import fused_matmul as fused_matmul
from mpmd.kernels.gpu.launch import (
  warp_specialized_kernel as warp_specialized_kernel,
)
from mpmd.kernels.gpu.matmul import matmul as matmul
from mpmd.kernels.gpu.pipeline import pipeline as pipeline
from mpmd.kernels.gpu.upstream import (
  EmittedWarpSpecializedPipeline as EmittedWarpSpecializedPipeline,
)
from mpmd.kernels.gpu.upstream import emit_pipeline as emit_pipeline
from mpmd.kernels.gpu.upstream import (
  emit_pipeline_warp_specialized as emit_pipeline_warp_specialized,
)
from mpmd.kernels.gpu.warp_specialized import (
  WarpSpecializedPipeline as WarpSpecializedPipeline,
)
from mpmd.kernels.gpu.warp_specialized import (
  warp_specialized_pipeline as warp_specialized_pipeline,
)

__all__ = [
  "EmittedWarpSpecializedPipeline",
  "WarpSpecializedPipeline",
  "emit_pipeline",
  "emit_pipeline_warp_specialized",
  "fused_matmul",
  "matmul",
  "pipeline",
  "warp_specialized_kernel",
  "warp_specialized_pipeline",
]
