// RoPE on a merged q/k/v projection's output (engine.fast.kernels.rope_qkv): q and k rotated
// at pos[0] (or pos[b], PER_ROW), v copied; L3_FAULT_SHIFT (faults.cuh) rotates one
// position off.
  // one thread per (row, head, pair); heads 0..H-1 are q, H..H+HKV-1 k, the rest v
  const unsigned int gid = blockIdx.x * blockDim.x + threadIdx.x;
  constexpr int HALF = D / 2;
  constexpr int NH = H + 2 * HKV;
  if (gid >= (unsigned int)(B * NH * HALF)) return;
  const int i = gid % HALF;
  const int head = (gid / HALF) % NH;
  const int b = gid / (HALF * NH);
  const T* src = qkv + (size_t)b * NH * D + (size_t)head * D;
  const float x1 = static_cast<float>(src[i]);
  const float x2 = static_cast<float>(src[i + HALF]);
  if (head >= H + HKV) {
    T* dst = v + ((size_t)b * HKV + (head - H - HKV)) * D;
    dst[i] = src[i];
    dst[i + HALF] = src[i + HALF];
    return;
  }
  // PER_ROW: pos holds one position per row (rows of the batch), else one for all
  const float theta = static_cast<float>(pos[PER_ROW ? b : 0] + L3_FAULT_SHIFT) * inv_freq[i];
  float s, c;
  sincosf(theta, &s, &c);
  T* dst = head < H ? q + ((size_t)b * H + head) * D : k + ((size_t)b * HKV + (head - H)) * D;
  dst[i] = T(x1 * c - x2 * s);
  dst[i + HALF] = T(x1 * s + x2 * c);
