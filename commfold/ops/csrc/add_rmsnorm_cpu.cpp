// commfold's one-pass CPU kernel for residual-add + RMSNorm, and the C++ kernel of
// commfold::allreduce_rmsnorm (c10d groups, vLLM CPU's shared-memory all-reduce).
// Built and loaded by add_rmsnorm_cpu.py (see its docstring for the math).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <cstring>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <type_traits>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax() { asm volatile("yield"); }
#else
static inline void cpu_relax() {}
#endif

// How the kernel loads and stores a dtype. bf16 on its bits: c10's round-to-nearest-
// even and quiet NaN, branch-free so the row loops vectorize (c10's conversion
// branches on NaN). fp16: c10's scalar conversion, for rows without F16C (half_row).
template <typename T> struct Conv {
  using S = T;
  static float load(S v) { return static_cast<float>(v); }
  static S store(float v) { return static_cast<S>(v); }
};
template <> struct Conv<c10::BFloat16> {
  using S = uint16_t;
  static float load(S v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static S store(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<S>(v != v ? 0x7FC0u : rounded);
  }
};
template <> struct Conv<c10::Half> {  // c10's conversion, on the bits
  using S = uint16_t;
  static float load(S v) { return c10::detail::fp16_ieee_to_fp32_value(v); }
  static S store(float v) { return c10::detail::fp16_ieee_from_fp32_value(v); }
};
// v rounded to R and back (R = float: v)
template <typename R> static inline float round_to(float v) {
  return Conv<R>::load(Conv<R>::store(v));
}
// The op's flag bits (commfold/ops/norm_flags.py, their one definition), passed in
// by the loader as -D defines.
constexpr int64_t kOffsetInWeightDtype = COMMFOLD_OFFSET_IN_WEIGHT_DTYPE;
constexpr int64_t kRoundBeforeWeight = COMMFOLD_ROUND_BEFORE_WEIGHT;
constexpr int64_t kRoundSum = COMMFOLD_ROUND_SUM;
constexpr int64_t kOutF32 = COMMFOLD_OUT_F32;
constexpr int64_t kScaleDivides = COMMFOLD_SCALE_DIVIDES;
constexpr int64_t kRoundScaled = COMMFOLD_ROUND_SCALED;
constexpr int64_t kTwoShotShift = COMMFOLD_TWO_SHOT_SHIFT;

// The scale on x before the residual add (a scaled residual branch): m = x * c or
// x / c in f32, c rounded to f32 (Inductor's static_cast<float>(c)), m rounded to T
// when `round`. `on` is false for the identity (x * 1, x / 1 are exact).
struct ScaleArg {
  float c = 1.f;
  bool divides = false, round = false;
  bool on() const { return divides || c != 1.f; }
};

// kInPlace: h is x (same rows). Spelled as one pointer so the compiler sees a read and
// a write of the same element and vectorizes; as two equal pointers its run-time alias
// check fails and the scalar loop runs (measured 2x slower at T=16, H=4096).
#if defined(__F16C__) && defined(__AVX__)
// fp16 rows with F16C's 8-wide conversions: c10's are scalar and GCC 12 does not
// vectorize _Float16 ones (the generic loops ran fp16 ~3x slower than Inductor's
// kernel). Same math and rounding as the generic loops below.
static inline __m256 load_h8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m128i to_h8(__m256 v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }

template <typename O, typename R>
static void half_row(const uint16_t* xr, const uint16_t* rr, uint16_t* hr,
                     typename Conv<O>::S* orow, float* s32, const float* w, int64_t H,
                     float inv_h, float eps, bool round_h) {
  using C = Conv<c10::Half>;
  __m256 acc = _mm256_setzero_ps();
  float s = 0.f;
  int64_t j = 0;
  if (rr) {
    for (; j + 8 <= H; j += 8) {
      __m256 v = _mm256_add_ps(load_h8(xr + j), load_h8(rr + j));
      const __m128i rounded = to_h8(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hr + j), rounded);
      if (round_h) v = _mm256_cvtph_ps(rounded);
      _mm256_storeu_ps(s32 + j, v);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    for (; j < H; ++j) {
      float v = C::load(xr[j]) + C::load(rr[j]);
      hr[j] = C::store(v);
      if (round_h) v = C::load(hr[j]);
      s32[j] = v;
      s += v * v;
    }
  } else {
    for (; j + 8 <= H; j += 8) {
      const __m256 v = load_h8(xr + j);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    for (; j < H; ++j) { const float v = C::load(xr[j]); s += v * v; }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float l : lanes) s += l;
  const float r = 1.0f / std::sqrt(s * inv_h + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t k = 0;
  for (; k + 8 <= H; k += 8) {
    __m256 y = _mm256_mul_ps(rr ? _mm256_loadu_ps(s32 + k) : load_h8(xr + k), rv);
    if (w) {
      if constexpr (std::is_same<R, c10::Half>::value) y = _mm256_cvtph_ps(to_h8(y));
      y = _mm256_mul_ps(y, _mm256_loadu_ps(w + k));
    }
    if constexpr (std::is_same<O, float>::value) _mm256_storeu_ps(orow + k, y);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(orow + k), to_h8(y));
  }
  for (; k < H; ++k) {
    const float y = (rr ? s32[k] : C::load(xr[k])) * r;
    orow[k] = Conv<O>::store(w ? round_to<R>(y) * w[k] : y);
  }
}
#endif

template <typename T, typename O, typename R, bool kInPlace>
static void add_rmsnorm_impl(const typename Conv<T>::S* x, int64_t sx,
                             const typename Conv<T>::S* res, int64_t sr,
                             typename Conv<T>::S* h, int64_t sh, typename Conv<O>::S* out,
                             int64_t so, const float* w, int64_t N, int64_t H, float eps,
                             bool round_h, ScaleArg sc) {
  using TS = typename Conv<T>::S;
  using OS = typename Conv<O>::S;
  constexpr bool kF32 = std::is_same<T, float>::value;  // h is the f32 sum itself
  const float inv_h = 1.0f / static_cast<float>(H);
  const bool scaled = sc.on();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    // the unrounded f32 sum of a row (with a scale: first the scaled row)
    std::vector<float> scratch((res && !kF32) || scaled ? H : 0);
    float* s32 = scratch.data();
    for (int64_t i = begin; i < end; ++i) {
      TS* hr = h + i * sh;
      const TS* xr = kInPlace ? hr : x + i * sx;
      const TS* rr = res ? res + i * sr : nullptr;
      OS* orow = out + i * so;
#if defined(__F16C__) && defined(__AVX__)
      if constexpr (std::is_same<T, c10::Half>::value) {
        if (!scaled) {
          half_row<O, R>(xr, rr, hr, orow, s32, w, H, inv_h, eps, round_h);
          continue;
        }
      }
#endif
      // Sweep 1: the sum, its rounded store and the sum of squares. An OpenMP simd
      // reduction (vector-wide partial sums: vectorizes without -ffast-math); round_h
      // a compile-time constant (as a run-time select it kept the loop scalar).
      auto add_sumsq = [&](auto round) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < H; ++j) {
          float v = Conv<T>::load(xr[j]) + Conv<T>::load(rr[j]);
          hr[j] = Conv<T>::store(v);  // no named temporary: omp simd would keep it in
          if constexpr (!kF32) {      // memory per lane, and the loop scalar
            if constexpr (decltype(round)::value) v = round_to<T>(v);
            s32[j] = v;
          }
          s += v * v;
        }
        return s;
      };
      // The scaled forms: sweep 0 puts m = x * c (x / c) into s32, sweep 1 adds the
      // residual (if any) to it, writes h and takes the sum of squares.
      auto scale_row = [&](auto divides, auto round) {
        const float c = sc.c;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) {
          const float v = Conv<T>::load(xr[j]);
          float m = decltype(divides)::value ? v / c : v * c;
          if constexpr (!kF32 && decltype(round)::value) m = round_to<T>(m);
          s32[j] = m;
        }
      };
      auto scaled_sumsq = [&](auto round, auto with_res) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < H; ++j) {
          float v = s32[j];
          if constexpr (decltype(with_res)::value) v = v + Conv<T>::load(rr[j]);
          hr[j] = Conv<T>::store(v);
          if constexpr (!kF32 && decltype(round)::value) v = round_to<T>(v);
          s32[j] = v;
          s += v * v;
        }
        return s;
      };
      float s = 0.f;
      if (scaled) {
        using Yes = std::true_type;
        using No = std::false_type;
        if (sc.divides) sc.round ? scale_row(Yes{}, Yes{}) : scale_row(Yes{}, No{});
        else sc.round ? scale_row(No{}, Yes{}) : scale_row(No{}, No{});
        if (rr) s = round_h ? scaled_sumsq(Yes{}, Yes{}) : scaled_sumsq(No{}, Yes{});
        else s = round_h ? scaled_sumsq(Yes{}, No{}) : scaled_sumsq(No{}, No{});
      } else if (rr) {
        s = round_h ? add_sumsq(std::true_type{}) : add_sumsq(std::false_type{});
      } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < H; ++j) { const float v = Conv<T>::load(xr[j]); s += v * v; }
      }
      // Sweep 2: y = round_O(round_R(s * r) * w), from the f32 row (in cache).
      const float r = 1.0f / std::sqrt(s * inv_h + eps);
      if ((rr && !kF32) || scaled) {
        if (w) {
#pragma omp simd
          for (int64_t k = 0; k < H; ++k)
            orow[k] = Conv<O>::store(round_to<R>(s32[k] * r) * w[k]);
        } else {
#pragma omp simd
          for (int64_t k = 0; k < H; ++k) orow[k] = Conv<O>::store(s32[k] * r);
        }
      } else {
        const TS* src = rr ? hr : xr;  // f32: h holds the exact sum
        if (w) {
#pragma omp simd
          for (int64_t k = 0; k < H; ++k)
            orow[k] = Conv<O>::store(round_to<R>(Conv<T>::load(src[k]) * r) * w[k]);
        } else {
#pragma omp simd
          for (int64_t k = 0; k < H; ++k) orow[k] = Conv<O>::store(Conv<T>::load(src[k]) * r);
        }
      }
    }
  });
}

template <typename T, typename O, typename R>
static void call(const at::Tensor& x, const c10::optional<at::Tensor>& res, at::Tensor& h,
                 at::Tensor& out, const c10::optional<at::Tensor>& w, double eps, bool round_h,
                 ScaleArg sc) {
  const bool in_place = x.data_ptr() == h.data_ptr() && x.stride(0) == h.stride(0);
  auto impl = in_place ? add_rmsnorm_impl<T, O, R, true> : add_rmsnorm_impl<T, O, R, false>;
  using TS = typename Conv<T>::S;
  using OS = typename Conv<O>::S;
  impl(reinterpret_cast<const TS*>(x.data_ptr<T>()), x.stride(0),
       res ? reinterpret_cast<const TS*>(res->data_ptr<T>()) : nullptr,
       res ? res->stride(0) : 0, reinterpret_cast<TS*>(h.data_ptr<T>()), h.stride(0),
       reinterpret_cast<OS*>(out.data_ptr<O>()), out.stride(0),
       w ? w->data_ptr<float>() : nullptr, x.size(0), x.size(1), static_cast<float>(eps),
       round_h, sc);
}

template <typename T>
static void dispatch_out(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                         at::Tensor& h, at::Tensor& out, const c10::optional<at::Tensor>& w,
                         double eps, bool round_before_weight, bool round_h, ScaleArg sc) {
  if (out.scalar_type() == at::kFloat) {
    if (round_before_weight) call<T, float, T>(x, res, h, out, w, eps, round_h, sc);
    else call<T, float, float>(x, res, h, out, w, eps, round_h, sc);
  } else {
    TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out dtype must be f32 or x's dtype");
    if (round_before_weight) call<T, T, T>(x, res, h, out, w, eps, round_h, sc);
    else call<T, T, float>(x, res, h, out, w, eps, round_h, sc);
  }
}

// x, res, h, out: [N, H] with unit stride in the last dim; w: [H] f32 contiguous.
// h may be x itself (in place); with no residual and no scale h is not written.
// scale, divides, round_scaled: the scale on x before the add (see ScaleArg).
void add_rmsnorm(at::Tensor x, c10::optional<at::Tensor> res, at::Tensor h, at::Tensor out,
                 c10::optional<at::Tensor> w, double eps, bool round_before_weight,
                 bool round_h, double scale, bool divides, bool round_scaled) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && h.stride(1) == 1);
  if (res) TORCH_CHECK(res->stride(1) == 1 && res->scalar_type() == x.scalar_type());
  if (w) TORCH_CHECK(w->is_contiguous() && w->scalar_type() == at::kFloat);
  ScaleArg sc;
  sc.c = static_cast<float>(scale);
  sc.divides = divides;
  sc.round = round_scaled;
  switch (x.scalar_type()) {
    case at::kFloat: call<float, float, float>(x, res, h, out, w, eps, false, sc); break;
    case at::kBFloat16: dispatch_out<c10::BFloat16>(x, res, h, out, w, eps, round_before_weight, round_h, sc); break;
    case at::kHalf: dispatch_out<c10::Half>(x, res, h, out, w, eps, round_before_weight, round_h, sc); break;
    default: TORCH_CHECK(false, "add_rmsnorm: unsupported dtype ", x.scalar_type());
  }
}

// The weight as the graph multiplies it, in f32: w + offset, rounded to w's dtype when
// the graph adds the offset there (Gemma's 1 + w in bf16), as torch computes it.
template <typename W>
static void weight_f32(const at::Tensor& weight, float* dst, int64_t H, double offset,
                       bool in_w) {
  const auto* w = reinterpret_cast<const typename Conv<W>::S*>(weight.data_ptr<W>());
  const float off = static_cast<float>(offset);
  for (int64_t k = 0; k < H; ++k) {
    const float v = Conv<W>::load(w[k]) + off;
    dst[k] = in_w ? round_to<W>(v) : v;
  }
}

// commfold::allreduce_rmsnorm on CPU for c10d groups and vLLM CPU's shared-memory
// communicator, one-shot: the whole op in C++ (the all-reduce in place on x, then the
// kernel above, h written over x), so a call costs no more Python than the unfused
// program's. Anything else (vLLM's custom-op communicators, the two-shot variant) goes
// to the Python implementation, allreduce_rmsnorm_eager.
// flags: commfold.ops.norm_flags.pack_flags (the k* constants above).
using ArgsT = at::Tensor(at::Tensor&, const std::optional<at::Tensor>&,
                         const std::optional<at::Tensor>&, double, double, int64_t,
                         c10::string_view);

constexpr int kPollUs = 15;  // see the wait below

using ScaledArgsT = at::Tensor(at::Tensor&, const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, double, double, int64_t,
                               c10::string_view, double);

// scale: the scaled overload's scale, or nullopt (the plain overload)
static at::Tensor run_allreduce_rmsnorm(
    at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, double offset, int64_t flags,
    c10::string_view comm, std::optional<double> scale) {
  // vLLM CPU's shared-memory all-reduce (in place, synchronous), when vLLM's _C is loaded
  static std::optional<c10::OperatorHandle> shm_op;
  const bool is_shm = comm.substr(0, 9) == "vllm_shm:";
  if (is_shm && !shm_op) shm_op = c10::Dispatcher::singleton().findSchema({"_C::shm_allreduce", ""});
  const bool shm = is_shm && shm_op.has_value();
  const bool fast = (comm.substr(0, 5) == "c10d:" || shm) && (flags >> kTwoShotShift) == 0 &&
      x.numel() > 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                        x.scalar_type() == at::kHalf);
  if (!fast) {
    if (scale) {
      static auto eager_scaled = c10::Dispatcher::singleton()
          .findSchemaOrThrow("commfold::allreduce_rmsnorm_eager", "scaled")
          .typed<ScaledArgsT>();
      return eager_scaled.call(x, residual, weight, eps, offset, flags, comm, *scale);
    }
    static auto eager = c10::Dispatcher::singleton()
        .findSchemaOrThrow("commfold::allreduce_rmsnorm_eager", "").typed<ArgsT>();
    return eager.call(x, residual, weight, eps, offset, flags, comm);
  }
  // Per-call cost matters here (a small all-reduce is ~6 us on vLLM's shared memory
  // and the fusion must not lose to the unfused program): no ATen op that is not
  // needed for the common case (contiguous x, f32 weight without offset).
  // Inference only (no autograd formula): the ATen and collective calls below skip
  // the autograd and view-tracking dispatch layers (with the 2-D x used as is: the
  // op's CPU time per call at T=1 on one rank measured 53 -> 25 us).
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  const int64_t H = x.size(-1);
  const int64_t N = x.numel() / H;
  // h: x's own rows (Inductor hands a dead input over, or a copy of a live one); a
  // strided x is reduced in a contiguous copy and written back at the end.
  const bool contiguous = x.is_contiguous();
  at::Tensor h = !contiguous ? x.reshape({N, H}).contiguous() : x.dim() == 2 ? x : x.view({N, H});
  // torch.ops calls from Python arrive without the GIL; a caller that holds it (C++
  // embedding Python) gets it released for the collective, as torch's bindings do.
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  c10::intrusive_ptr<c10d::Work> work;
  if (shm) {
    static auto shm_allreduce = shm_op->typed<void(int64_t, at::Tensor&)>();
    shm_allreduce.call(std::stoll(std::string(comm.substr(9))), h);
  } else {
    std::vector<at::Tensor> rows{h};
    work = c10d::resolve_process_group(std::string(comm.substr(5)))->allreduce(rows);
  }
  // The rest of the set-up runs while gloo reduces; the wait after it polls first.
  std::optional<at::Tensor> res;
  if (residual) {
    const at::Tensor& r = residual->dim() == 2 ? *residual : residual->reshape({-1, H});
    res = r.stride(1) == 1 ? r : r.contiguous();
  }
  std::optional<at::Tensor> wf;
  if (weight) {
    const at::Tensor& w = *weight;
    if (offset == 0.0 && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous()) {
      wf = w;
    } else if (w.is_contiguous() && w.numel() == H &&
               (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 ||
                w.scalar_type() == at::kHalf)) {
      // a bf16/fp16 weight, or an offset: its f32 row in a reused buffer (an ATen
      // conversion per call measured ~7 us at T=1 against a 6 us shm all-reduce)
      static thread_local std::vector<float> wbuf;
      wbuf.resize(H);
      const bool in_w = flags & kOffsetInWeightDtype;
      if (w.scalar_type() == at::kFloat) weight_f32<float>(w, wbuf.data(), H, offset, in_w);
      else if (w.scalar_type() == at::kBFloat16) weight_f32<c10::BFloat16>(w, wbuf.data(), H, offset, in_w);
      else weight_f32<c10::Half>(w, wbuf.data(), H, offset, in_w);
      wf = at::from_blob(wbuf.data(), {H}, at::TensorOptions().dtype(at::kFloat));
    } else {
      at::Tensor v = offset == 0.0 ? w
          : (flags & kOffsetInWeightDtype) ? (w + offset) : (w.to(at::kFloat) + offset);
      wf = v.to(at::kFloat).reshape({-1}).contiguous();
    }
  }
  const auto out_dtype = (flags & kOutF32) ? at::kFloat : x.scalar_type();
  at::Tensor out = at::detail::empty_cpu({N, H}, out_dtype, false, std::nullopt);
  if (work) {
    // Poll before blocking: a thread that sleeps on the work at once pays a wake-up
    // the unfused program does not (its Python wrapper runs ~10 us between issuing
    // and waiting). Measured at T=1, TP=2, gloo: blocking at once 0.84x-1.02x of the
    // unfused program, polling up to 15 us 1.02x-1.08x (40 us: no better).
    const auto start = std::chrono::steady_clock::now();
    while (!work->isCompleted() &&
           std::chrono::steady_clock::now() - start < std::chrono::microseconds(kPollUs))
      cpu_relax();
    work->wait();
  }
  no_gil.reset();
  add_rmsnorm(h, res, h, out, wf, eps, flags & kRoundBeforeWeight, flags & kRoundSum,
              scale.value_or(1.0), scale && (flags & kScaleDivides),
              scale && (flags & kRoundScaled));
  if (!contiguous) x.copy_(h.view(x.sizes()));
  return x.dim() == 2 ? out : out.view(x.sizes());
}

static at::Tensor allreduce_rmsnorm_cpu(
    at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, double offset, int64_t flags,
    c10::string_view comm) {
  return run_allreduce_rmsnorm(x, residual, weight, eps, offset, flags, comm, std::nullopt);
}

static at::Tensor allreduce_rmsnorm_scaled_cpu(
    at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, double offset, int64_t flags,
    c10::string_view comm, double scale) {
  return run_allreduce_rmsnorm(x, residual, weight, eps, offset, flags, comm, scale);
}

TORCH_LIBRARY_IMPL(commfold, CPU, m) {
  m.impl("allreduce_rmsnorm", &allreduce_rmsnorm_cpu);
  m.impl("allreduce_rmsnorm.scaled", &allreduce_rmsnorm_scaled_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rmsnorm", &add_rmsnorm, "residual add + RMSNorm over [N, H] rows, in one pass");
}
