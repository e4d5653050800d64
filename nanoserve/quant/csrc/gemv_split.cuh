// The end of a one-row product kernel (awq_gemv.cu, fp8_gemv.cu): a CTA's sums for a slice of
// outputs stored, or, with K split over gridDim.y CTAs, summed in split order by the slice's
// last CTA to finish, so the result does not depend on which finished last.
#pragma once

#include <cstdint>

#include "one_row.cuh"

namespace gemv {

using one_row::store;

// `sums` (shared memory, every thread's writes to it done and synchronized): the CTA's sums for
// outputs first .. first + count - 1 (those below n exist). One split: stored to y. Several:
// written to partials[blockIdx.y] ([splits, n] float32), and the last CTA of slice blockIdx.x
// (counters[blockIdx.x] counts them; zero between launches, put back to zero by that CTA) adds
// the splits' parts in order into y. Every thread of the CTA calls it.
template <typename YT>
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
  for (int m = threadIdx.x; m < count; m += blockDim.x) {
    if (first + m >= n) continue;
    float t = 0.f;
    for (int s = 0; s < static_cast<int>(gridDim.y); ++s)
      t += __ldcg(partials + static_cast<size_t>(s) * n + first + m);
    store(y + first + m, t);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

}  // namespace gemv
