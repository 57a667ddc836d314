"""L3 decode fast path and the transforms behind the performance levers.

- `merge`: merged q/k/v and gate/up projections (bit-exact on the CPU: an L1 lever).
- `kernels`: fused CUDA kernels through `mx.fast.cuda_kernel`, each with a stock-MLX
  reference of the same math that runs everywhere else.
- `decode`: the captured decode step over a preallocated cache (L3).
- `levers_apply`: turning a `Levers` value into a prepared model.
"""
