// The functions an optimiser formula may call (fluxpy.optimise.formula), with NumPy's semantics, so that the
// generated kernels round and propagate NaN as the rule's NumPy path does.

template <typename V> __device__ __forceinline__ V fx_sign(V v) {   // numpy.sign: 1, -1, +0 for either zero, NaN
  return v > (V)0 ? (V)1 : (v < (V)0 ? (V)-1 : (v == (V)0 ? (V)0 : v));
}
template <typename V> __device__ __forceinline__ V fx_max(V a, V b) {   // numpy.maximum
  return (a >= b || isnan(a)) ? a : b;
}
template <typename V> __device__ __forceinline__ V fx_min(V a, V b) {   // numpy.minimum
  return (a <= b || isnan(a)) ? a : b;
}
template <typename V> __device__ __forceinline__ V fx_clip(V x, V lo, V hi) {   // numpy.clip of floats
  const V low = isnan(x) ? x : (x > lo ? x : lo);
  return isnan(low) ? low : (low < hi ? low : hi);
}
template <typename V> __device__ __forceinline__ V fx_where(bool c, V a, V b) {   // numpy.where, per element
  return c ? a : b;
}
