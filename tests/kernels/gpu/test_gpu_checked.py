"""Our GPU pipelines on the checking executor, clean.

The pipeline, upstream-pipeline and matmul cases of the simulator tests run
again with ``interpret=mpmd.CheckParams(schedule=...)``: a seeded random
schedule of the warpgroups, TMA copies and WGMMAs, with the race,
uninitialised-read, fence and leftover checks on. Each must give the
reference's numbers and raise nothing.
"""

import functools

import gpu_test_util as util
import pytest
import test_gpu_matmul as matmul_cases
import test_gpu_pipeline as pipeline_cases
from test_gpu_upstream_emit_pipeline import EmitPipelineCases
from test_gpu_upstream_ws_pipeline import WsPipelineCases
from upstream_pipeline_util import Simulated

import mpmd

SCHEDULE = "random:7"
CHECKED = mpmd.CheckParams(schedule=SCHEDULE)


class Checked(Simulated):
  interpret = CHECKED


class TestEmitPipelineChecked(Checked, EmitPipelineCases):
  pass


class TestWsPipelineChecked(Checked, WsPipelineCases):
  pass


def _checked(call):
  return staticmethod(functools.partial(call, interpret=CHECKED))


class TestSoftwarePipelineChecked(pipeline_cases.PipelineTestBase):
  call = _checked(pipeline_cases._software_call)


class TestWarpSpecializedChecked(pipeline_cases.PipelineTestBase):
  call = _checked(pipeline_cases._ws_call)


class TestWarpSpecializedMultiMeshChecked(pipeline_cases.PipelineTestBase):
  call = _checked(functools.partial(pipeline_cases._ws_call, multi_mesh=True))


class TestMatmulChecked(matmul_cases.MatmulTestBase):
  def check(self, fn, args, expected):
    util.assert_close(fn(*args, interpret=CHECKED), expected)


@pytest.mark.parametrize("schedule", ["default", "random:1", "pct:3:2"])
@pytest.mark.parametrize("warp_specialized", [False, True])
def test_matmul_schedules(rng, schedule, warp_specialized):
  a, b = matmul_cases._inputs(rng, matmul_cases.jnp.bfloat16)
  out = matmul_cases.gpu.matmul(
    a,
    b,
    warp_specialized=warp_specialized,
    interpret=mpmd.CheckParams(schedule=schedule),
  )
  util.assert_close(out, util.matmul_reference(a, b))
