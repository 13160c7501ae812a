from mpmd.kernels.collective_matmul import (
  all_gather_matmul as all_gather_matmul,
)
from mpmd.kernels.collective_matmul import (
  matmul_reduce_scatter as matmul_reduce_scatter,
)
from mpmd.kernels.grouped_matmul import gmm as gmm
from mpmd.kernels.grouped_matmul import tgmm as tgmm
