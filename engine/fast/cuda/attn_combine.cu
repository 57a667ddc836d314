// Decode attention, the second pass after attn_partial.cu: the NS chunk partials of each
// (row, head) combined.
  // block = (row b, head h); thread d combines the NS chunk partials of element d.
  const int bh = blockIdx.x;
  const int d = threadIdx.x;
  if (d >= D) return;
  const float* p = partial + (size_t)bh * NS * (D + 2);
  float M = -1e30f;
  for (int s = 0; s < NS; ++s) M = fmaxf(M, p[s * (D + 2)]);
  float L = 0.f, a = 0.f;
  for (int s = 0; s < NS; ++s) {
    const float w = __expf(p[s * (D + 2)] - M);
    L += p[s * (D + 2) + 1] * w;
    a += p[s * (D + 2) + 2 + d] * w;
  }
  out[(size_t)bh * D + d] = T(a / L);
