// Opaque CPU kernels for reprules' tests and benchmarks: XLA cannot see
// through a custom call, so collectives around it are never constant-folded.
// Built at first use against JAX's bundled FFI headers (jax.ffi.include_dir()).
#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::ResultBuffer<ffi::F32>;

// out = x
static ffi::Error CopyImpl(F32Buffer x, F32Result out) {
  const float* src = x.typed_data();
  float* dst = out->typed_data();
  for (size_t i = 0, n = x.element_count(); i < n; ++i) dst[i] = src[i];
  return ffi::Error::Success();
}

// out[i] = x[i] * w[i % len(w)]: a row vector w broadcast over the rows of x.
static ffi::Error MulImpl(F32Buffer x, F32Buffer w, F32Result out) {
  const size_t n = x.element_count(), m = w.element_count();
  if (m == 0 || n % m != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "reprules_mul: len(w) must divide the size of x");
  }
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* dst = out->typed_data();
  for (size_t i = 0; i < n; ++i) dst[i] = xs[i] * ws[i % m];
  return ffi::Error::Success();
}

// out[j] = sum_i a[i, j] * b[i, j] over the rows of two same-shaped arrays
// whose row length is the size of out (the gradient of the broadcast weight).
static ffi::Error MulRowSumImpl(F32Buffer a, F32Buffer b, F32Result out) {
  const size_t n = a.element_count(), m = out->element_count();
  if (b.element_count() != n || m == 0 || n % m != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "reprules_mul_rowsum: shapes do not match");
  }
  const float* as = a.typed_data();
  const float* bs = b.typed_data();
  float* dst = out->typed_data();
  for (size_t j = 0; j < m; ++j) dst[j] = 0.0f;
  for (size_t i = 0; i < n; ++i) dst[i % m] += as[i] * bs[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ReprulesCopy, CopyImpl,
                              ffi::Ffi::Bind().Arg<F32Buffer>().Ret<F32Buffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReprulesMul, MulImpl,
                              ffi::Ffi::Bind().Arg<F32Buffer>().Arg<F32Buffer>().Ret<F32Buffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReprulesMulRowSum, MulRowSumImpl,
                              ffi::Ffi::Bind().Arg<F32Buffer>().Arg<F32Buffer>().Ret<F32Buffer>());
