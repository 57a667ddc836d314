// Residual add + RMSNorm (engine.fast.kernels.add_rms_norm): h = x + r, y = RMSNorm(h) * w,
// rounded as the model's own operations round them.
  // one block of 256 threads per row of D elements
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const T* xr = x + (size_t)row * D;
  const T* rr = r + (size_t)row * D;
  T* hr = h + (size_t)row * D;
  T* yr = y + (size_t)row * D;
  float ss = 0.f;
  for (int i = tid; i < D; i += 256) {
    T hv = T(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
    hr[i] = hv;
    float f = static_cast<float>(hv);
    ss += f * f;
  }
  __shared__ float part[8];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) part[tid >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int j = 0; j < 8; ++j) tot += part[j];
  const float inv = rsqrtf(tot / D + EPS_NUM / 1e9f);
  for (int i = tid; i < D; i += 256) {
    float hv = static_cast<float>(hr[i]);
    yr[i] = T(static_cast<float>(w[i]) * static_cast<float>(T(hv * inv)));
  }
