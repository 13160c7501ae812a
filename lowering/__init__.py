"""Lowering of ``mpmd_map_p``: per platform (``tpu``, ``gpu``, ``cpu``; the
rules are registered by ``register``), the CPU fallback's paths (``paths``
decides; ``fast``, ``lockstep``, the simulators run), the merge of several
meshes into one kernel, and what they share."""
