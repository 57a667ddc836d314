// Batch-invariant attention, pass 2 (engine.fast.invariant.attention): the NC chunk partials of
// each (row, head, query) of attn_rows.cu combined in chunk order. A chunk the query saw no key
// of holds (max -1e30, sum 0, acc 0) and adds exact zeros, so a call with more chunks (a longer
// row elsewhere in the batch) gives the same bits.
  // block = (row b, head h, query t); thread d combines element d.
  const int NC = dims[1];
  const size_t bht = blockIdx.x;
  const int d = threadIdx.x;
  if (d >= D) return;
  const float* p = partial + bht * NC * (D + 2);
  float M = -1e30f;
  for (int s = 0; s < NC; ++s) M = fmaxf(M, p[s * (D + 2)]);
  float L = 0.f, a = 0.f;
  for (int s = 0; s < NC; ++s) {
    const float w = __expf(p[s * (D + 2)] - M);
    L += p[s * (D + 2) + 1] * w;
    a += p[s * (D + 2) + 2 + d] * w;
  }
  out[bht * D + d] = T(a / L);
