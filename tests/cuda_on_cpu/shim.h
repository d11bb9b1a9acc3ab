// Just enough of CUDA to run a kernel source on the CPU, for tests without a GPU (tests/test_*_cpu_run.py): a
// std::thread per CUDA thread, std::barrier for __syncthreads and for each warp's shuffles, one block at a time
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
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) double2 { double x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
using std::max;
using std::min;
inline float __int_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
// Stand-ins for halfs.cuh's float16 PTX conversions (tests/kernel_on_cpu.py puts them in its place): the host
// compiler's _Float16, IEEE, round to nearest even.
inline float fx_cpu_f16_to_f32(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
inline unsigned short fx_cpu_f32_to_f16(float f) {
    const _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
inline float __uint_as_float(unsigned x) { return __int_as_float(x); }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
alignas(16) float4 shared4[232448 / 16];   // the most an sm_90 block can have
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float warp_slots[32][32];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
// A thread's place in its block as CUDA counts warps: x fastest, then y, then z.
inline int linear_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const int w = linear_thread() / 32, lane = linear_thread() % 32;
    warp_slots[w][lane] = v;
    warp_barriers[w]->arrive_and_wait();
    const float r = warp_slots[w][lane ^ o];
    warp_barriers[w]->arrive_and_wait();
    return r;
}
// Runs kernel k over the grid, its arguments given as cuLaunchKernel's are: an array of pointers to each value.
template <typename... P, size_t... I>
void call_with(void (*k)(P...), void** a, std::index_sequence<I...>) { k(*reinterpret_cast<P*>(a[I])...); }
// Whether a launch's arguments, `sizes` (bytes of each of `n`), fit kernel k's parameters: as many, each as wide.
template <typename... P>
bool arguments_fit(void (*)(P...), const int* sizes, int n) {
    const int widths[] = {(int)sizeof(P)...};
    return n == (int)sizeof...(P) && std::equal(widths, widths + n, sizes);
}
// The blocks run one after another on the same threads (made once a launch), a barrier between blocks.
template <typename... P>
void run(void (*k)(P...), dim3 grid, dim3 block, void** a) {
    gridDim = grid;
    blockDim = block;
    const int threads = block.x * block.y * block.z;
    const long blocks = (long)grid.x * grid.y * grid.z;
    std::barrier<> bar(threads), between(threads);
    block_barrier = &bar;
    warp_barriers.clear();
    for (int w = 0; w * 32 < threads; w++)
        warp_barriers.emplace_back(new std::barrier<>(std::min(32, threads - w * 32)));
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; t++)
        ts.emplace_back([=, &between] {
            threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
            for (long b = 0; b < blocks; b++) {
                if (t == 0) {
                    blockIdx = {(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                                (unsigned)(b / ((long)grid.x * grid.y))};
                    std::memset(shared4, 0xff, sizeof(shared4));
                }
                between.arrive_and_wait();
                call_with(k, a, std::index_sequence_for<P...>{});
                between.arrive_and_wait();
            }
        });
    for (auto& t : ts) t.join();
}
template <typename... P>
void run(void (*k)(P...), int gx, int gy, int gz, int threads, void** a) {
    run(k, dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz}, dim3{(unsigned)threads, 1, 1}, a);
}
