// Many dense arrays converted between float32 and the halves in one launch (fluxpy/kernels/cuda_halves.py's
// cast_many: a model's weights to the half type, their gradients back to float32), each to a layout of its own:
//   kind 0  the same memory order as the source (C order or channels-last, item for item),
//   kind 1  C order (N, C, *spatial) to channels-last: the destination holds (N, *spatial, C),
//   kind 2  channels-last to C order (also a transposed matrix, read as the channels-last (1, rows, columns)).
// SRC_DTYPE and DST_DTYPE as cast.cu; CAP arrays a launch at most, ITEMS items a thread in a block's chunk.
// Each destination item is read from its source item and divided by the scale where one is given (a float16 loss
// scale taken off the gradients: *scale_at where it is not null, else scale where it is not 0), as dividing the
// converted float32 array by it would.
//
// The table travels BY VALUE as a kernel parameter (as optimise_many.cu's): no device-side table, no
// host-to-device copy, so a captured CUDA graph holds it. Each block takes chunks of blockDim.x * ITEMS items of
// the destinations laid end to end; it finds the array holding a chunk's first item by a binary search over the
// start offsets, and each thread then walks forward through the arrays as its index grows (skipping empty ones).
#include "cast.cuh"

struct Arrays {
  long long src[CAP];        // source addresses
  long long dst[CAP];        // destination addresses
  long long start[CAP + 1];  // where each array begins in the concatenated index space
  long long channels[CAP];   // C, for kinds 1 and 2
  long long spatial[CAP];    // the product of the spatial sizes, for kinds 1 and 2
  long long kind[CAP];       // 0, 1 or 2, as above
};

// I: the index type, 32-bit where the array's items fit (a 64-bit division costs many instructions).
template <typename I>
__device__ __forceinline__ I source_index(I j, long long kind, I c, I s) {
  if (kind == 1) {           // j walks (N, *spatial, C): read (N, C, *spatial)
    const I ch = j % c, rest = j / c;
    return ((rest / s) * c + ch) * s + rest % s;
  }
  if (kind == 2) {           // j walks (N, C, *spatial): read (N, *spatial, C)
    const I px = j % s, rest = j / s;
    return ((rest / c) * s + px) * c + rest % c;
  }
  return j;
}

extern "C" __global__ void cast_many(const Arrays t, const int count, const float* scale_at, const float scale) {
  const bool scaled = scale_at != nullptr || scale != 0.0f;
  const float divisor = scale_at != nullptr ? *scale_at : scale;
  const long long total = t.start[count];
  const long long chunk = (long long)blockDim.x * ITEMS;
  for (long long first = (long long)blockIdx.x * chunk; first < total; first += (long long)gridDim.x * chunk) {
    int lo = 0, hi = count - 1;   // the last array k with start[k] <= first: the (non-empty) one holding it
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (t.start[mid] <= first) lo = mid; else hi = mid - 1;
    }
    int k = lo;
    long long begin = t.start[k], end = t.start[k + 1];
    const long long last = first + chunk < total ? first + chunk : total;
    for (long long e = first + threadIdx.x; e < last; e += blockDim.x) {
      while (e >= end) { ++k; begin = end; end = t.start[k + 1]; }
      const long long j = e - begin;
      const long long i = end - begin <= 0xffffffffLL
          ? (long long)source_index<unsigned>((unsigned)j, t.kind[k], (unsigned)t.channels[k], (unsigned)t.spatial[k])
          : source_index<long long>(j, t.kind[k], t.channels[k], t.spatial[k]);
      float v = SLOAD(((const ST*)t.src[k])[i]);
      if (scaled) v = v / divisor;
      ((DT*)t.dst[k])[j] = DSTORE(v);
    }
  }
}
