// The element types and the combining op of the scatter kernels (fluxpy/kernels/cuda_scatter.py): storage T,
// compute C (what LOAD gives and STORE takes), COMBINE(acc, v) and EMPTY (the value of an entry no index hits).
//
// Defines (cuda_scatter._value_defines): FX_DTYPE (halfs.cuh: float16, bfloat16, float32 or float64, computed in
// float32 for the halves) or FX_INT (an integer type, computed in 64 bits: FX_UNSIGNED 1 for an unsigned one);
// FX_OP 1 add, 2 max, 3 min; FX_EMPTY (scatter_empty of the op and dtype, as an expression of type C).
#include "halfs.cuh"

#ifdef FX_INT
#define T FX_INT
#if FX_UNSIGNED
#define C unsigned long long
#else
#define C long long
#endif
#define LOAD(v) ((C)(v))
#define STORE(v) ((T)(v))
#endif

// a NaN wins a max or a min, as NumPy's; integers add modulo their width, without signed overflow
#if FX_OP == 1
#ifdef FX_INT
#define COMBINE(a, v) ((C)((unsigned long long)(a) + (unsigned long long)(v)))
#else
#define COMBINE(a, v) ((a) + (v))
#endif
#elif FX_OP == 2
#ifdef FX_INT
#define COMBINE(a, v) (((v) > (a)) ? (v) : (a))
#else
#define COMBINE(a, v) ((((v) != (v)) || ((v) > (a))) ? (v) : (a))
#endif
#elif FX_OP == 3
#ifdef FX_INT
#define COMBINE(a, v) (((v) < (a)) ? (v) : (a))
#else
#define COMBINE(a, v) ((((v) != (v)) || ((v) < (a))) ? (v) : (a))
#endif
#else
#error "FX_OP must be 1 (add), 2 (max) or 3 (min)"
#endif
#define EMPTY FX_EMPTY
