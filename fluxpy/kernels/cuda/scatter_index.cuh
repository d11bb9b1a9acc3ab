// The index walk shared by the scatter and gather kernels (fluxpy/kernels/cuda_scatter.py): fx_row(k, ...) is the
// linear destination row of entry k of the index arrays, or -1 where an index is outside its axis (then a checked
// call, call > 0, leaves its number in *bad). IDX_PARAMS / IDX_ARGS: the index arrays first, then their scalars (per
// array its axis size and element strides, then the index shape's trailing sizes and their magic numbers), as
// cuda_scatter._index_scalars / _along_scalars pass them.
//
// Defines (cuda_scatter._index_defines):
//   FX_SMALL    1: every count and index offset fits 32 bits (K_T, offsets and rows in 32 bits: 64-bit division and
//               multiplies are several times slower); 0: 64 bits.
//   FX_D        the number of index arrays (1 to 8); FX_I0 .. FX_I7 their element types.
//   FX_STRIDED  0: the arrays are C-contiguous (entry k at k); 1 to 8: the index arrays' number of axes, entry k found
//               through each array's element strides (broadcast views such as arange columns read in place).
//   FX_R0 .. FX_R7  with FX_STRIDED: the bitmask of the axes array j is read by (those of a stride other than 0: no
//               multiply for the others), or -1 for a C-contiguous array (entry k at k).
//   FX_ALONG    1: the along-axis form, one C-contiguous array whose entry k replaces k's own coordinate on the axis.
//   FX_UNROLL   rows a thread row takes at a time (FOR_ROW_GROUPS).

// The kernels' __launch_bounds__: a walk over more than two strided axes needs more registers than full occupancy
// leaves a thread, so its blocks ask for four an SM (without that bound ptxas would aim at full occupancy and spill).
#if FX_STRIDED > 2
#define FX_BOUNDS __launch_bounds__(256, 4)
#else
#define FX_BOUNDS __launch_bounds__(256)
#endif

#if FX_SMALL
#define K_T unsigned int
#define FX_W int
#else
#define K_T long long
#define FX_W long long
#endif

#if FX_D < 1 || FX_D > 8
#error "FX_D must be 1 to 8"
#endif
#if FX_STRIDED < 0 || FX_STRIDED > 8
#error "FX_STRIDED must be 0 to 8"
#endif

// per array j: its pointer parameter (FX_ARRj), its axis size and strides (FX_SCALj), and their names
#if FX_STRIDED == 0
#define FX_STRIDES(j)
#define FX_STRIDE_NAMES(j)
#elif FX_STRIDED == 1
#define FX_STRIDES(j) , FX_W s##j##_0
#define FX_STRIDE_NAMES(j) , s##j##_0
#elif FX_STRIDED == 2
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1
#elif FX_STRIDED == 3
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2
#elif FX_STRIDED == 4
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2 , FX_W s##j##_3
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2 , s##j##_3
#elif FX_STRIDED == 5
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2 , FX_W s##j##_3 , FX_W s##j##_4
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2 , s##j##_3 , s##j##_4
#elif FX_STRIDED == 6
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2 , FX_W s##j##_3 , FX_W s##j##_4 , FX_W s##j##_5
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2 , s##j##_3 , s##j##_4 , s##j##_5
#elif FX_STRIDED == 7
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2 , FX_W s##j##_3 , FX_W s##j##_4 , FX_W s##j##_5 , FX_W s##j##_6
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2 , s##j##_3 , s##j##_4 , s##j##_5 , s##j##_6
#elif FX_STRIDED == 8
#define FX_STRIDES(j) , FX_W s##j##_0 , FX_W s##j##_1 , FX_W s##j##_2 , FX_W s##j##_3 , FX_W s##j##_4 , FX_W s##j##_5 , FX_W s##j##_6 , FX_W s##j##_7
#define FX_STRIDE_NAMES(j) , s##j##_0 , s##j##_1 , s##j##_2 , s##j##_3 , s##j##_4 , s##j##_5 , s##j##_6 , s##j##_7
#endif
#define FX_ARR(j) const FX_I##j* __restrict__ i##j
#define FX_SCAL(j) , long long n##j FX_STRIDES(j)
#define FX_SCAL_NAMES(j) , n##j FX_STRIDE_NAMES(j)
#if FX_D > 1
#define FX_ARR1 , FX_ARR(1)
#define FX_ARR_NAME1 , i1
#define FX_SCAL1 FX_SCAL(1)
#define FX_SCAL_NAME1 FX_SCAL_NAMES(1)
#else
#define FX_ARR1
#define FX_ARR_NAME1
#define FX_SCAL1
#define FX_SCAL_NAME1
#endif
#if FX_D > 2
#define FX_ARR2 , FX_ARR(2)
#define FX_ARR_NAME2 , i2
#define FX_SCAL2 FX_SCAL(2)
#define FX_SCAL_NAME2 FX_SCAL_NAMES(2)
#else
#define FX_ARR2
#define FX_ARR_NAME2
#define FX_SCAL2
#define FX_SCAL_NAME2
#endif
#if FX_D > 3
#define FX_ARR3 , FX_ARR(3)
#define FX_ARR_NAME3 , i3
#define FX_SCAL3 FX_SCAL(3)
#define FX_SCAL_NAME3 FX_SCAL_NAMES(3)
#else
#define FX_ARR3
#define FX_ARR_NAME3
#define FX_SCAL3
#define FX_SCAL_NAME3
#endif
#if FX_D > 4
#define FX_ARR4 , FX_ARR(4)
#define FX_ARR_NAME4 , i4
#define FX_SCAL4 FX_SCAL(4)
#define FX_SCAL_NAME4 FX_SCAL_NAMES(4)
#else
#define FX_ARR4
#define FX_ARR_NAME4
#define FX_SCAL4
#define FX_SCAL_NAME4
#endif
#if FX_D > 5
#define FX_ARR5 , FX_ARR(5)
#define FX_ARR_NAME5 , i5
#define FX_SCAL5 FX_SCAL(5)
#define FX_SCAL_NAME5 FX_SCAL_NAMES(5)
#else
#define FX_ARR5
#define FX_ARR_NAME5
#define FX_SCAL5
#define FX_SCAL_NAME5
#endif
#if FX_D > 6
#define FX_ARR6 , FX_ARR(6)
#define FX_ARR_NAME6 , i6
#define FX_SCAL6 FX_SCAL(6)
#define FX_SCAL_NAME6 FX_SCAL_NAMES(6)
#else
#define FX_ARR6
#define FX_ARR_NAME6
#define FX_SCAL6
#define FX_SCAL_NAME6
#endif
#if FX_D > 7
#define FX_ARR7 , FX_ARR(7)
#define FX_ARR_NAME7 , i7
#define FX_SCAL7 FX_SCAL(7)
#define FX_SCAL_NAME7 FX_SCAL_NAMES(7)
#else
#define FX_ARR7
#define FX_ARR_NAME7
#define FX_SCAL7
#define FX_SCAL_NAME7
#endif
// the trailing sizes of the index shape (axes 1 .. FX_STRIDED - 1) and, in 32 bits, their magic numbers
#if FX_SMALL
#define FX_M(a) , K_T m##a, unsigned int mg##a, unsigned int sh##a
#define FX_M_NAMES(a) , m##a, mg##a, sh##a
#else
#define FX_M(a) , K_T m##a
#define FX_M_NAMES(a) , m##a
#endif
#if FX_STRIDED > 1
#define FX_M1 FX_M(1)
#define FX_M_NAME1 FX_M_NAMES(1)
#else
#define FX_M1
#define FX_M_NAME1
#endif
#if FX_STRIDED > 2
#define FX_M2 FX_M(2)
#define FX_M_NAME2 FX_M_NAMES(2)
#else
#define FX_M2
#define FX_M_NAME2
#endif
#if FX_STRIDED > 3
#define FX_M3 FX_M(3)
#define FX_M_NAME3 FX_M_NAMES(3)
#else
#define FX_M3
#define FX_M_NAME3
#endif
#if FX_STRIDED > 4
#define FX_M4 FX_M(4)
#define FX_M_NAME4 FX_M_NAMES(4)
#else
#define FX_M4
#define FX_M_NAME4
#endif
#if FX_STRIDED > 5
#define FX_M5 FX_M(5)
#define FX_M_NAME5 FX_M_NAMES(5)
#else
#define FX_M5
#define FX_M_NAME5
#endif
#if FX_STRIDED > 6
#define FX_M6 FX_M(6)
#define FX_M_NAME6 FX_M_NAMES(6)
#else
#define FX_M6
#define FX_M_NAME6
#endif
#if FX_STRIDED > 7
#define FX_M7 FX_M(7)
#define FX_M_NAME7 FX_M_NAMES(7)
#else
#define FX_M7
#define FX_M_NAME7
#endif

#if FX_ALONG
// one array i0, the destination's (or source's) axis length n0, the size of the axes after the axis (inner) and the
// index array's length on it (na), with their magic numbers in 32 bits
#if FX_SMALL
#define IDX_PARAMS FX_ARR(0), long long n0, K_T inner, unsigned int mgi, unsigned int shi, K_T na, unsigned int mga, \
                   unsigned int sha
#define IDX_ARGS i0, n0, inner, mgi, shi, na, mga, sha
#else
#define IDX_PARAMS FX_ARR(0), long long n0, K_T inner, K_T na
#define IDX_ARGS i0, n0, inner, na
#endif
#else
#define IDX_PARAMS FX_ARR(0) FX_ARR1 FX_ARR2 FX_ARR3 FX_ARR4 FX_ARR5 FX_ARR6 FX_ARR7 FX_SCAL(0) FX_SCAL1 FX_SCAL2 FX_SCAL3 FX_SCAL4 FX_SCAL5 FX_SCAL6 FX_SCAL7 FX_M1 FX_M2 FX_M3 FX_M4 FX_M5 FX_M6 FX_M7
#define IDX_ARGS i0 FX_ARR_NAME1 FX_ARR_NAME2 FX_ARR_NAME3 FX_ARR_NAME4 FX_ARR_NAME5 FX_ARR_NAME6 FX_ARR_NAME7 FX_SCAL_NAMES(0) FX_SCAL_NAME1 FX_SCAL_NAME2 FX_SCAL_NAME3 FX_SCAL_NAME4 FX_SCAL_NAME5 FX_SCAL_NAME6 FX_SCAL_NAME7 FX_M_NAME1 FX_M_NAME2 FX_M_NAME3 FX_M_NAME4 FX_M_NAME5 FX_M_NAME6 FX_M_NAME7
#endif

// the walk: FX_INITj sets array j's offset, FX_ADDj(a) adds axis a's coordinate c times its stride where j is read
// by a, FX_CHECKj reads its index, checks it and folds it into the row r
#define FX_INIT0 FX_W o0 = FX_R0 < 0 ? (FX_W)k : 0;
#define FX_ADD0(a) if (FX_R0 >= 0 && ((FX_R0 >> (a)) & 1)) o0 += (FX_W)c * s0_##a;
#define FX_CONTIGUOUS0 const K_T o0 = k;
#define FX_CHECK0 v = (long long)i0[o0]; if (v < 0 || v >= n0) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n0 + (FX_W)v;
#if FX_D > 1
#define FX_INIT1 FX_W o1 = FX_R1 < 0 ? (FX_W)k : 0;
#define FX_ADD1(a) if (FX_R1 >= 0 && ((FX_R1 >> (a)) & 1)) o1 += (FX_W)c * s1_##a;
#define FX_CONTIGUOUS1 const K_T o1 = k;
#define FX_CHECK1 v = (long long)i1[o1]; if (v < 0 || v >= n1) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n1 + (FX_W)v;
#else
#define FX_INIT1
#define FX_ADD1(a)
#define FX_CONTIGUOUS1
#define FX_CHECK1
#endif
#if FX_D > 2
#define FX_INIT2 FX_W o2 = FX_R2 < 0 ? (FX_W)k : 0;
#define FX_ADD2(a) if (FX_R2 >= 0 && ((FX_R2 >> (a)) & 1)) o2 += (FX_W)c * s2_##a;
#define FX_CONTIGUOUS2 const K_T o2 = k;
#define FX_CHECK2 v = (long long)i2[o2]; if (v < 0 || v >= n2) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n2 + (FX_W)v;
#else
#define FX_INIT2
#define FX_ADD2(a)
#define FX_CONTIGUOUS2
#define FX_CHECK2
#endif
#if FX_D > 3
#define FX_INIT3 FX_W o3 = FX_R3 < 0 ? (FX_W)k : 0;
#define FX_ADD3(a) if (FX_R3 >= 0 && ((FX_R3 >> (a)) & 1)) o3 += (FX_W)c * s3_##a;
#define FX_CONTIGUOUS3 const K_T o3 = k;
#define FX_CHECK3 v = (long long)i3[o3]; if (v < 0 || v >= n3) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n3 + (FX_W)v;
#else
#define FX_INIT3
#define FX_ADD3(a)
#define FX_CONTIGUOUS3
#define FX_CHECK3
#endif
#if FX_D > 4
#define FX_INIT4 FX_W o4 = FX_R4 < 0 ? (FX_W)k : 0;
#define FX_ADD4(a) if (FX_R4 >= 0 && ((FX_R4 >> (a)) & 1)) o4 += (FX_W)c * s4_##a;
#define FX_CONTIGUOUS4 const K_T o4 = k;
#define FX_CHECK4 v = (long long)i4[o4]; if (v < 0 || v >= n4) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n4 + (FX_W)v;
#else
#define FX_INIT4
#define FX_ADD4(a)
#define FX_CONTIGUOUS4
#define FX_CHECK4
#endif
#if FX_D > 5
#define FX_INIT5 FX_W o5 = FX_R5 < 0 ? (FX_W)k : 0;
#define FX_ADD5(a) if (FX_R5 >= 0 && ((FX_R5 >> (a)) & 1)) o5 += (FX_W)c * s5_##a;
#define FX_CONTIGUOUS5 const K_T o5 = k;
#define FX_CHECK5 v = (long long)i5[o5]; if (v < 0 || v >= n5) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n5 + (FX_W)v;
#else
#define FX_INIT5
#define FX_ADD5(a)
#define FX_CONTIGUOUS5
#define FX_CHECK5
#endif
#if FX_D > 6
#define FX_INIT6 FX_W o6 = FX_R6 < 0 ? (FX_W)k : 0;
#define FX_ADD6(a) if (FX_R6 >= 0 && ((FX_R6 >> (a)) & 1)) o6 += (FX_W)c * s6_##a;
#define FX_CONTIGUOUS6 const K_T o6 = k;
#define FX_CHECK6 v = (long long)i6[o6]; if (v < 0 || v >= n6) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n6 + (FX_W)v;
#else
#define FX_INIT6
#define FX_ADD6(a)
#define FX_CONTIGUOUS6
#define FX_CHECK6
#endif
#if FX_D > 7
#define FX_INIT7 FX_W o7 = FX_R7 < 0 ? (FX_W)k : 0;
#define FX_ADD7(a) if (FX_R7 >= 0 && ((FX_R7 >> (a)) & 1)) o7 += (FX_W)c * s7_##a;
#define FX_CONTIGUOUS7 const K_T o7 = k;
#define FX_CHECK7 v = (long long)i7[o7]; if (v < 0 || v >= n7) { fx_flag(bad, call); return -1; } \
  r = r * (FX_W)n7 + (FX_W)v;
#else
#define FX_INIT7
#define FX_ADD7(a)
#define FX_CONTIGUOUS7
#define FX_CHECK7
#endif
#define FX_ADD(a) FX_ADD0(a) FX_ADD1(a) FX_ADD2(a) FX_ADD3(a) FX_ADD4(a) FX_ADD5(a) FX_ADD6(a) FX_ADD7(a)
#if FX_SMALL   // q / m as a multiply-high and a shift (the divisor's magic number, made on the host)
#define FX_STEP(a) quot = (__umulhi(q, mg##a) + q) >> sh##a; c = q - quot * m##a; q = quot; FX_ADD(a)
#else
#define FX_STEP(a) c = q % m##a; q /= m##a; FX_ADD(a)
#endif

__device__ __forceinline__ void fx_flag(volatile int* bad, int call) {
  // a checked call (call > 0) leaves its number, unless an earlier call's is there (a stream runs its calls in
  // order, so the flag names the first checked call that met a bad index); an unchecked call (0) leaves nothing
  if (call && *bad == 0) *bad = call;
}

__device__ __forceinline__ long long fx_row(K_T k, IDX_PARAMS, volatile int* bad, int call) {
#if FX_ALONG
  // k = (outer * na + a) * inner + i goes to row (outer * n0 + idx[k]) * inner + i
#if FX_SMALL
  const K_T q = (__umulhi(k, mgi) + k) >> shi, i = k - q * inner;
  const K_T outer = (__umulhi(q, mga) + q) >> sha;
#else
  const K_T q = k / inner, i = k - q * inner, outer = q / na;
#endif
  const long long v = (long long)i0[k];
  if (v < 0 || v >= n0) { fx_flag(bad, call); return -1; }
  return ((FX_W)outer * (FX_W)n0 + (FX_W)v) * (FX_W)inner + (FX_W)i;
#else
#if FX_STRIDED
  K_T q = k, c, quot;
  (void)quot;
  FX_INIT0 FX_INIT1 FX_INIT2 FX_INIT3 FX_INIT4 FX_INIT5 FX_INIT6 FX_INIT7
#if FX_STRIDED > 7
  FX_STEP(7)
#endif
#if FX_STRIDED > 6
  FX_STEP(6)
#endif
#if FX_STRIDED > 5
  FX_STEP(5)
#endif
#if FX_STRIDED > 4
  FX_STEP(4)
#endif
#if FX_STRIDED > 3
  FX_STEP(3)
#endif
#if FX_STRIDED > 2
  FX_STEP(2)
#endif
#if FX_STRIDED > 1
  FX_STEP(1)
#endif
  c = q;
  FX_ADD(0)
#else
  FX_CONTIGUOUS0 FX_CONTIGUOUS1 FX_CONTIGUOUS2 FX_CONTIGUOUS3 FX_CONTIGUOUS4 FX_CONTIGUOUS5 FX_CONTIGUOUS6 FX_CONTIGUOUS7
#endif
  FX_W r = 0;
  long long v;
  FX_CHECK0 FX_CHECK1 FX_CHECK2 FX_CHECK3 FX_CHECK4 FX_CHECK5 FX_CHECK6 FX_CHECK7
  return r;
#endif
}

// Blocks of (columns x rows) threads: threadIdx.x runs along a row's F columns, threadIdx.y over rows, so a row's
// destination is computed once per thread row and no thread divides its element number by F.
#define FOR_ROWS(k, K) \
  for (K_T k = blockIdx.x * (K_T)blockDim.y + threadIdx.y; k < (K); k += (K_T)gridDim.x * blockDim.y)
#define FOR_COLUMNS(c, F) for (K_T c = threadIdx.x; c < (F); c += blockDim.x)
// a thread row takes FX_UNROLL rows at a time, k0, k0 + blockDim.y, ...: their index reads, then their source
// reads, are issued together (one row at a time keeps too few loads in flight to reach the memory's bandwidth)
#define FOR_ROW_GROUPS(k0, K) \
  for (K_T k0 = blockIdx.x * (K_T)blockDim.y * FX_UNROLL + threadIdx.y; k0 < (K); \
       k0 += (K_T)gridDim.x * blockDim.y * FX_UNROLL)
#define GROUP_ROWS(r, k0, K) \
  long long r[FX_UNROLL]; \
  _Pragma("unroll") for (int j = 0; j < FX_UNROLL; ++j) { \
    const K_T k = k0 + j * blockDim.y; \
    r[j] = k < (K) ? fx_row(k, IDX_ARGS, bad, call) : -2;  /* -1: a bad index; -2: past the last row */ \
  }
