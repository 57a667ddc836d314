// The fused GEMV's q/k/v epilogue: the two rows of a rotation pair come out of one unit, rotated
// at position pos[0] or pos[b] (PER_ROW) (+ L3_FAULT_SHIFT, faults.cuh) and written straight
// into q [B, NQ, 1, D], k and v [B, NKV, 1, D]; v rows are copied unrotated.
  {
    constexpr int HALF = ROPE_D / 2;
    const int head = n0 / HALF, i = n0 % HALF;
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (lane != b) continue;
      const float inv = NORM ? rsqrtf(ss[b] / K + EPS_NUM / 1e12f) : 1.f;
      const float x1 = static_cast<float>(T(acc[0][b] * inv));
      const float x2 = static_cast<float>(T(acc[1][b] * inv));
      if (head >= NQ + NKV) {
        T* dst = v + ((size_t)b * NKV + (head - NQ - NKV)) * ROPE_D;
        dst[i] = T(x1);
        dst[i + HALF] = T(x2);
      } else {
        const float theta = static_cast<float>(pos[PER_ROW ? b : 0] + L3_FAULT_SHIFT) * inv_freq[i];
        float sn, cs;
        sincosf(theta, &sn, &cs);
        T* dst = head < NQ ? q + ((size_t)b * NQ + head) * ROPE_D
                           : k + ((size_t)b * NKV + (head - NQ)) * ROPE_D;
        dst[i] = T(x1 * cs - x2 * sn);
        dst[i + HALF] = T(x1 * sn + x2 * cs);
      }
    }
  }
