// commfold's row scans over a vocab shard - first maximum, top k, softmax statistics -
// each reading a logit once, with an optional elementwise chain (scale, temperature,
// soft-cap) evaluated as Inductor's CPU code does; rows (and long rows' column runs)
// across the rank's threads. See vocab_scan.py for the rules each scan keeps.
#pragma once
#include "vocab_simd.h"  // first: it picks the ISA before any ATen header

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>
#include <vector>

namespace commfold_scan {
using namespace simd;


// ---------------------------------------------------------------------------------
// Elementwise chains: [code, constant] pairs (commfold/ops/chain_encoding.py writes them).
enum Op { kMul = 1, kDiv = 2, kAdd = 3, kSub = 4, kTanh = 5, kCast = 6 };
constexpr int kMaxChain = 16;
struct Chain {
  int n = 0;
  int code[kMaxChain];
  float c[kMaxChain];
  int out = -1;  // the chain's output dtype (a final cast), -1: the input's
};

Chain parse_chain(const std::optional<c10::ArrayRef<double>>& spec) {
  Chain ch;
  if (!spec) return ch;
  TORCH_CHECK(spec->size() % 2 == 0 && spec->size() / 2 <= kMaxChain,
              "commfold: malformed elementwise chain");
  for (size_t i = 0; i < spec->size(); i += 2) {
    const int code = (int)(*spec)[i];
    const double c = (*spec)[i + 1];
    TORCH_CHECK(code >= kMul && code <= kCast, "commfold: unknown chain op ", code);
    if (code == kCast) {
      ch.out = (int)c;
      continue;  // casts that widen or keep: no value change in f32
    }
    ch.code[ch.n] = code;
    ch.c[ch.n] = static_cast<float>(c);  // as Inductor: static_cast<float>(constant)
    ++ch.n;
  }
  return ch;
}

inline F apply(const Chain& ch, F v) {
  for (int i = 0; i < ch.n; ++i) {
    switch (ch.code[i]) {
      case kMul: v = mul(v, splat(ch.c[i])); break;
      case kDiv: v = div(v, splat(ch.c[i])); break;
      case kAdd: v = add(v, splat(ch.c[i])); break;
      case kSub: v = sub(v, splat(ch.c[i])); break;
      case kTanh: v = vtanh(v); break;
    }
  }
  return v;
}

// A chain's value as the graph stores it in dtype `out` (the NaN: one canonical quiet NaN)
template <int OUT> inline F round_out(F v) {
  const M nan = isnan(v);
  const F r = OUT == F32 ? v : OUT == BF16 ? round_bf16(v) : round_f16(v);
  return blend(nan, r, splat(std::numeric_limits<float>::quiet_NaN()));
}

// Software prefetch PF_BYTES ahead of a streaming scan: a shard fresh from DRAM (the
// usual case: the LM head wrote it, or another step evicted it) is read at ~0.85x of
// a sum's speed without it (one stream, too few misses in flight).
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
template <int DT> inline void prefetch_ahead(const void* row, int64_t i) {
  const char* p = (const char*)row + i * (DT == F32 ? 4 : 2) + PF_BYTES;
  __builtin_prefetch(p);
  if (2 * W * (DT == F32 ? 4 : 2) > 64) __builtin_prefetch(p + 64);
}
template <int DT> inline F load(const void* row, int64_t i) {
  if (DT == F32) return loadf((const float*)row + i);
  if (DT == BF16) return loadbf((const uint16_t*)row + i);
  return loadh((const uint16_t*)row + i);
}
// The last cnt (< W) elements of a run: lanes past cnt hold -inf.
template <int DT> inline F load_tail(const void* row, int64_t i, int cnt) {
  alignas(64) uint32_t buf32[W];
  alignas(64) uint16_t buf16[W];
  if (DT == F32) {
    for (int j = 0; j < W; ++j) buf32[j] = 0xFF800000u;
    std::memcpy(buf32, (const float*)row + i, cnt * 4);
    return loadf((const float*)buf32);
  }
  const uint16_t ninf = DT == BF16 ? 0xFF80u : 0xFC00u;
  for (int j = 0; j < W; ++j) buf16[j] = ninf;
  std::memcpy(buf16, (const uint16_t*)row + i, cnt * 2);
  return DT == BF16 ? loadbf(buf16) : loadh(buf16);
}

// The compared value of one element: chain applied (the vector path, so tanh is the
// same function), rounded to out when `rounded`.
template <int DT, int OUT>
float value_at(const void* row, int64_t i, const Chain& ch, bool rounded) {
  F v = load_tail<DT>(row, i, 1);
  if (ch.n) v = apply(ch, v);
  if (rounded) v = round_out<OUT>(v);
  alignas(64) float t[W];
  store(t, v);
  return t[0];
}

// ---------------------------------------------------------------------------------
// argmax: the first maximum of row[lo, hi); a NaN is the maximum (the first NaN wins).
struct ArgmaxPart {
  float v;
  int64_t i;
  bool nan;
};

template <int DT, bool CH>
ArgmaxPart argmax_run(const void* row, int64_t lo, int64_t hi, const Chain& ch) {
  // two accumulators (independent dependency chains); each lane keeps the first
  // position of its own maximum (strictly-greater updates)
  F b0 = splat(-kInf), b1 = splat(-kInf);
  I i0 = addi(iota(), splati((int32_t)lo)), i1 = addi(iota(), splati((int32_t)(lo + W)));
  int64_t i = lo;
  for (; i + 2 * W <= hi; i += 2 * W) {
    prefetch_ahead<DT>(row, i);
    F a = load<DT>(row, i), b = load<DT>(row, i + W);
    if (CH) { a = apply(ch, a); b = apply(ch, b); }
    const uint32_t na = bits(isnan(a)), nb = bits(isnan(b));
    if (na | nb) {
      const int64_t at = na ? i + first_lane(na) : i + W + first_lane(nb);
      return {std::numeric_limits<float>::quiet_NaN(), at, true};
    }
    const I pa = addi(iota(), splati((int32_t)i)), pb = addi(pa, splati(W));
    const M ga = gt(a, b0), gb = gt(b, b1);
    b0 = blend(ga, b0, a);
    i0 = blendi(ga, i0, pa);
    b1 = blend(gb, b1, b);
    i1 = blendi(gb, i1, pb);
  }
  for (; i < hi; i += W) {
    const int cnt = (int)std::min<int64_t>(W, hi - i);
    F a = cnt == W ? load<DT>(row, i) : load_tail<DT>(row, i, cnt);
    if (CH) {
      a = apply(ch, a);
      if (cnt < W) a = blend(below(cnt), splat(-kInf), a);  // past the run: -inf
    }
    const uint32_t na = bits(isnan(a));
    if (na) return {std::numeric_limits<float>::quiet_NaN(), i + first_lane(na), true};
    const M ga = gt(a, b0);
    b0 = blend(ga, b0, a);
    i0 = blendi(ga, i0, addi(iota(), splati((int32_t)i)));
  }
  alignas(64) float v0[W], v1[W];
  alignas(64) int32_t x0[W], x1[W];
  store(v0, b0); store(v1, b1); storei(x0, i0); storei(x1, i1);
  float best = -kInf;
  for (int j = 0; j < W; ++j) best = std::max(best, std::max(v0[j], v1[j]));
  int64_t at = std::numeric_limits<int64_t>::max();
  for (int j = 0; j < W; ++j) {  // lanes that never saw the run report positions >= hi
    if (v0[j] == best) at = std::min<int64_t>(at, x0[j]);
    if (v1[j] == best) at = std::min<int64_t>(at, x1[j]);
  }
  return {best, at, false};
}

// ---------------------------------------------------------------------------------
// top k by (value descending, index ascending); NaN above +inf, -0.0 == +0.0.
// Keys: (order-preserving f32 bits << 32) | (2^32 - 1 - index), larger is better.
inline int64_t key_of(float f, int64_t idx) {
  int32_t o;
  if (f != f) {
    o = std::numeric_limits<int32_t>::max();
  } else {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    o = b == 0x80000000u ? 0 : (b & 0x80000000u) ? (int32_t)(b ^ 0x7FFFFFFFu) : (int32_t)b;
  }
  return (int64_t)(((uint64_t)(int64_t)o << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)idx));
}
inline float value_of_key(int64_t key) {
  const int32_t o = (int32_t)(key >> 32);
  if (o == std::numeric_limits<int32_t>::max()) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t b = o >= 0 ? (uint32_t)o : ((uint32_t)o ^ 0x7FFFFFFFu);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline int64_t index_of_key(int64_t key) {
  return (int64_t)(0xFFFFFFFFu - (uint32_t)(key & 0xFFFFFFFF));
}

// keys: the min(k, hi - lo) best keys of row[lo, hi), sorted best first. A vector
// compare per W logits against the k-th best so far; the few that beat it go into
// the sorted list (binary search, a short move): about k * ln(n / k) of them in a
// random row, at most n in any order. `entered` (if given) gets, in column order, the
// columns that entered the list: the first k, then each one above the k-th best of
// the columns before it - the entries a heap top-k (torch.topk on CPU) takes in.
constexpr int kMaxK = 64;
template <int DT, bool CH, int OUT>
void topk_run(const void* row, int64_t lo, int64_t hi, int k, const Chain& ch,
              std::vector<int64_t>& keys, std::vector<int64_t>* entered = nullptr) {
  alignas(64) int64_t top[kMaxK + 8];  // the best `size` keys so far, best first
  int size = 0;
  alignas(64) float vals[W];
  // take the lanes of v in b; true when the k-th best changed
  const auto take = [&](F v, uint32_t b, int64_t i) {
    store(vals, v);
    bool moved = false;
    while (b) {
      const int j = first_lane(b);
      b &= b - 1;
      const int64_t key = key_of(vals[j], i + j - lo);
      if (size == k && key <= top[k - 1]) continue;
      int pos = 0;  // keys better than this one (a vectorized count)
      for (int q = 0; q < size; ++q) pos += top[q] > key;
      const int last = size < k ? size : k - 1;
      std::memmove(top + pos + 1, top + pos, (size_t)(last - pos) * sizeof(int64_t));
      top[pos] = key;
      if (entered) entered->push_back(i + j);
      size = last + 1;
      moved = true;
    }
    return moved && size == k;
  };
  const auto at = [&](int64_t i) {
    const F v = load<DT>(row, i);
    return CH ? round_out<OUT>(apply(ch, v)) : v;
  };
  int64_t i = lo;
  for (; i < hi && size < k; i += W) {  // the first k, unconditionally
    const int cnt = (int)std::min<int64_t>(W, hi - i);
    F v = cnt == W ? load<DT>(row, i) : load_tail<DT>(row, i, cnt);
    if (CH) v = round_out<OUT>(apply(ch, v));
    take(v, (1u << cnt) - 1u, i);
  }
  // the rest against the k-th best value t: v > t, or v NaN (while t is not NaN)
  float tv = size == k ? value_of_key(top[k - 1]) : std::numeric_limits<float>::quiet_NaN();
  F t = splat(tv);
  for (; i + 4 * W <= hi && tv == tv; i += 4 * W) {
    prefetch_ahead<DT>(row, i);
    prefetch_ahead<DT>(row, i + 2 * W);
    const F v0 = at(i), v1 = at(i + W), v2 = at(i + 2 * W), v3 = at(i + 3 * W);
    const M p0 = gt_or_nan(v0, t), p1 = gt_or_nan(v1, t), p2 = gt_or_nan(v2, t),
            p3 = gt_or_nan(v3, t);
    if (__builtin_expect(!bits(mor(mor(p0, p1), mor(p2, p3))), 1)) continue;
    bool moved = take(v0, bits(p0), i);
    moved |= take(v1, bits(p1), i + W);
    moved |= take(v2, bits(p2), i + 2 * W);
    moved |= take(v3, bits(p3), i + 3 * W);
    if (moved) { tv = value_of_key(top[k - 1]); t = splat(tv); }
  }
  for (; i < hi && tv == tv; i += W) {
    const int cnt = (int)std::min<int64_t>(W, hi - i);
    F v = cnt == W ? load<DT>(row, i) : load_tail<DT>(row, i, cnt);
    if (CH) v = round_out<OUT>(apply(ch, v));
    uint32_t b = bits(gt_or_nan(v, t));
    if (cnt < W) b &= (1u << cnt) - 1u;
    if (b && take(v, b, i)) { tv = value_of_key(top[k - 1]); t = splat(tv); }
  }
  keys.assign(top, top + size);
}

// ---------------------------------------------------------------------------------
// softmax statistics of row[lo, hi): m = max (NaN if any), s = sum(exp(x - m)) in f64
// (m finite; else s is inf for +inf, NaN for NaN, 0 for an all -inf run), first = the
// first maximum. One pass: each block of the row is converted (and chained) into an
// L1 buffer, its maximum raises the running one (the partial sum rescaled once), then
// exp(x - m) is summed from the buffer.
struct SoftPart {
  float m;
  double s;
  int64_t first;
};
constexpr int kBlock = 1024;

template <int DT, bool CH>
SoftPart softmax_run(const void* row, int64_t lo, int64_t hi, const Chain& ch) {
  alignas(64) float buf[kBlock];
  F best = splat(-kInf);
  I bidx = addi(iota(), splati((int32_t)lo));
  float m_run = -kInf;
  bool inf = false;
  Acc acc;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, hi - b);
    for (int64_t j = 0; j < len; j += W) {
      const int cnt = (int)std::min<int64_t>(W, len - j);
      if ((j & W) == 0) prefetch_ahead<DT>(row, b + j);
      F v = cnt == W ? load<DT>(row, b + j) : load_tail<DT>(row, b + j, cnt);
      if (CH) {
        v = apply(ch, v);
        if (cnt < W) v = blend(below(cnt), splat(-kInf), v);
      }
      const uint32_t nn = bits(isnan(v));
      if (nn) {
        return {std::numeric_limits<float>::quiet_NaN(),
                std::numeric_limits<double>::quiet_NaN(), b + j + first_lane(nn)};
      }
      const M g = gt(v, best);
      best = blend(g, best, v);
      bidx = blendi(g, bidx, addi(iota(), splati((int32_t)(b + j))));
      store(buf + j, v);
    }
    if (inf) continue;  // only NaN can change the answer now
    const float m_new = hmax(best);
    if (m_new == kInf) {
      inf = true;
      continue;
    }
    if (m_new == -kInf) continue;  // nothing but -inf so far
    if (m_new > m_run) {
      if (m_run != -kInf) acc.scale(std::exp((double)m_run - (double)m_new));
      m_run = m_new;
    }
    const F sh = splat(m_run);
    const int64_t full = len - len % W;
    for (int64_t j = 0; j < full; j += W) acc.add(vexp(sub(loadf(buf + j), sh)));
    if (full < len) {  // tail lanes hold -inf: exp gives 0
      acc.add(vexp(sub(blend(below((int)(len - full)), splat(-kInf), loadf(buf + full)), sh)));
    }
  }
  alignas(64) float v[W];
  alignas(64) int32_t x[W];
  store(v, best);
  storei(x, bidx);
  float m = -kInf;
  for (int j = 0; j < W; ++j) m = std::max(m, v[j]);
  int64_t first = hi;
  for (int j = 0; j < W; ++j)
    if (v[j] == m) first = std::min<int64_t>(first, x[j]);
  if (first >= hi) first = lo;
  const double s = inf ? (double)kInf : m == -kInf ? 0.0 : acc.sum();
  return {m, s, first};
}

// ---------------------------------------------------------------------------------
// Rows across the rank's threads; a few long rows also split into column runs.
std::atomic<int64_t> g_min_run{1 << 15};  // columns per run before a row is split

template <typename Fn>
int64_t for_runs(int64_t rows, int64_t n, Fn&& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t min_run = g_min_run.load();
  int64_t runs = 1;
  if (threads > 1 && rows < threads && n >= 2 * min_run)
    runs = std::min<int64_t>((threads + rows - 1) / rows, n / min_run);
  const int64_t tasks = rows * runs;
  const auto body = [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / runs, c = t % runs;
      fn(t, r, n * c / runs, n * (c + 1) / runs);
    }
  };
  if (threads > 1 && tasks > 1 && rows * n >= 2 * min_run) {
    at::parallel_for(0, tasks, 1, body);
  } else {
    body(0, tasks);
  }
  return runs;
}

// One row's bits in dtype `dt` (as a sign-extended integer), and back.
inline int64_t bits_of(float f, int dt) {
  if (dt == F32) { int32_t b; std::memcpy(&b, &f, 4); return b; }
  if (dt == BF16) {
    if (f != f) return (int16_t)0x7FC0;
    uint32_t u; std::memcpy(&u, &f, 4);
    return (int16_t)(uint16_t)(u >> 16);  // f is a bf16 value here
  }
  return (int16_t)c10::detail::fp16_ieee_from_fp32_value(f);
}
inline float float_of_bits(int64_t b, int dt) {
  if (dt == F32) { const int32_t v = (int32_t)b; float f; std::memcpy(&f, &v, 4); return f; }
  if (dt == BF16) {
    const uint32_t u = (uint32_t)(uint16_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  return c10::detail::fp16_ieee_to_fp32_value((uint16_t)b);
}
inline int64_t raw_bits(const void* row, int64_t i, int dt) {
  if (dt == F32) return ((const int32_t*)row)[i];
  return (int16_t)((const uint16_t*)row)[i];
}

int dt_of(at::ScalarType t) {
  return t == at::kFloat ? F32 : t == at::kBFloat16 ? BF16 : t == at::kHalf ? F16 : -1;
}
at::ScalarType scalar_of(int dt) {
  return dt == F32 ? at::kFloat : dt == BF16 ? at::kBFloat16 : at::kHalf;
}

// ---------------------------------------------------------------------------------
// Row scans over a [rows, >= n] view (unit stride in the last dim).
struct Rows {
  const char* base;
  int64_t stride_bytes, rows, n;
  int dt;
  const void* row(int64_t r) const { return base + r * stride_bytes; }
};

#define DISPATCH_DT(dt, ...)                                         \
  [&] {                                                              \
    if ((dt) == F32) { constexpr int DT = F32; return __VA_ARGS__(); }  \
    if ((dt) == BF16) { constexpr int DT = BF16; return __VA_ARGS__(); } \
    constexpr int DT = F16; return __VA_ARGS__();                    \
  }()

// the chain's value of row r, column i, as the graph stores it in `out` (its bits)
float chained(const Rows& x, int64_t r, int64_t i, const Chain& ch, int out) {
  return DISPATCH_DT(x.dt, [&] {
    return out == F32 ? value_at<DT, F32>(x.row(r), i, ch, true)
         : out == BF16 ? value_at<DT, BF16>(x.row(r), i, ch, true)
                       : value_at<DT, F16>(x.row(r), i, ch, true);
  });
}
int64_t chained_bits(const Rows& x, int64_t r, int64_t i, const Chain& ch, int out) {
  return bits_of(chained(x, r, i, ch, out), out);
}

// index and compared value (rounded to out) of each row's first maximum
void argmax_rows(const Rows& x, const Chain& ch, int64_t* index, int64_t* value_bits) {
  const int out = ch.out >= 0 ? ch.out : x.dt;
  std::vector<ArgmaxPart> parts;
  parts.resize(x.rows * std::max<int64_t>(1, at::get_num_threads()));
  const int64_t runs = DISPATCH_DT(x.dt, [&] {
    return for_runs(x.rows, x.n, [&](int64_t t, int64_t r, int64_t lo, int64_t hi) {
      parts[t] = ch.n ? argmax_run<DT, true>(x.row(r), lo, hi, ch)
                      : argmax_run<DT, false>(x.row(r), lo, hi, ch);
    });
  });
  for (int64_t r = 0; r < x.rows; ++r) {
    ArgmaxPart best = parts[r * runs];
    for (int64_t c = 1; c < runs && !best.nan; ++c) {
      const ArgmaxPart& p = parts[r * runs + c];
      if (p.nan || p.v > best.v) best = p;
    }
    index[r] = best.i;
    if (!value_bits) continue;
    if (!ch.n) {
      value_bits[r] = raw_bits(x.row(r), best.i, x.dt);  // the column's own bits
    } else {
      value_bits[r] = chained_bits(x, r, best.i, ch, out);
    }
  }
}

// each row's best min(k, n) (index, value bits in out), sorted; k <= n
void topk_rows(const Rows& x, int k, const Chain& ch, int64_t* index, int64_t* value_bits) {
  const int out = ch.out >= 0 ? ch.out : x.dt;
  std::vector<std::vector<int64_t>> parts(x.rows * std::max<int64_t>(1, at::get_num_threads()));
  const int64_t runs = DISPATCH_DT(x.dt, [&] {
    return for_runs(x.rows, x.n, [&](int64_t t, int64_t r, int64_t lo, int64_t hi) {
      const int kk = (int)std::min<int64_t>(k, hi - lo);
      auto& keys = parts[t];
      if (kk <= 0) { keys.clear(); return; }
      if (!ch.n) topk_run<DT, false, F32>(x.row(r), lo, hi, kk, ch, keys);
      else if (out == F32) topk_run<DT, true, F32>(x.row(r), lo, hi, kk, ch, keys);
      else if (out == BF16) topk_run<DT, true, BF16>(x.row(r), lo, hi, kk, ch, keys);
      else topk_run<DT, true, F16>(x.row(r), lo, hi, kk, ch, keys);
      const int64_t shift = lo;  // run-local indices -> row indices (key order kept)
      for (auto& key : keys) key = (key & ~(int64_t)0xFFFFFFFF) |
                                   (int64_t)(0xFFFFFFFFu - (uint32_t)(index_of_key(key) + shift));
    });
  });
  std::vector<int64_t> merged;
  for (int64_t r = 0; r < x.rows; ++r) {
    const std::vector<int64_t>* keys = &parts[r * runs];
    if (runs > 1) {
      merged.clear();
      for (int64_t c = 0; c < runs; ++c)
        merged.insert(merged.end(), parts[r * runs + c].begin(), parts[r * runs + c].end());
      std::partial_sort(merged.begin(), merged.begin() + k, merged.end(), std::greater<int64_t>());
      keys = &merged;
    }
    for (int j = 0; j < k; ++j) {
      const int64_t i = index_of_key((*keys)[j]);
      index[r * k + j] = i;
      value_bits[r * k + j] = !ch.n ? raw_bits(x.row(r), i, x.dt) : chained_bits(x, r, i, ch, out);
    }
  }
}

// each row's columns a heap top-k takes in (topk_run's `entered`), in column order;
// a row split into runs gives each run's (a superset: every run starts a new heap)
void candidate_rows(const Rows& x, int k, std::vector<std::vector<int64_t>>& out) {
  std::vector<std::vector<int64_t>> parts(x.rows * std::max<int64_t>(1, at::get_num_threads()));
  const int64_t runs = DISPATCH_DT(x.dt, [&] {
    return for_runs(x.rows, x.n, [&](int64_t t, int64_t r, int64_t lo, int64_t hi) {
      std::vector<int64_t> keys;
      parts[t].clear();
      const int kk = (int)std::min<int64_t>(k, hi - lo);
      if (kk > 0) topk_run<DT, false, F32>(x.row(r), lo, hi, kk, Chain{}, keys, &parts[t]);
    });
  });
  out.assign(x.rows, {});
  for (int64_t r = 0; r < x.rows; ++r)
    for (int64_t c = 0; c < runs; ++c)
      out[r].insert(out[r].end(), parts[r * runs + c].begin(), parts[r * runs + c].end());
}

// each row's (m, s, first); m in the compared (f32) domain
void softmax_rows(const Rows& x, const Chain& ch, float* m, double* s, int64_t* first) {
  std::vector<SoftPart> parts(x.rows * std::max<int64_t>(1, at::get_num_threads()));
  const int64_t runs = DISPATCH_DT(x.dt, [&] {
    return for_runs(x.rows, x.n, [&](int64_t t, int64_t r, int64_t lo, int64_t hi) {
      parts[t] = ch.n ? softmax_run<DT, true>(x.row(r), lo, hi, ch)
                      : softmax_run<DT, false>(x.row(r), lo, hi, ch);
    });
  });
  for (int64_t r = 0; r < x.rows; ++r) {
    SoftPart best = parts[r * runs];
    bool nan = best.m != best.m;
    for (int64_t c = 1; c < runs && !nan; ++c) {
      const SoftPart& p = parts[r * runs + c];
      if (p.m != p.m) { best = p; nan = true; }
      else if (p.m > best.m) best.m = p.m, best.first = p.first;
    }
    double total = best.s;
    if (!nan && runs > 1) {
      const float M = best.m;
      if (M == kInf) total = kInf;
      else if (M == -kInf) total = 0.0;
      else {
        total = 0.0;
        for (int64_t c = 0; c < runs; ++c) {
          const SoftPart& p = parts[r * runs + c];
          if (p.m != -kInf) total += p.s * std::exp((double)p.m - (double)M);
        }
      }
    }
    m[r] = best.m;
    s[r] = total;
    first[r] = best.first;
  }
}

}  // namespace commfold_scan
