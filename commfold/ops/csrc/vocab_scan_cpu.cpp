// The C++ kernels of commfold::local_argmax, local_topk and softmax_stats on CPU (c10d
// groups, vLLM CPU's shared-memory communicator): the row scan (vocab_scan.h), one small
// all-gather and the combine in C++, no Python per call; and the scans for Python (tests,
// benchmarks). Built and loaded by vocab_scan.py.
#include "vocab_scan.h"

#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/headeronly/version.h>
#include <mutex>
#include <unordered_map>

namespace {
using namespace commfold_scan;

Rows rows_of(const at::Tensor& x2d, int64_t n) {
  return {(const char*)x2d.data_ptr(), x2d.stride(0) * (int64_t)x2d.element_size(),
          x2d.size(0), n, dt_of(x2d.scalar_type())};
}

at::Tensor as_rows(const at::Tensor& x) {  // [..., V] -> [rows, V], unit last stride
  const int64_t v = x.size(-1);
  if (x.dim() == 2 && (x.stride(1) == 1 || v <= 1)) return x;
  if (x.is_contiguous()) return x.view({-1, v});
  return x.reshape({-1, v}).contiguous();
}

// ---------------------------------------------------------------------------------
// Python-facing scans (tests, benchmarks): x [rows, V], the first n columns.
// the chain's f32 values of a contiguous x (rounded to its dtype when asked)
at::Tensor py_chain_values(const at::Tensor& x, std::vector<double> chain, bool rounded) {
  TORCH_CHECK(x.is_contiguous() && dt_of(x.scalar_type()) >= 0);
  const Chain ch = parse_chain(std::optional<c10::ArrayRef<double>>(chain));
  const int out = ch.out >= 0 ? ch.out : dt_of(x.scalar_type());
  at::Tensor flat = x.reshape({1, -1});
  const Rows r = rows_of(flat, flat.size(1));
  at::Tensor v = at::empty({flat.size(1)}, at::kFloat);
  float* p = v.data_ptr<float>();
  for (int64_t i = 0; i < flat.size(1); ++i) {
    p[i] = rounded ? chained(r, 0, i, ch, out) : DISPATCH_DT(r.dt, [&] {
      return value_at<DT, F32>(r.row(0), i, ch, false);
    });
  }
  return v.view(x.sizes());
}

using OptChain = std::optional<std::vector<double>>;

Rows checked_rows(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && n > 0 && n <= x.size(1) &&
              dt_of(x.scalar_type()) >= 0, "commfold: scans take [rows, >= n] f32/bf16/f16 "
              "with unit last stride");
  return rows_of(x, n);
}
Chain chain_of(const OptChain& chain) {
  return parse_chain(chain ? std::optional<c10::ArrayRef<double>>(*chain) : std::nullopt);
}
at::Tensor values_of(const at::Tensor& bits, const Chain& ch, const at::Tensor& x) {
  const int out = ch.out >= 0 ? ch.out : dt_of(x.scalar_type());
  return bits.to(out == F32 ? at::kInt : at::kShort).view(scalar_of(out));
}

std::tuple<at::Tensor, at::Tensor> py_argmax(const at::Tensor& x, int64_t n, OptChain chain) {
  const Rows rows = checked_rows(x, n);
  const Chain ch = chain_of(chain);
  at::Tensor idx = at::empty({x.size(0)}, at::kLong), bits = at::empty({x.size(0)}, at::kLong);
  argmax_rows(rows, ch, idx.data_ptr<int64_t>(), bits.data_ptr<int64_t>());
  return {values_of(bits, ch, x), idx};
}

std::tuple<at::Tensor, at::Tensor> py_topk(const at::Tensor& x, int64_t n, int64_t k,
                                           OptChain chain) {
  const Rows rows = checked_rows(x, n);
  TORCH_CHECK(k > 0 && k <= n && k <= kMaxK, "commfold: top-k needs 0 < k <= min(n, 64)");
  const Chain ch = chain_of(chain);
  at::Tensor idx = at::empty({x.size(0), k}, at::kLong);
  at::Tensor bits = at::empty({x.size(0), k}, at::kLong);
  topk_rows(rows, (int)k, ch, idx.data_ptr<int64_t>(), bits.data_ptr<int64_t>());
  return {values_of(bits, ch, x), idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> py_softmax(const at::Tensor& x, int64_t n,
                                                          OptChain chain) {
  const Rows rows = checked_rows(x, n);
  at::Tensor m = at::empty({x.size(0)}, at::kFloat), s = at::empty({x.size(0)}, at::kDouble),
             first = at::empty({x.size(0)}, at::kLong);
  softmax_rows(rows, chain_of(chain), m.data_ptr<float>(), s.data_ptr<double>(),
               first.data_ptr<int64_t>());
  return {m, s, first};
}

// a heap top-k's candidates of x[:, :n] (candidate_rows): (indices [rows, most] int64
// in column order, -1 past each row's count; counts [rows])
std::tuple<at::Tensor, at::Tensor> py_candidates(const at::Tensor& x, int64_t n, int64_t k) {
  const Rows rows = checked_rows(x, n);
  TORCH_CHECK(k > 0 && k <= kMaxK, "commfold: candidates need 0 < k <= 64");
  std::vector<std::vector<int64_t>> found;
  candidate_rows(rows, (int)k, found);
  int64_t most = 0;
  for (const auto& f : found) most = std::max<int64_t>(most, (int64_t)f.size());
  at::Tensor idx = at::full({x.size(0), most}, -1, at::kLong);
  at::Tensor counts = at::empty({x.size(0)}, at::kLong);
  int64_t *ip = idx.data_ptr<int64_t>(), *cp = counts.data_ptr<int64_t>();
  for (size_t r = 0; r < found.size(); ++r) {
    std::copy(found[r].begin(), found[r].end(), ip + r * most);
    cp[r] = (int64_t)found[r].size();
  }
  return {idx, counts};
}

// per row, how many of x[:, :n] have (x - M) - L >= t in float32 (vLLM's rank of a
// token whose logprob is t), rounded at each step as torch's float32 ops round (no
// -ffast-math, no multiply for the compiler to contract into an FMA); M, L, t float32
at::Tensor py_count_logprob_ge(const at::Tensor& x, int64_t n, const at::Tensor& M,
                               const at::Tensor& L, const at::Tensor& t) {
  const Rows rows = checked_rows(x, n);
  for (const auto* v : {&M, &L, &t})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() &&
                v->numel() == x.size(0), "commfold: M, L, t float32 [rows]");
  at::Tensor out = at::empty({x.size(0)}, at::kLong);
  const float *pm = M.data_ptr<float>(), *pl = L.data_ptr<float>(), *pt = t.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t count = 0;
      const void* row = rows.row(r);
      for (int64_t j = 0; j < n; ++j) {
        const float d = float_of_bits(raw_bits(row, j, rows.dt), rows.dt) - pm[r];
        const float lp = d - pl[r];
        count += lp >= pt[r];
      }
      po[r] = count;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------
// The ops' CPU kernels: c10d groups and vLLM CPU's shared-memory communicator in C++;
// anything else (vLLM's custom-op collectives, float64, empty input, the fallback
// switched on) goes to the op's Python implementation, commfold::<op>_eager.
std::atomic<bool> g_enabled{true};
std::atomic<int64_t> g_calls{0};  // op calls the C++ kernels served (tests read it)
std::mutex g_shm_mutex;
std::unordered_map<int64_t, std::pair<int, int>> g_shm;  // handle -> (rank, world)

void register_shm(int64_t handle, int64_t rank, int64_t world) {
  std::lock_guard<std::mutex> lock(g_shm_mutex);
  g_shm[handle] = {(int)rank, (int)world};
}

struct Comm {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int64_t handle = -1;
  int rank = 0, world = 1;
};

std::optional<c10::OperatorHandle>& shm_gather_op() {
  static std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"_C::shm_all_gather", ""});
  return op;
}

bool resolve(c10::string_view spec, Comm& c) {
  if (spec.substr(0, 5) == "c10d:") {
    c.pg = c10d::resolve_process_group(std::string(spec.substr(5)));
    c.rank = c.pg->getRank();
    c.world = c.pg->getSize();
    return true;
  }
  if (spec.substr(0, 9) == "vllm_shm:" && shm_gather_op()) {
    c.handle = std::stoll(std::string(spec.substr(9)));
    std::lock_guard<std::mutex> lock(g_shm_mutex);
    const auto it = g_shm.find(c.handle);
    if (it == g_shm.end()) return false;  // the Python path registers it
    c.rank = it->second.first;
    c.world = it->second.second;
    return true;
  }
  return false;
}

// every rank's send [rows, F] (int64 or f64, 8-byte elements) concatenated in rank order
at::Tensor all_gather(const Comm& c, at::Tensor send) {
  at::Tensor out = at::detail::empty_cpu({c.world * send.size(0), send.size(1)},
                                         send.scalar_type(), false, std::nullopt);
  std::optional<pybind11::gil_scoped_release> no_gil;
  if (PyGILState_Check()) no_gil.emplace();
  if (c.pg) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
    c.pg->all_gather_single(out, send)->wait();
#else  // torch 2.11-2.12 name it _allgather_base (an alias from 2.13 on, deprecated)
    c.pg->_allgather_base(out, send)->wait();
#endif
  } else {  // shm_all_gather takes f32/bf16/f16: 8-byte elements travel as two f32
    static auto op = shm_gather_op()->typed<void(int64_t, const at::Tensor&, at::Tensor&)>();
    const at::Tensor s = send.view(at::kFloat);
    at::Tensor o = out.view(at::kFloat);
    op.call(c.handle, s, o);
  }
  return out;
}

int64_t slice_end(std::optional<int64_t> end, int64_t width) {
  if (!end) return width;
  const int64_t e = *end >= 0 ? *end : width + *end;
  return std::max<int64_t>(0, std::min<int64_t>(width, e));
}
// how many of this rank's vs columns are vocab (vocab_slice.local_width's rule)
int64_t local_cols(std::optional<int64_t> valid_vocab, const Comm& c, int64_t vs) {
  const int64_t total = slice_end(valid_vocab, c.world * vs);
  return std::max<int64_t>(0, std::min<int64_t>(vs, total - c.rank * vs));
}

// value bits b (sign-extended) of dtype `dt` into element i of out's storage
inline void store_bits(char* out, int64_t i, int64_t b, int dt) {
  if (dt == F32) {
    const int32_t v = (int32_t)b;
    std::memcpy(out + 4 * i, &v, 4);
  } else {
    const int16_t v = (int16_t)b;
    std::memcpy(out + 2 * i, &v, 2);
  }
}

// NaN-first maximum over ranks of float values (torch.argmax's rule)
inline bool beats(float a, float best) { return (a != a && best == best) || a > best; }

using ArgmaxSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, std::optional<int64_t>,
                                                     c10::string_view, bool,
                                                     std::optional<c10::ArrayRef<double>>);

std::tuple<at::Tensor, at::Tensor> local_argmax_cpu(
    const at::Tensor& shard, std::optional<int64_t> valid_vocab, c10::string_view comm,
    bool keepdim, std::optional<c10::ArrayRef<double>> chain) {
  Comm c;
  const int dt = dt_of(shard.scalar_type());
  const int64_t vs = shard.dim() ? shard.size(-1) : 0;
  const int64_t rows = vs ? shard.numel() / vs : 0;
  if (!g_enabled || dt < 0 || shard.dim() == 0 || rows == 0 || !resolve(comm, c) ||
      slice_end(valid_vocab, c.world * vs) == 0) {
    static auto eager = c10::Dispatcher::singleton()
        .findSchemaOrThrow("commfold::local_argmax_eager", "").typed<ArgmaxSig>();
    return eager.call(shard, valid_vocab, comm, keepdim, chain);
  }
  g_calls.fetch_add(1, std::memory_order_relaxed);
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  const Chain ch = parse_chain(chain);
  const int out = ch.out >= 0 ? ch.out : dt;
  const int64_t n_local = local_cols(valid_vocab, c, vs);
  at::Tensor pair = at::detail::empty_cpu({rows, 2}, at::kLong, false, std::nullopt);
  int64_t* p = pair.data_ptr<int64_t>();
  if (n_local > 0) {
    static thread_local std::vector<int64_t> idx, bits;
    idx.resize(rows);
    bits.resize(rows);
    argmax_rows(rows_of(as_rows(shard), n_local), ch, idx.data(), bits.data());
    for (int64_t r = 0; r < rows; ++r) {
      p[2 * r] = bits[r];
      p[2 * r + 1] = idx[r] + c.rank * vs;
    }
  } else {  // this rank holds only padding: never chosen over a real column
    for (int64_t r = 0; r < rows; ++r) {
      p[2 * r] = bits_of(-kInf, out);
      p[2 * r + 1] = c.rank * vs;
    }
  }
  const at::Tensor every = all_gather(c, pair);  // [world * rows, 2]
  const int64_t* e = every.data_ptr<int64_t>();
  std::vector<int64_t> shape(shard.sizes().begin(), shard.sizes().end() - 1);
  if (keepdim) shape.push_back(1);
  at::Tensor value = at::detail::empty_cpu(shape, scalar_of(out), false, std::nullopt);
  at::Tensor index = at::detail::empty_cpu(shape, at::kLong, false, std::nullopt);
  int64_t* xi = index.data_ptr<int64_t>();
  char* xv = (char*)value.data_ptr();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t w_best = 0;
    float best = float_of_bits(e[2 * r], out);
    for (int64_t w = 1; w < c.world; ++w) {
      const float v = float_of_bits(e[2 * (w * rows + r)], out);
      if (beats(v, best)) { best = v; w_best = w; }
    }
    const int64_t b = e[2 * (w_best * rows + r)];
    xi[r] = e[2 * (w_best * rows + r) + 1];
    store_bits(xv, r, b, out);
  }
  return {value, index};
}

using TopkSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, std::optional<int64_t>,
                                                   c10::string_view, int64_t,
                                                   std::optional<c10::ArrayRef<double>>);
constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
constexpr int64_t kLow = 0xFFFFFFFFll;

// The op's key: (the dtype's order-preserving bits << 32) + (2^32 - 1 - global index)
inline int64_t op_key(int64_t vbits, int dt, int64_t gidx) {
  const int64_t top = dt == F32 ? 0x7FFFFFFFll : 0x7FFFll;
  const float f = float_of_bits(vbits, dt);
  int64_t b = vbits < 0 ? (vbits ^ top) : vbits;
  if (f == 0.0f) b = 0;
  if (f != f) b = top;
  return (int64_t)((uint64_t)b << 32) + (kLow - gidx);
}

std::tuple<at::Tensor, at::Tensor> local_topk_cpu(
    const at::Tensor& shard, std::optional<int64_t> valid_vocab, c10::string_view comm,
    int64_t k, std::optional<c10::ArrayRef<double>> chain) {
  Comm c;
  const int dt = dt_of(shard.scalar_type());
  const int64_t vs = shard.dim() ? shard.size(-1) : 0;
  const int64_t rows = vs ? shard.numel() / vs : 0;
  if (!g_enabled || dt < 0 || shard.dim() == 0 || rows == 0 || k < 1 || k > kMaxK ||
      !resolve(comm, c) || k > slice_end(valid_vocab, c.world * vs)) {
    static auto eager = c10::Dispatcher::singleton()
        .findSchemaOrThrow("commfold::local_topk_eager", "").typed<TopkSig>();
    return eager.call(shard, valid_vocab, comm, k, chain);
  }
  g_calls.fetch_add(1, std::memory_order_relaxed);
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  const Chain ch = parse_chain(chain);
  const int out = ch.out >= 0 ? ch.out : dt;
  const int64_t n_local = local_cols(valid_vocab, c, vs);
  const int64_t take = std::min(k, n_local);
  at::Tensor pack = at::detail::empty_cpu({rows, 2 * k}, at::kLong, false, std::nullopt);
  int64_t* p = pack.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * 2 * k; ++i) p[i] = kNone;
  if (take > 0) {
    static thread_local std::vector<int64_t> idx, bits;
    idx.resize(rows * take);
    bits.resize(rows * take);
    topk_rows(rows_of(as_rows(shard), n_local), (int)take, ch, idx.data(), bits.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < take; ++j) {
        const int64_t g = idx[r * take + j] + c.rank * vs;
        p[r * 2 * k + 2 * j] = op_key(bits[r * take + j], out, g);
        p[r * 2 * k + 2 * j + 1] = bits[r * take + j];
      }
  }
  const at::Tensor every = all_gather(c, pack);  // [world * rows, 2k]
  const int64_t* e = every.data_ptr<int64_t>();
  std::vector<int64_t> shape(shard.sizes().begin(), shard.sizes().end() - 1);
  shape.push_back(k);
  at::Tensor value = at::detail::empty_cpu(shape, scalar_of(out), false, std::nullopt);
  at::Tensor index = at::detail::empty_cpu(shape, at::kLong, false, std::nullopt);
  int64_t* xi = index.data_ptr<int64_t>();
  char* xv = (char*)value.data_ptr();
  std::vector<std::pair<int64_t, int64_t>> cand;  // (key, value bits)
  for (int64_t r = 0; r < rows; ++r) {
    cand.clear();
    for (int64_t w = 0; w < c.world; ++w) {
      const int64_t* q = e + (w * rows + r) * 2 * k;
      for (int64_t j = 0; j < k; ++j) cand.emplace_back(q[2 * j], q[2 * j + 1]);
    }
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int64_t j = 0; j < k; ++j) {
      xi[r * k + j] = kLow - (cand[j].first & kLow);
      store_bits(xv, r * k + j, cand[j].second, out);
    }
  }
  return {value, index};
}

using SoftSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, std::optional<int64_t>,
    c10::string_view, bool, bool, std::optional<c10::ArrayRef<double>>);

template <typename T> inline T to_t(double v) { return static_cast<T>(v); }

// Outputs in dtype T (float, BFloat16, Half), with torch's per-op rounding:
// M, S, argmax, (x[idx] - shift) - log(S) at picks.
template <typename T>
void softmax_combine_cpu(const double* e, int64_t world, int64_t rows, int64_t F, bool finite_shift,
                         bool want_first, const int64_t* idx, int64_t p, int64_t kp, int64_t vs,
                         T* out_m, T* out_s, int64_t* out_i, T* out_p) {
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    double big_m = -inf;
    bool nan = false;
    int64_t winner = 0;
    double wbest = e[r * F];  // first max / first NaN over ranks
    for (int64_t w = 0; w < world; ++w) {
      const double m = e[(w * rows + r) * F];
      if (m != m) nan = true;
      else big_m = std::max(big_m, m);
      if ((m != m && wbest == wbest) || m > wbest) { wbest = m; winner = w; }
    }
    if (nan) big_m = std::numeric_limits<double>::quiet_NaN();
    double g_shift = big_m;
    if (finite_shift && std::abs(big_m) == inf) g_shift = 0.0;
    double big_s = 0.0;
    for (int64_t w = 0; w < world; ++w) {
      const double m = e[(w * rows + r) * F], s = e[(w * rows + r) * F + 1];
      const double c_r = std::isfinite(m) ? m : 0.0;
      big_s += s == 0 ? 0.0 : s * std::exp(c_r - g_shift);
    }
    if (!finite_shift && !std::isfinite(big_m)) big_s = std::numeric_limits<double>::quiet_NaN();
    out_m[r] = to_t<T>(big_m);
    out_s[r] = to_t<T>(big_s);
    if (want_first) out_i[r] = (int64_t)e[(winner * rows + r) * F + 2];
    if (r < p) {
      const int64_t col = 2 + (want_first ? 1 : 0);
      const T shift = to_t<T>(g_shift);
      const T log_s = static_cast<T>(std::log(static_cast<float>(out_s[r])));
      for (int64_t j = 0; j < kp; ++j) {
        const int64_t owner = std::min<int64_t>(
            std::max<int64_t>(idx[r * kp + j] / std::max<int64_t>(vs, 1), 0), world - 1);
        const T picked = to_t<T>(e[(owner * rows + r) * F + col + j]);
        out_p[r * kp + j] = static_cast<T>(static_cast<T>(picked - shift) - log_s);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> softmax_stats_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& picks, std::optional<int64_t> valid_vocab,
    c10::string_view comm, bool finite_shift, bool want_first,
    std::optional<c10::ArrayRef<double>> chain) {
  Comm c;
  const int dt = dt_of(x.scalar_type());
  const int64_t vs = x.dim() ? x.size(-1) : 0;
  const int64_t rows = vs ? x.numel() / vs : 0;
  const bool picks_ok = !picks || (picks->scalar_type() == at::kLong && picks->dim() >= 1 &&
                                   picks->dim() == x.dim() && picks->numel() > 0);
  if (!g_enabled || dt < 0 || x.dim() == 0 || rows == 0 || !picks_ok || !resolve(comm, c)) {
    static auto eager = c10::Dispatcher::singleton()
        .findSchemaOrThrow("commfold::softmax_stats_eager", "").typed<SoftSig>();
    return eager.call(x, picks, valid_vocab, comm, finite_shift, want_first, chain);
  }
  g_calls.fetch_add(1, std::memory_order_relaxed);
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  const Chain ch = parse_chain(chain);
  const int out = ch.out >= 0 ? ch.out : dt;
  const int64_t total = slice_end(valid_vocab, c.world * vs);
  const int64_t n_local = local_cols(valid_vocab, c, vs);
  // picks as [p, kp] with p <= rows (aten.gather's rule for 2-D inputs)
  at::Tensor idx;
  int64_t p = 0, kp = 0;
  if (picks) {
    idx = picks->dim() == 2 ? *picks : picks->reshape({-1, picks->size(-1)});
    idx = idx.is_contiguous() ? idx : idx.contiguous();
    p = idx.size(0);
    kp = idx.size(1);
    TORCH_CHECK(p <= rows, "commfold.softmax_stats: gather index has more rows than the "
                "logits (the original program's gather raises here too)");
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < p * kp; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < total, "commfold.softmax_stats: gather index out "
                  "of bounds for a vocab of ", total,
                  " (the original program's gather raises here too)");
  }
  const int64_t F = 2 + (want_first ? 1 : 0) + kp;
  at::Tensor pack = at::detail::empty_cpu({rows, F}, at::kDouble, false, std::nullopt);
  double* q = pack.data_ptr<double>();
  const at::Tensor xr = as_rows(x);
  const Rows xs = rows_of(xr, std::max<int64_t>(n_local, 1));
  if (n_local > 0) {
    static thread_local std::vector<float> m;
    static thread_local std::vector<double> s;
    static thread_local std::vector<int64_t> first;
    m.resize(rows); s.resize(rows); first.resize(rows);
    softmax_rows(xs, ch, m.data(), s.data(), first.data());
    for (int64_t r = 0; r < rows; ++r) {
      q[r * F] = m[r];  // s is relative to this (unrounded) maximum
      q[r * F + 1] = s[r];
      if (want_first) q[r * F + 2] = (double)(first[r] + c.rank * vs);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      q[r * F] = -std::numeric_limits<double>::infinity();
      q[r * F + 1] = 0.0;
      if (want_first) q[r * F + 2] = (double)(c.rank * vs);
    }
  }
  if (kp) {  // this rank's logits at the chosen columns (0 where another rank owns it)
    const int64_t* ip = idx.data_ptr<int64_t>();
    const int64_t col = 2 + (want_first ? 1 : 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kp; ++j) {
        double v = 0.0;
        if (r < p) {
          const int64_t local = ip[r * kp + j] - c.rank * vs;
          if (local >= 0 && local < vs) {
            v = !ch.n ? float_of_bits(raw_bits(xs.row(r), local, dt), dt)
                      : chained(xs, r, local, ch, out);
          }
        }
        q[r * F + col + j] = v;
      }
  }
  const at::Tensor every = all_gather(c, pack);
  const double* e = every.data_ptr<double>();
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1), stat = lead;
  stat.push_back(1);
  const auto st = scalar_of(out);
  at::Tensor om = at::detail::empty_cpu(stat, st, false, std::nullopt);
  at::Tensor os = at::detail::empty_cpu(stat, st, false, std::nullopt);
  at::Tensor oi = at::detail::empty_cpu(want_first ? lead : std::vector<int64_t>{0}, at::kLong,
                                        false, std::nullopt);
  at::Tensor op = picks ? at::detail::empty_cpu(picks->sizes(), st, false, std::nullopt)
                        : at::detail::empty_cpu({0}, st, false, std::nullopt);
  const int64_t* ip = kp ? idx.data_ptr<int64_t>() : nullptr;
  if (out == F32)
    softmax_combine_cpu<float>(e, c.world, rows, F, finite_shift, want_first, ip, p, kp, vs,
                               om.data_ptr<float>(), os.data_ptr<float>(),
                               oi.data_ptr<int64_t>(), op.data_ptr<float>());
  else if (out == BF16)
    softmax_combine_cpu<c10::BFloat16>(e, c.world, rows, F, finite_shift, want_first, ip, p, kp, vs,
                                       om.data_ptr<c10::BFloat16>(), os.data_ptr<c10::BFloat16>(),
                                       oi.data_ptr<int64_t>(), op.data_ptr<c10::BFloat16>());
  else
    softmax_combine_cpu<c10::Half>(e, c.world, rows, F, finite_shift, want_first, ip, p, kp, vs,
                                   om.data_ptr<c10::Half>(), os.data_ptr<c10::Half>(),
                                   oi.data_ptr<int64_t>(), op.data_ptr<c10::Half>());
  return {om, os, oi, op};
}

}  // namespace

TORCH_LIBRARY_IMPL(commfold, CPU, m) {
  m.impl("local_argmax", &local_argmax_cpu);
  m.impl("local_topk", &local_topk_cpu);
  m.impl("softmax_stats", &softmax_stats_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &py_argmax, "(value, index) of the first max of x[:, :n]");
  m.def("topk_rows", &py_topk, "(values, indices) of the top k of x[:, :n]");
  m.def("softmax_rows", &py_softmax, "(max, f64 sum of exp(x - max), first max) of x[:, :n]");
  m.def("candidates", &py_candidates, "columns of x[:, :n] a heap top-k takes in");
  m.def("count_logprob_ge", &py_count_logprob_ge, "entries whose f32 logprob is >= t");
  m.def("chain_values", &py_chain_values, "a chain's f32 values of x (rounded: to its dtype)");
  m.def("set_enabled", [](bool on) { g_enabled = on; }, "C++ kernels on (else the fallback)");
  m.def("enabled", []() { return g_enabled.load(); });
  m.def("set_min_run", [](int64_t n) { g_min_run = std::max<int64_t>(n, 1); },
        "columns per run before a row is split across threads (tests force splits)");
  m.def("calls", []() { return g_calls.load(); }, "op calls served in C++ so far");
  m.def("register_shm", &register_shm, "rank and world of a vLLM shared-memory handle");
  m.def("isa", []() {
#if defined(CPU_CAPABILITY_AVX512)
    return std::string("avx512");
#elif defined(CPU_CAPABILITY_AVX2)
    return std::string("avx2");
#elif defined(CPU_CAPABILITY_NEON)
    return std::string("neon");
#else
    return std::string("scalar");
#endif
  });
}
