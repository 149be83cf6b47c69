// scan.cu: the selective state-space recurrence of Mamba-1 and Mamba-2 (the CPU kernel's
// twin, cpp/cpu_scan.cc), position after position:
//
//   s[n] = exp(dt · A[h, n]) · s[n] + dt · x[p] · B[g, n],   y[p] = Σ_n s[n] · C[g, n]
//
// Why: on the GPU the MLX forms of the scan are many small graph nodes (a Mamba-1 decode step is
// about a dozen, Mamba-2's chunked SSD some forty batched matmuls and reshapes per layer), and
// decode on MLX's CUDA backend is bound by host time per node. Here a layer's scan is one node.
//
// One warp per (batch, head, channel p): lane l holds the states n = l, l + 32, ... (J of them
// in registers, J = ceil(N / 32), a template parameter so Mamba-1's N = 16 keeps one) and y is a
// warp sum. Positions are taken SCAN_TILE at a
// time with their inputs loaded before the recurrence runs through them, so the loads of a tile
// overlap instead of each waiting on the previous position's state.
//
// Layouts (all float32, row-contiguous): x [B, L, H, P], dt [B, L, H], a [H, N] (`per_head`:
// column 0 only, one decay per head), bm, cm [B, L, G, N] (head h reads group h / (H / G)),
// h0 [B, H, P, N]; out [B, L·H·P + H·P·N]: y, then the last state.
// Launch: threads = 32 · B · H · P, threadgroup (128, 1, 1).

#define SCAN_TILE 8

template <int J>
__device__ __forceinline__ void selective_scan(const float* x, const float* dt, const float* a,
                                               const float* bm, const float* cm, const float* h0,
                                               float* out, int B, int L, int H, int P, int G,
                                               int N, int per_head) {
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= (long long)B * H * P) {
    return;
  }
  const int p = (int)(warp % P);
  const int h = (int)((warp / P) % H);
  const int b = (int)(warp / ((long long)P * H));
  const int g = h / (H / G);
  const long long per_batch = (long long)L * H * P + (long long)H * P * N;
  float* y_out = out + b * per_batch;
  float* s_out = y_out + (long long)L * H * P;

  float s[J];
  float arow[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int n = lane + 32 * j;
    const bool in = n < N;
    s[j] = in ? h0[(((long long)b * H + h) * P + p) * N + n] : 0.0f;
    arow[j] = in ? a[(long long)h * N + (per_head ? 0 : n)] : 0.0f;
  }
  for (int t0 = 0; t0 < L; t0 += SCAN_TILE) {
    float dts[SCAN_TILE], xs[SCAN_TILE], bs[SCAN_TILE][J], cs[SCAN_TILE][J];
#pragma unroll
    for (int k = 0; k < SCAN_TILE; ++k) {
      const int t = t0 + k;
      const bool live = t < L;
      const long long bt = (long long)b * L + t;
      dts[k] = live ? dt[bt * H + h] : 0.0f;
      xs[k] = live ? x[(bt * H + h) * P + p] : 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int n = lane + 32 * j;
        const bool in = live && n < N;
        bs[k][j] = in ? bm[(bt * G + g) * N + n] : 0.0f;
        cs[k][j] = in ? cm[(bt * G + g) * N + n] : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < SCAN_TILE; ++k) {
      const int t = t0 + k;
      if (t >= L) {
        break;
      }
      const float dx = dts[k] * xs[k];
      float y = 0.0f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        s[j] = expf(dts[k] * arow[j]) * s[j] + dx * bs[k][j];
        y += s[j] * cs[k][j];
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        y += __shfl_xor_sync(0xffffffffu, y, off);
      }
      if (lane == 0) {
        y_out[((long long)t * H + h) * P + p] = y;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int n = lane + 32 * j;
    if (n < N) {
      s_out[((long long)h * P + p) * N + n] = s[j];
    }
  }
}
