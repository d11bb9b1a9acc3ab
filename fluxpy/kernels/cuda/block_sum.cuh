// The sum of v over the threads of a block (every thread gets it), in a fixed order: warp shuffles, then warp 0's
// lanes over the warps' sums. `shared` holds a value a warp; every thread of the block calls it (it has barriers).
// C: the compute type (halfs.cuh).
__device__ __forceinline__ C block_sum(C v, C* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();   // shared may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? shared[lane] : (C)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
