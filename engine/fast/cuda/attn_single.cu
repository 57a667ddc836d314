// Decode attention in one pass (NS == 1): the block holds every key of its head, so it
// normalises and writes the output.
#include "attn_chunk.cu"
  float L = 0.f;
  for (int w = 0; w < 8; ++w) L += sl[w] * __expf(sm[w] - M);
  for (int d = threadIdx.x; d < D; d += 256) {
    float a = 0.f;
    for (int w = 0; w < 8; ++w) a += sacc[w][d] * __expf(sm[w] - M);
    out[(size_t)blockIdx.x * D + d] = T(a / L);
  }
