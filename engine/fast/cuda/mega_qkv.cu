// The one-kernel step's phase A (RMSNorm -> merged q/k/v -> RoPE, keys and values into the
// cache) and, for models with per-head q/k norms (qwen3), phase A2; included by mega_step.cu
// inside its loop over the layers.
//
// A warp per rotation pair (rows i and i + D/2 of a head), its dot products over the normalised
// input in shared memory; lane b rotates row b's pair and writes q into the workspace, k and v
// into the cache at the position. With FLOW (one-row calls) the pairs of the keys and values
// come first and each pair counts up its head's flag (phase B waits on those instead of a
// barrier). With QKN, phase A leaves q and k unrotated; after a
// barrier a warp per head normalises, then rotates it (A2).
    // --- A: norm -> q/k/v -> RoPE, k/v into the cache (a warp per rotation pair)
    {
      load_normed(LN1[l], l == 0, hbuf);
      // lane b (< RB) writes row b's rotation pair u (rows i and i + HALF of its head) from
      // their two values (each the projection's output rounded to T)
      auto pair_out = [&](int u, int b, float x1, float x2) {
        const int head = u / HALF, i = u % HALF;
        const size_t row = (size_t)crow[ROW0 + b];      // (its cache row)
        if (QKN && head < NQ + NKV) {          // normalised and rotated in phase A2
          float* dst = head < NQ ? qbuf + b * QD + head * D : kraw + b * QD + (head - NQ) * D;
          dst[i] = x1;
          dst[i + HALF] = x2;
        } else if (head < NQ + NKV) {
          const float theta = static_cast<float>(rpos[ROW0 + b] + L3_FAULT_SHIFT) * inv_freq[i];
          float sn, c;
          sincosf(theta, &sn, &c);
          const T y1 = T(x1 * c - x2 * sn), y2 = T(x1 * sn + x2 * c);
          if (head < NQ) {
            qbuf[b * QD + head * D + i] = static_cast<float>(y1);
            qbuf[b * QD + head * D + i + HALF] = static_cast<float>(y2);
          } else {
            T* kc = KC[l] + ((row * NKV + (head - NQ)) * CAP + col[ROW0 + b]) * D;
            kc[i] = y1;
            kc[i + HALF] = y2;
          }
        } else {
          T* vc = VC[l] + ((row * NKV + (head - NQ - NKV)) * CAP + col[ROW0 + b]) * D;
          vc[i] = T(x1);
          vc[i + HALF] = T(x2);
        }
      };
      auto qkv_out = [&](int u, const float* acc) {
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          if (lane != b) continue;
          pair_out(u, b, static_cast<float>(T(acc[b] * sinv[b])), static_cast<float>(T(acc[RB + b] * sinv[b])));
        }
      };
      // FLOW: one more pair of this q/k/v head is out (the lanes' writes before the release):
      // one flag per query head, which its own pairs and those of its key and value heads count
      // up (a key or value head's lanes add to each of its group's NQ/NKV flags), so that an
      // attention unit waits on one flag, one round trip, not three
      auto head_done = [&](int head) {
        __syncwarp();
        constexpr int G = NQ / NKV;
        for (int j = lane; j < (head < NQ ? 1 : G); j += 32) {
          const int t = head < NQ ? head : ((head - NQ) % NKV) * G + j;
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(fcnt + l * (NQ + 2 * NKV) + t) : "memory");
        }
      };
      for (int u0 = gw; u0 < NPAIR; u0 += NW) {
        const int u = flow ? (u0 + NQ * HALF) % NPAIR : u0;   // FLOW: the keys and values first
        const int r1 = (u / HALF) * D + u % HALF;
        const int idx[2] = {r1, r1 + HALF};
        float acc[2 * RB];
        mega_mat_dot<T, XN, H, 2, RB, UN2, QB, GS>(WQKV[l], WQKV_S[l], WQKV_B[l], idx, xn, lane, acc, pol);
        qkv_out(u, acc);
        if (flow) head_done(u / HALF);
      }
    }
    if constexpr (QKN != 0) {
      mega_grid_sync(ctr, target);
      // --- A2 (q/k norms): a warp per (row, q or k head): RMSNorm over the head's D values
      // (rounded as the model's RMSNorm rounds: normalised, then times the weight), RoPE on
      // the pairs (i, i + D/2) a lane owns, q back into qbuf, k into the cache
      constexpr int PPL = (HALF + 31) / 32;     // rotation pairs a lane owns (i < HALF)
      for (int u = gw; u < RB * (NQ + NKV); u += NW) {
        const int b = u / (NQ + NKV), hd = u % (NQ + NKV);
        float* src = hd < NQ ? qbuf + b * QD + hd * D : kraw + b * QD + (hd - NQ) * D;
        const T* nw = hd < NQ ? QN[l] : KN[l];
        float x1[PPL], x2[PPL], ss = 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const bool own = lane + 32 * j < HALF;
          x1[j] = own ? __ldcg(src + lane + 32 * j) : 0.f;
          x2[j] = own ? __ldcg(src + lane + 32 * j + HALF) : 0.f;
          ss += x1[j] * x1[j] + x2[j] * x2[j];
        }
        const float rn = rsqrtf(mega_warp_sum(ss) / D + eps);
        const float pos = static_cast<float>(rpos[ROW0 + b] + L3_FAULT_SHIFT);
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
          const int i = lane + 32 * j;
          if (i >= HALF) break;
          const float y1 = static_cast<float>(T(static_cast<float>(T(x1[j] * rn)) * static_cast<float>(nw[i])));
          const float y2 = static_cast<float>(T(static_cast<float>(T(x2[j] * rn)) * static_cast<float>(nw[i + HALF])));
          float sn, c;
          sincosf(pos * inv_freq[i], &sn, &c);
          const T z1 = T(y1 * c - y2 * sn), z2 = T(y1 * sn + y2 * c);
          if (hd < NQ) {
            src[i] = static_cast<float>(z1);
            src[i + HALF] = static_cast<float>(z2);
          } else {
            T* kc = KC[l] + (((size_t)crow[ROW0 + b] * NKV + (hd - NQ)) * CAP + col[ROW0 + b]) * D;
            kc[i] = z1;
            kc[i + HALF] = z2;
          }
        }
      }
    }
