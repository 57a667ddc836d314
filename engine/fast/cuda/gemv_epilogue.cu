// The fused GEMV's epilogue (after gemv_main.cu: every lane of the first warp holds the sums;
// lane r * B + b writes output (r, b)): the norm as a scale, then the residual add (EPI 1) or
// SiLU(gate) * up (EPI 2), with the model's roundings.
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int n = n0 + r;
      if (lane != (r * B + b) % 32 || n >= NOUT) continue;
      const float inv = NORM ? rsqrtf(ss[b] / K + EPS_NUM / 1e12f) : 1.f;
      const float gt = static_cast<float>(T(acc[r][b] * inv));
      float res;
      if (EPI == 1) {
        res = static_cast<float>(residual[(size_t)b * NOUT + n]) + gt;
      } else if (EPI == 2) {
        const float ut = static_cast<float>(T(acc[r + R][b] * inv));
        const float s = static_cast<float>(T(gt / (1.f + __expf(-gt))));
        res = s * ut;
      } else {
        res = gt;
      }
      out[(size_t)b * NOUT + n] = T(res);
    }
  }
