"""Collective matmul: ring all-gather fused with matmul, and its twin.

Two kernels, each one ``mpmd_map`` launch per device, called inside
``jax.shard_map``, each with two named implementations (``implementation=``):
``"ring"`` (below; what a TPU runs) and ``"direct"`` (the CPU fallback's
default, further below). Both lower for TPU and run on the CPU fallback;
``implementation=None`` picks the ring when building for or simulating a TPU
and the direct one otherwise. On the ring:

* :func:`all_gather_matmul` computes ``all_gather(lhs, axis_name, axis=1,
  tiled=True) @ rhs`` without materialising the gathered ``lhs`` first: the
  shards of ``lhs`` travel around a ring of devices, and the matmul of each
  shard that has arrived (with its block of rows of ``rhs``) runs while the
  next shard is on the wire.
* :func:`matmul_reduce_scatter` computes ``psum_scatter(lhs @ rhs, axis_name,
  scatter_dimension, tiled=True)``: partial sums travel the ring and each
  device adds its own contribution for the block that passes by, computing
  the next block's partial product while the previous one is on the wire.

Schedule (one ring direction; ``D`` devices, ring positions ``p``)::

  all-gather + matmul, at position p:
    step 0      send own shard -> p+1           | acc  = lhs_p     @ rhs[p]
    step t>=1   recv shard p-t, forward -> p+1  | acc += lhs_{p-t} @ rhs[p-t]
  matmul + reduce-scatter, at position p (block b = p-1-s):
    step 0      part = lhs @ rhs[:, b] -> send to p+1
    step s>=1   part = lhs @ rhs[:, b] (while block b+1 arrives from p-1)
                then send part + received -> p+1 (at s = D-1: the output)

With ``bidirectional=True`` the work is split in two halves that travel in
opposite directions (rows of ``lhs`` for the all-gather, the non-scattered
dimension of the output for the reduce-scatter), so each link carries half
the bytes per step and both directions of every ICI link are busy. This
works for every ring length (odd ones too); when the split dimension is odd
the kernel uses the unidirectional schedule instead.

Flow control. Each direction has ``buffering`` receive slots. A sender may
write transfer ``t`` into slot ``t % buffering`` of its neighbour only after
the neighbour has finished with the previous occupant of that slot (computed
with it and forwarded it); the neighbour says so by signalling a "capacity"
semaphore on the sender. With one slot, the receiver first copies the slot
to a local staging buffer and frees the slot at once: forwarding straight
out of the only slot would make every device wait for its neighbour to free
a slot, all around the ring.

The direct schedule (``implementation="direct"``, the CPU fallback's
default): every device DMAs its shard of ``lhs`` (all-gather) or block ``b``
of its whole partial product (reduce-scatter) straight to every other
device, with one matmul after (all-gather) or before (reduce-scatter) the
exchange. It hides nothing, so on TPU the ring wins; on the CPU fallback,
where the devices run in step and every exchange is a rendezvous of all of
them, one exchange beats ``D - 1`` (see ``_direct.py``). ``bidirectional``
and ``buffering`` shape the ring only.

Memory. Operands, ring slots and accumulators stay in HBM; the local matmul
of each step is a double-buffered pipeline of ``(block_n, block_k)`` x
``(block_k, block_m)`` tiles through VMEM, so no operand has to fit on chip.
When a reduce-scatter region is a single tile, its partial sums stay on
chip: computed into a VMEM send buffer, the arriving sum added in place, and
sent from there.

Rings. ``axis_name`` may name one mesh axis or several (their flattened
index, in the order given, as ``jax.lax.all_gather`` does); on a 2-D mesh
with ``axis_name="y"`` every row of devices is an independent ring. ``ring``
optionally gives the order in which the ring visits the devices (a
permutation of ``range(D)``), as device-id rings did in the hand-written
Mosaic kernel. Remote DMAs name their target as a dict ``{axis: index}``
over the ring's axes; the other mesh axes keep the sender's coordinate,
which is what makes rows/columns of a multi-axis mesh independent rings.
"""

from mpmd.kernels.collective_matmul.api import (
  all_gather_matmul as all_gather_matmul,
)
from mpmd.kernels.collective_matmul.api import (
  matmul_reduce_scatter as matmul_reduce_scatter,
)
from mpmd.kernels.collective_matmul.checks import BlockSizes as BlockSizes

__all__ = [
  "BlockSizes",
  "all_gather_matmul",
  "matmul_reduce_scatter",
]
