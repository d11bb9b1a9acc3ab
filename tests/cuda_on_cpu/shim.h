// Just enough of CUDA to run a kernel source on the CPU, for tests without a GPU (tests/test_flash_attention_cpu_run.py):
// a std::thread per CUDA thread, std::barrier for __syncthreads and for each warp's shuffles, one block at a time
// (shared memory is one static array, filled with NaN bits before each block so that a read of an unwritten element
// shows). Floating point is the host's: FMAs are fused where the source calls fmaf, expf and logf are the C library's.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx;
dim3 blockIdx, gridDim, blockDim;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
using std::max;
using std::min;
inline float __int_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
alignas(16) float4 shared4[232448 / 16];   // the most an sm_90 block can have
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float warp_slots[32][32];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_slots[w][lane] = v;
    warp_barriers[w]->arrive_and_wait();
    const float r = warp_slots[w][lane ^ o];
    warp_barriers[w]->arrive_and_wait();
    return r;
}
// Runs kernel k over the grid, its arguments given as cuLaunchKernel's are: an array of pointers to each value.
template <typename... P, size_t... I>
void call_with(void (*k)(P...), void** a, std::index_sequence<I...>) { k(*reinterpret_cast<P*>(a[I])...); }
template <typename... P>
void run(void (*k)(P...), int gx, int gy, int gz, int threads, void** a) {
    gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
    blockDim = {(unsigned)threads, 1, 1};
    for (int z = 0; z < gz; z++)
        for (int y = 0; y < gy; y++)
            for (int x = 0; x < gx; x++) {
                blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
                std::memset(shared4, 0xff, sizeof(shared4));
                std::barrier<> bar(threads);
                block_barrier = &bar;
                warp_barriers.clear();
                for (int w = 0; w < threads / 32; w++) warp_barriers.emplace_back(new std::barrier<>(32));
                std::vector<std::thread> ts;
                for (int t = 0; t < threads; t++)
                    ts.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; call_with(k, a, std::index_sequence_for<P...>{}); });
                for (auto& t : ts) t.join();
            }
}
