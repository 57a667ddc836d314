"""L3 decode fast path and the transforms behind the performance levers.

- `merge`: merged q/k/v and gate/up projections (bit-exact on the CPU: an L1 lever).
- `config`: `FastConfig`, the fast path's own settings (resolved with the levers).
- `kernels`, `gemv`: fused CUDA kernels through `mx.fast.cuda_kernel`, each with a stock-MLX
  reference of the same math that runs everywhere else; `mega`: the whole decode step as one
  kernel (`mega_cuda`, `mega_layout`: its build and its memory).
- `cuda/`: the kernels' CUDA sources (`sources` reads them).
- `decode`, `step`: the fast runner's compiled decode step for 1..N rows (L3); `slots`: the
  batch rows' KV for it (a slot a row).
- `apply`: turning a `Levers` value into a prepared model and its fast step.
"""
