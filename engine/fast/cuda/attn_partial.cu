// Decode attention over one chunk of a row's keys (NS chunks a head): the chunk's (max, sum,
// output) into `partial`, for attn_combine.cu.
#include "attn_chunk.cu"
  float* out = partial + (size_t)blockIdx.x * (D + 2);
  for (int d = threadIdx.x; d < D; d += 256) {
    float a = 0.f;
    for (int w = 0; w < 8; ++w) a += sacc[w][d] * __expf(sm[w] - M);
    out[2 + d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
    for (int w = 0; w < 8; ++w) L += sl[w] * __expf(sm[w] - M);
    out[0] = M;
    out[1] = L;
  }
