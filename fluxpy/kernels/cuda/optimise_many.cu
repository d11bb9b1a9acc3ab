// One optimiser step for every parameter of a list in one launch (PyTorch's multi_tensor_apply), for any rule:
// fluxpy.kernels.cuda_optimise translates the rule's formula into three defines,
//   FX_PROLOGUE  the step's numbers in double (hyperparameters from fx_h, counters from fx_c, scalars),
//   FX_ELEMENT   one element's values: x and dx loaded from T into C, references to the state arrays (C), the
//                inputs (C, one element per tensor),
//   FX_BODY      the formula's statements in C, x = x - step, and x stored back as a T,
// and passes FX_SLOTS (x, dx, the state arrays, the inputs), FX_NUMBERS, CAP, ITEMS and FX_DTYPE (halfs.cuh: T the
// parameter's storage, C its compute type; a half parameter's state is float32).
//
// The table of pointers travels BY VALUE as a kernel parameter: no device-side table, no host-to-device copy.
// Each block takes chunks of blockDim.x * ITEMS elements of the tensors laid end to end; it finds the tensor
// holding a chunk's first element by a binary search over the start offsets, and each thread then walks forward
// through the tensors as its index grows (skipping empty ones).
#include "halfs.cuh"
#include "optimise.cuh"

struct Tensors {   // FX_SLOTS pointers per tensor, then where each tensor begins in the concatenated index space
  long long p[FX_SLOTS * CAP];
  long long start[CAP + 1];
};
struct Numbers {
  double v[FX_NUMBERS > 0 ? FX_NUMBERS : 1];
};

extern "C" __global__ void fx_step_many(const Tensors fx_t, const int fx_count, const Numbers fx_h,
                                        const double* fx_c, const double* fx_ok) {
  if (fx_ok != nullptr && !isfinite(*fx_ok)) return;   // a guarded step whose loss or gradients are not finite
  FX_PROLOGUE
  const long long fx_total = fx_t.start[fx_count];
  const long long fx_chunk = (long long)blockDim.x * ITEMS;
  for (long long fx_first = (long long)blockIdx.x * fx_chunk; fx_first < fx_total;
       fx_first += (long long)gridDim.x * fx_chunk) {
    int fx_lo = 0, fx_hi = fx_count - 1;   // the last tensor k with start[k] <= first: the (non-empty) one holding it
    while (fx_lo < fx_hi) {
      const int fx_mid = (fx_lo + fx_hi + 1) >> 1;
      if (fx_t.start[fx_mid] <= fx_first) fx_lo = fx_mid; else fx_hi = fx_mid - 1;
    }
    int fx_k = fx_lo;
    long long fx_begin = fx_t.start[fx_k], fx_end = fx_t.start[fx_k + 1];
    long long fx_p[FX_SLOTS];   // the addresses of tensor k's x, dx, state arrays and inputs
    for (int fx_s = 0; fx_s < FX_SLOTS; ++fx_s) fx_p[fx_s] = fx_t.p[fx_s * CAP + fx_k];
    const long long fx_last = fx_first + fx_chunk < fx_total ? fx_first + fx_chunk : fx_total;
    for (long long fx_e = fx_first + threadIdx.x; fx_e < fx_last; fx_e += blockDim.x) {
      if (fx_e >= fx_end) {
        do { ++fx_k; fx_begin = fx_end; fx_end = fx_t.start[fx_k + 1]; } while (fx_e >= fx_end);
        for (int fx_s = 0; fx_s < FX_SLOTS; ++fx_s) fx_p[fx_s] = fx_t.p[fx_s * CAP + fx_k];
      }
      const long long j = fx_e - fx_begin;
      FX_ELEMENT
      FX_BODY
    }
  }
}
