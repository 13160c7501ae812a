"""Per-platform lowering rules of ``mpmd_map_p``, registered on import
(``import mpmd`` does it).

One module per platform (``tpu``, ``gpu``, ``cpu``), each imported when its
rule first runs. The rules are registered per platform, so a single
``lower(lowering_platforms=("cpu", "tpu"))`` or ``jax.export`` carries every
platform's lowering (``mlir.lower_per_platform``).
"""

from mpmd import targets
from mpmd._jax import mlir
from mpmd._lowering import paths
from mpmd._primitives.mpmd_map import mpmd_map_p


def _pass_tokens(ctx, outs):
  # The launch may declare a simulator's io_callback effects (decided where
  # it was traced, on a CPU host); a native kernel just passes tokens on.
  if ctx.tokens_out is None and ctx.tokens_in is not None:
    ctx.set_tokens_out(ctx.tokens_in)
  return outs


def _refuse_interpret_export(ctx, params):
  # interpret= runs the CPU fallback on any platform: host callbacks.
  if (
    ctx.module_context.lowering_parameters.for_export
    and params["interpret"] is not None
  ):
    raise NotImplementedError(
      f"mpmd_map: cannot export kernel {_kernel_name(params)!r} with "
      f"interpret={params['interpret']!r}: interpretation runs Python host "
      "callbacks, and jax.export cannot serialize those. Export with "
      "interpret=None (the default) for the hardware."
    )


def _tpu(ctx, *in_nodes, **params):
  from mpmd._lowering import tpu

  _refuse_interpret_export(ctx, params)
  with targets.answering():
    return _pass_tokens(ctx, tpu.lower(ctx, *in_nodes, **params))


def _cuda(ctx, *in_nodes, **params):
  from mpmd._lowering import gpu

  _refuse_interpret_export(ctx, params)
  return _pass_tokens(ctx, gpu.lower(ctx, *in_nodes, **params))


def _cpu(ctx, *in_nodes, **params):
  from mpmd._lowering import cpu

  module = ctx.module_context
  callbacks_before = len(module.host_callbacks) + len(module.keepalives)
  with targets.answering():  # the TPU simulator asks for tilings
    outs = cpu.lower(ctx, *in_nodes, **params)
  callbacks = len(module.host_callbacks) + len(module.keepalives)
  if module.lowering_parameters.for_export and callbacks > callbacks_before:
    _refuse_export(ctx, params)
  # The kernels' own ordered effects (an ordered io_callback in a body, or
  # the interpreter effect of a warp map traced under upstream's
  # force_gpu_interpret_mode) are declared on the launch, but the simulators
  # run them on a token chain of their own (supervised.lower_supervised).
  return _pass_tokens(ctx, outs)


def _kernel_name(params) -> str:
  if params["name"]:
    return params["name"]
  return "+".join(j.debug_info.func_name for j in params["jaxprs"])


def _refuse_export(ctx, params):
  path = params["cpu_path"]
  if path.kind == paths.FAST:
    why = (
      "it takes the CPU fallback's fast path, whose run-time checks (DMA "
      "windows that depend on run-time values, semaphore counts) are "
      "Python host callbacks"
    )
  else:
    why = (
      f"it takes the CPU fallback's {path.kind} path ({path.reason}), which "
      "runs Python host callbacks"
    )
  raise NotImplementedError(
    f"mpmd_map: cannot export the CPU lowering of kernel "
    f"{_kernel_name(params)!r}: {why}, and jax.export cannot serialize "
    "those. Export for the hardware only (platforms=('tpu',) or "
    "('cuda',)); on CPU, call the function itself instead of an export of it."
  )


def _rocm(ctx, *in_nodes, **params):
  del ctx, in_nodes, params
  raise NotImplementedError(
    "mpmd_map: ROCm is not supported (Mosaic GPU targets CUDA only)"
  )


mlir.register_lowering(mpmd_map_p, _tpu, platform="tpu")
mlir.register_lowering(mpmd_map_p, _cuda, platform="cuda")
mlir.register_lowering(mpmd_map_p, _cpu, platform="cpu")
mlir.register_lowering(mpmd_map_p, _rocm, platform="rocm")
