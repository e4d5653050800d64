// The end of a one-row product kernel (awq_gemv.cu, plain_gemv.cu): a CTA's sums for a slice of
// outputs stored, or, with K split over gridDim.y CTAs, summed in split order by the slice's
// last CTA to finish, so the result does not depend on which finished last.
#pragma once

#include <cstdint>

#include "one_row.cuh"

namespace gemv {

using one_row::store;

// `sums` (shared memory, every thread's writes to it done and synchronized): the CTA's sums for
// outputs first .. first + count - 1 (those below n exist), count at most PER_THREAD a thread.
// One split: stored to y. Several: written to partials[blockIdx.y] ([splits, n] float32), and
// the last CTA of slice blockIdx.x (counters[blockIdx.x] counts them; zero between launches,
// put back to zero by that CTA) adds the splits' parts in order into y, its loads issued
// BATCH splits at a time for all of a thread's outputs (a load the add waits for, each in
// turn, cost an L2 round trip a split: about 2 us at 32 splits). Every thread calls it.
template <int PER_THREAD, int BATCH, typename YT>
__device__ void finish(const float* sums, int count, int first, int n, YT* y, float* partials,
                       int32_t* counters) {
  if (gridDim.y == 1) {
    for (int m = threadIdx.x; m < count; m += blockDim.x)
      if (first + m < n) store(y + first + m, sums[m]);
    return;
  }
  float* part = partials + static_cast<size_t>(blockIdx.y) * n;
  for (int m = threadIdx.x; m < count; m += blockDim.x)
    if (first + m < n) part[first + m] = sums[m];
  __threadfence();  // this CTA's part visible before the count says so
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other CTAs' parts, counted, are visible to this one
  const int splits = static_cast<int>(gridDim.y);
  float t[PER_THREAD];
  bool mine[PER_THREAD];
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    const int m = threadIdx.x + j * static_cast<int>(blockDim.x);
    mine[j] = m < count && first + m < n;
    t[j] = 0.f;
  }
  for (int s0 = 0; s0 < splits; s0 += BATCH) {
    float v[PER_THREAD][BATCH];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const float* at = partials + first + threadIdx.x + j * blockDim.x;
#pragma unroll
      for (int b = 0; b < BATCH; ++b)
        v[j][b] = mine[j] && s0 + b < splits ? __ldcg(at + static_cast<size_t>(s0 + b) * n)
                                             : 0.f;
    }
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
#pragma unroll
      for (int b = 0; b < BATCH; ++b)
        if (s0 + b < splits) t[j] += v[j][b];  // in split order, as one loop over s would
    }
  }
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j)
    if (mine[j]) store(y + first + threadIdx.x + j * blockDim.x, t[j]);
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

}  // namespace gemv
