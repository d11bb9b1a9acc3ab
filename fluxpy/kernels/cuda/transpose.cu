// A permuted view copied to C order in TILE x TILE tiles through shared memory (fluxpy/kernels/cuda_arrays.py):
// read along the axis whose elements are adjacent in the source, written along the destination's last, so both
// sides are coalesced. W: a word of the item's size (unsigned short, unsigned int or unsigned long long), the same
// bits for every dtype; TILE, ROWS: the tile's side and the thread rows that walk it. At least four blocks an SM:
// without a bound ptxas aims at full occupancy and spills the index arithmetic.
extern "C" __global__ void __launch_bounds__(TILE * ROWS, 4) transpose_copy(
    const W* __restrict__ src, W* __restrict__ dst, unsigned int outer, long long na, long long nb, long long sb,
    long long da, unsigned int n1, unsigned int n2, unsigned int n3, long long s0, long long s1, long long s2,
    long long s3, long long d0, long long d1, long long d2, long long d3) {
  // axis a: element stride 1 in src (a tile's rows are read along it); axis b: the last (dst's rows, written along
  // it); blockIdx.y, .x: the tile of (a, b); blockIdx.z (and on): the outer index, unravelled by the outer sizes
  // (n0, the first, need not be known) into src and dst element offsets by their strides (s, d; 0 for missing axes)
  __shared__ W tile[TILE][TILE + 1];
  const long long a0 = (long long)blockIdx.y * TILE, b0 = (long long)blockIdx.x * TILE;
  for (unsigned int q = blockIdx.z; q < outer; q += gridDim.z) {
    unsigned int r = q, c;
    long long so = 0, dof = 0;
    c = r % n3; r /= n3; so += c * s3; dof += c * d3;
    c = r % n2; r /= n2; so += c * s2; dof += c * d2;
    c = r % n1; r /= n1; so += c * s1; dof += c * d1;
    so += r * s0; dof += r * d0;
    for (int j = threadIdx.y; j < TILE; j += ROWS) {
      const long long a = a0 + threadIdx.x, b = b0 + j;
      if (a < na && b < nb) tile[j][threadIdx.x] = src[so + a + b * sb];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TILE; j += ROWS) {
      const long long b = b0 + threadIdx.x, a = a0 + j;
      if (a < na && b < nb) dst[dof + a * da + b] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}
