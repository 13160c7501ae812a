from mpmd.kernels.grouped_matmul import gmm as gmm
from mpmd.kernels.grouped_matmul import tgmm as tgmm
