// Decode attention, the part both kernels share (engine.fast.kernels.decode_attention): block =
// (row b, query head h, chunk s of the row's keys [start, length) in buffer row b, or crow[b]
// with USE_CROW); its 8 warps stride over the
// chunk's keys, each keeping an online softmax (max m, sum l, output acc); then the block's
// warps meet in shared memory and M is the block's max. Included by attn_partial.cu and
// attn_single.cu; L3_FAULT_DROP (faults.cuh) leaves the newest key out.
  // block = (row b, query head h, chunk s); 8 warps stride over the chunk's keys.
  constexpr int PER = D / 32;
  const int s = blockIdx.x % NS;
  const int h = (blockIdx.x / NS) % H;
  const int b = blockIdx.x / (NS * H);
  const int kvh = h / (H / HKV);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int len = length[ROWLEN ? b : 0] - L3_FAULT_DROP;   // (ROWLEN: one length a row)
  const int lo = USE_START ? start[b] : 0;   // the row's first key (its left padding)
  const int chunk = (len - lo + NS - 1) / NS;
  const int j0 = lo + s * chunk;
  const int j1 = min(len, j0 + chunk);
  const T* qp = q + ((size_t)b * H + h) * D;
  // the buffer row the row's keys and values are in (USE_CROW: crow[b], a verify's rows sharing one)
  const size_t brow = USE_CROW ? (size_t)crow[b] : (size_t)b;
  const T* kp = keys + (brow * HKV + kvh) * (size_t)CAP * D;
  const T* vp = values + (brow * HKV + kvh) * (size_t)CAP * D;
  float qf[PER], acc[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    qf[e] = static_cast<float>(qp[lane * PER + e]) * SCALE_NUM / 1e9f;
    acc[e] = 0.f;
  }
  float m = -1e30f, l = 0.f;
  for (int j = j0 + warp; j < j1; j += 8) {
    const T* kr = kp + (size_t)j * D + lane * PER;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < PER; ++e) dot += qf[e] * static_cast<float>(kr[e]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float mn = fmaxf(m, dot);
    const float corr = __expf(m - mn);
    const float p = __expf(dot - mn);
    l = l * corr + p;
    const T* vr = vp + (size_t)j * D + lane * PER;
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] = acc[e] * corr + p * static_cast<float>(vr[e]);
    m = mn;
  }
  __shared__ float sm[8], sl[8], sacc[8][D];
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
  for (int e = 0; e < PER; ++e) sacc[warp][lane * PER + e] = acc[e];
  __syncthreads();
  float M = -1e30f;
  for (int w = 0; w < 8; ++w) M = fmaxf(M, sm[w]);
