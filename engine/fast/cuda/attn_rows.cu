// Batch-invariant attention, pass 1 (engine.fast.invariant.attention). A query's result depends
// on its own query vector, its row's keys and values and nothing else: not on the other rows,
// the row's place in the batch, the keys' column offset (left padding) or how many queries
// share the call (prefill chunking).
// block = (row b, head h, tile of QT queries, chunk c): chunk c holds the keys
// lo[b] + c*CH .. lo[b] + (c+1)*CH - 1, counted from the row's first key, so a key's chunk and
// warp are fixed by its place in the row's own sequence. Warp w reads the chunk's keys w, w+8,
// w+16, ... in that order; each query of the tile keeps its own online softmax (max m, sum l,
// output acc) over the keys it sees (column < hi[b, t] and, with USE_MASK, mask true). The dot
// product is a fixed per-lane sum then a fixed butterfly; the 8 warps meet in a fixed order.
// Writes (max, sum, acc[D]) per (b, h, t, c) to `partial` for attn_rows_combine.cu.
// dims: TQ (queries in this call), NC (chunks), CAPR (the K/V buffers' column count), T0 (this
// call's first query among the forward's), TALL (the forward's queries), LM (mask columns),
// USE_MASK (whether `mask` is read: a run-time value, so one compiled kernel serves every call).
  constexpr int PER = D / 32;
  const int TQ = dims[0], NC = dims[1], CAPR = dims[2], T0 = dims[3], TALL = dims[4], LM = dims[5];
  const bool USE_MASK = dims[6] != 0;
  const int NT = (TQ + QT - 1) / QT;
  int idx = blockIdx.x;
  const int c = idx % NC; idx /= NC;
  const int tile = idx % NT; idx /= NT;
  const int h = idx % H;
  const int b = idx / H;
  const int kvh = h / (H / HKV);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int lo = lo_row[b];
  const float sc = scale[0];
  float qf[QT][PER], acc[QT][PER], m[QT], l[QT];
  int hi[QT];
  int jmax = lo;
#pragma unroll
  for (int i = 0; i < QT; ++i) {
    const int t = tile * QT + i;
    hi[i] = t < TQ ? hi_q[(size_t)b * TALL + T0 + t] : lo;
    jmax = max(jmax, hi[i]);
    m[i] = -1e30f;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      qf[i][e] = t < TQ ? static_cast<float>(q[(((size_t)b * H + h) * TQ + t) * D + lane * PER + e]) * sc : 0.f;
      acc[i][e] = 0.f;
    }
  }
  const int j0 = lo + c * CH;
  const int j1 = min(j0 + CH, jmax);
  const T* kp = keys + ((size_t)b * HKV + kvh) * (size_t)CAPR * D;
  const T* vp = values + ((size_t)b * HKV + kvh) * (size_t)CAPR * D;
  for (int j = j0 + warp; j < j1; j += 8) {
    float kf[PER], vf[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      kf[e] = static_cast<float>(kp[(size_t)j * D + lane * PER + e]);
      vf[e] = static_cast<float>(vp[(size_t)j * D + lane * PER + e]);
    }
#pragma unroll
    for (int i = 0; i < QT; ++i) {
      bool seen = j < hi[i];
      if (USE_MASK && seen) seen = mask[((size_t)b * TALL + T0 + tile * QT + i) * LM + j];
      if (!seen) continue;                     // (the same for every lane: j and i are)
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < PER; ++e) dot += qf[i][e] * kf[e];
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const float mn = fmaxf(m[i], dot);
      const float corr = __expf(m[i] - mn);
      const float p = __expf(dot - mn);
      l[i] = l[i] * corr + p;
#pragma unroll
      for (int e = 0; e < PER; ++e) acc[i][e] = acc[i][e] * corr + p * vf[e];
      m[i] = mn;
    }
  }
  __shared__ float sm[QT][8], sl[QT][8], sacc[QT][8][D];
#pragma unroll
  for (int i = 0; i < QT; ++i) {
    if (lane == 0) { sm[i][warp] = m[i]; sl[i][warp] = l[i]; }
#pragma unroll
    for (int e = 0; e < PER; ++e) sacc[i][warp][lane * PER + e] = acc[i][e];
  }
  __syncthreads();
  for (int n = threadIdx.x; n < QT * (D + 2); n += 256) {
    const int i = n / (D + 2), d = n % (D + 2);
    const int t = tile * QT + i;
    if (t >= TQ) continue;
    float M = -1e30f;
    for (int w = 0; w < 8; ++w) M = fmaxf(M, sm[i][w]);
    float a = 0.f;
    if (d == 0) {
      a = M;
    } else if (d == 1) {
      for (int w = 0; w < 8; ++w) a += sl[i][w] * __expf(sm[i][w] - M);
    } else {
      for (int w = 0; w < 8; ++w) a += sacc[i][w][d - 2] * __expf(sm[i][w] - M);
    }
    partial[((((size_t)b * H + h) * TQ + t) * NC + c) * (D + 2) + d] = a;
  }
