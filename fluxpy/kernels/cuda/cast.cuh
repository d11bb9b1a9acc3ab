// The element types of a conversion (cast.cu, cast_many.cu): SRC_DTYPE and DST_DTYPE are halfs.cuh's codes (1
// float16, 2 bfloat16, 3 float32); ST and DT are their storage types, SLOAD(v) an ST as a float and DSTORE(v) a
// float rounded to a DT (to nearest even, a NaN staying a NaN).
#include "halfs.cuh"

#if SRC_DTYPE == 3
#define ST float
#define SLOAD(v) (v)
#elif SRC_DTYPE == 1
#define ST unsigned short
#define SLOAD(v) fx_load_f16(v)
#else
#define ST unsigned short
#define SLOAD(v) fx_load_bf16(v)
#endif

#if DST_DTYPE == 3
#define DT float
#define DSTORE(v) (v)
#elif DST_DTYPE == 1
#define DT unsigned short
#define DSTORE(v) fx_store_f16(v)
#else
#define DT unsigned short
#define DSTORE(v) fx_store_bf16(v)
#endif
