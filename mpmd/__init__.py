"""jax-mpmd: different functions on different meshes in one kernel launch.

``mpmd.mpmd_map([(mesh_a, fn_a), (mesh_b, fn_b)], out_types, ...)`` runs
``fn_a`` on ``mesh_a`` and ``fn_b`` on ``mesh_b`` inside one kernel launch.
It lowers to Mosaic on TPU, Mosaic GPU on CUDA, and runs through a CPU
fallback on CPU.
"""

from typing import Any as _Any

from mpmd import _jax as _jax  # checks the jax pin before anything else
from mpmd import testing as testing
from mpmd._lowering import register as _register  # the per-platform rules
from mpmd._lowering.errors import typed_errors as typed_errors
from mpmd._primitives.mpmd_map import mpmd_map_p as mpmd_map_p
from mpmd.api import mpmd_map as mpmd_map
from mpmd.checking import CheckParams as CheckParams
from mpmd.checking import Failure as Failure
from mpmd.checking import Report as Report
from mpmd.checking import explore as explore
from mpmd.checking import replay as replay
from mpmd.checking import timeline as timeline
from mpmd.errors import DeadlockError as DeadlockError
from mpmd.errors import DebugCheckError as DebugCheckError
from mpmd.errors import LaunchError as LaunchError
from mpmd.errors import LeftoverError as LeftoverError
from mpmd.errors import NondeterminismError as NondeterminismError
from mpmd.errors import OutOfBoundsError as OutOfBoundsError
from mpmd.errors import RaceError as RaceError
from mpmd.errors import UninitializedError as UninitializedError
from mpmd.kernel_call import kernel as kernel
from mpmd.meshes import tensorcore_mesh as tensorcore_mesh
from mpmd.simulators import Races as Races
from mpmd.simulators import deadlock_timeout as deadlock_timeout
from mpmd.simulators import get_deadlock_timeout as get_deadlock_timeout
from mpmd.simulators import get_race_policy as get_race_policy
from mpmd.simulators import get_races as get_races
from mpmd.simulators import race_policy as race_policy
from mpmd.simulators import set_deadlock_timeout as set_deadlock_timeout
from mpmd.simulators import set_race_policy as set_race_policy
from mpmd.targets import TPU_TARGETS as TPU_TARGETS
from mpmd.targets import tpu_target as tpu_target

__version__ = "0.1.0"

__all__ = [
  "CheckParams",
  "DeadlockError",
  "DebugCheckError",
  "Failure",
  "GPUInterpretParams",
  "LaunchError",
  "LeftoverError",
  "NondeterminismError",
  "OutOfBoundsError",
  "RaceError",
  "Races",
  "Report",
  "TPU_TARGETS",
  "UninitializedError",
  "deadlock_timeout",
  "explore",
  "get_deadlock_timeout",
  "get_race_policy",
  "get_races",
  "kernel",
  "mpmd_map",
  "mpmd_map_p",
  "race_policy",
  "replay",
  "set_deadlock_timeout",
  "set_race_policy",
  "tensorcore_mesh",
  "timeline",
  "tpu_target",
  "typed_errors",
]

del _register


def __getattr__(name: str) -> _Any:
  # jax 0.10.2 has no public name for the Mosaic GPU simulator's settings;
  # resolved on first use, so `import mpmd` needs no GPU backend.
  if name == "GPUInterpretParams":
    return _jax.gpu().interpret.InterpretGPUParams
  # `mpmd.kernels.gmm(...)` after a plain `import mpmd`: the kernels are
  # imported on first use (they import much of Pallas).
  if name == "kernels":
    import importlib

    return importlib.import_module("mpmd.kernels")
  raise AttributeError(f"module 'mpmd' has no attribute {name!r}")
