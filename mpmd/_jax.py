"""The one door to JAX internals.

jax-mpmd builds a JAX primitive and reuses Pallas' Mosaic / Mosaic GPU
lowerings and simulators, which only exist under ``jax._src``. Every such
import lives here, behind a check of the exact jax version we were built and
tested against, so that a mismatch fails at import with a clear message
instead of deep inside a lowering.
"""

import functools
import types

import jax
import jaxlib

SUPPORTED_JAX_VERSION = "0.10.2"

if jax.__version__ != SUPPORTED_JAX_VERSION or (
  jaxlib.__version__ != SUPPORTED_JAX_VERSION
):
  raise ImportError(
    f"jax-mpmd supports exactly jax=={SUPPORTED_JAX_VERSION} and "
    f"jaxlib=={SUPPORTED_JAX_VERSION} (it uses jax._src internals), but "
    f"found jax=={jax.__version__} and jaxlib=={jaxlib.__version__}. "
    f"Run: pip install 'jax=={SUPPORTED_JAX_VERSION}' "
    f"'jaxlib=={SUPPORTED_JAX_VERSION}'"
  )

# ruff: noqa: E402, F401, I001
from jax._src import api_util
from jax._src import callback
from jax._src import config
from jax._src import core
from jax._src import effects
from jax._src import linear_util as lu
from jax._src import mesh as mesh_lib
from jax._src import sharding_impls
from jax._src import source_info_util
from jax._src import state
from jax._src import tree_util
from jax._src import util
from jax._src.frozen_dict import FrozenDict
from jax._src import ad_util
from jax._src.interpreters import ad
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import parallel as lax_parallel
from jax._src.pallas import core as pallas_core
from jax._src.pallas import pallas_call
from jax._src.pallas import primitives as pallas_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import primitives as state_primitives
from jax._src.state import types as state_types
from jax._src.pallas import hlo_interpreter


@functools.cache
def tpu():
  """Pallas TPU (Mosaic) internals, imported on first use."""
  try:
    from jax._src.pallas.mosaic import core as tpu_core
    from jax._src.pallas.mosaic import pallas_call_registration
    from jax._src.pallas.mosaic import primitives as tpu_primitives
    from jax._src.pallas.mosaic import tpu_info
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic.interpret import params as interpret_params
    from jax._src.pallas.mosaic.interpret import shared_memory
  except ImportError as e:
    raise ImportError(
      "jax-mpmd: the Pallas TPU backend is missing from this jaxlib; "
      "install jax-mpmd[tpu]"
    ) from e
  return types.SimpleNamespace(
    core=tpu_core,
    registration=pallas_call_registration,
    primitives=tpu_primitives,
    info=tpu_info,
    interpret=interpret_params,
    simulator=interpret_pallas_call,
    simulator_memory=shared_memory,
  )


@functools.cache
def gpu():
  """Pallas Mosaic GPU internals, imported on first use."""
  try:
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import pallas_call_registration
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
  except ImportError as e:
    raise ImportError(
      "jax-mpmd: the Pallas Mosaic GPU backend is missing from this "
      "jaxlib; install jax-mpmd[cuda]"
    ) from e
  return types.SimpleNamespace(
    core=gpu_core,
    registration=pallas_call_registration,
    primitives=gpu_primitives,
    interpret=interpret_params,
    simulator=interpret_pallas_call,
    simulator_callbacks=gpu_callbacks,
    simulator_memory=shared_memory,
  )
