// Row scans for vLLM's logprobs over a vocab shard (loaded by logprob_scan.py, which
// says why): the entries a heap-based top-k (std::partial_sort: torch.topk on CPU)
// could ever take into its heap - the first k, then every x[j] strictly larger than
// the k-th largest of x[0..j) -, and how many entries have a float32 logprob
// (x - M) - L at least t.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <functional>
#include <vector>

template <typename T>
static void scan_rows(const at::Tensor& x, int64_t n, int64_t k, std::vector<std::vector<int64_t>>& out) {
  const int64_t rows = x.size(0), stride = x.stride(0), col = x.stride(1);
  const T* base = x.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> heap;  // min-heap of the k largest seen so far
    for (int64_t r = begin; r < end; ++r) {
      const T* row = base + r * stride;
      std::vector<int64_t>& found = out[r];
      found.clear();
      heap.clear();
      const int64_t first = std::min(k, n);
      for (int64_t j = 0; j < first; ++j) {
        heap.push_back(static_cast<float>(row[j * col]));
        found.push_back(j);
      }
      std::make_heap(heap.begin(), heap.end(), std::greater<float>());
      if (k == 0) continue;
      for (int64_t j = first; j < n; ++j) {
        const float v = static_cast<float>(row[j * col]);
        if (v > heap.front()) {  // NaN never passes: as in torch.topk, it never enters
          std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
          heap.back() = v;
          std::push_heap(heap.begin(), heap.end(), std::greater<float>());
          found.push_back(j);
        }
      }
    }
  });
}

// x [rows, >= n] (f32 / bf16 / f16): (indices [rows, most] int64 padded with -1,
// counts [rows] int64), the candidates of x[:, :n] in column order.
std::vector<at::Tensor> topk_candidates(const at::Tensor& x, int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "topk_candidates: a 2-D CPU tensor");
  TORCH_CHECK(0 <= n && n <= x.size(1) && k >= 0, "topk_candidates: bad n or k");
  std::vector<std::vector<int64_t>> found(x.size(0));
  switch (x.scalar_type()) {
    case at::kFloat: scan_rows<float>(x, n, k, found); break;
    case at::kBFloat16: scan_rows<c10::BFloat16>(x, n, k, found); break;
    case at::kHalf: scan_rows<c10::Half>(x, n, k, found); break;
    default: TORCH_CHECK(false, "topk_candidates: float32, bfloat16 or float16 only");
  }
  int64_t most = 0;
  for (const auto& f : found) most = std::max<int64_t>(most, f.size());
  at::Tensor idx = at::full({x.size(0), most}, -1, at::kLong);
  at::Tensor counts = at::empty({x.size(0)}, at::kLong);
  auto* ip = idx.data_ptr<int64_t>();
  auto* cp = counts.data_ptr<int64_t>();
  for (size_t r = 0; r < found.size(); ++r) {
    std::copy(found[r].begin(), found[r].end(), ip + r * most);
    cp[r] = static_cast<int64_t>(found[r].size());
  }
  return {idx, counts};
}

template <typename T>
static void count_rows(const at::Tensor& x, int64_t n, const float* M, const float* L,
                       const float* t, int64_t* out) {
  const int64_t rows = x.size(0), stride = x.stride(0), col = x.stride(1);
  const T* base = x.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = base + r * stride;
      const float m = M[r], l = L[r], lim = t[r];
      int64_t count = 0;
      // float arithmetic, rounded at each step as torch's float32 ops round: no
      // -ffast-math, and no multiply for the compiler to contract into an FMA
      for (int64_t j = 0; j < n; ++j) {
        const float d = static_cast<float>(row[j * col]) - m;
        const float lp = d - l;
        count += lp >= lim;
      }
      out[r] = count;
    }
  });
}

// x [rows, >= n]; M, L, t [rows] float32: per row, how many of x[:, :n] have
// (x - M) - L >= t in float32 (vLLM's rank of a token whose logprob is t).
at::Tensor count_logprob_ge(const at::Tensor& x, int64_t n, const at::Tensor& M,
                            const at::Tensor& L, const at::Tensor& t) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && 0 <= n && n <= x.size(1),
              "count_logprob_ge: a 2-D CPU tensor and 0 <= n <= its width");
  for (const auto* v : {&M, &L, &t})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == x.size(0),
                "count_logprob_ge: M, L, t float32 [rows]");
  at::Tensor out = at::empty({x.size(0)}, at::kLong);
  const float *pm = M.data_ptr<float>(), *pl = L.data_ptr<float>(), *pt = t.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: count_rows<float>(x, n, pm, pl, pt, out.data_ptr<int64_t>()); break;
    case at::kBFloat16: count_rows<c10::BFloat16>(x, n, pm, pl, pt, out.data_ptr<int64_t>()); break;
    case at::kHalf: count_rows<c10::Half>(x, n, pm, pl, pt, out.data_ptr<int64_t>()); break;
    default: TORCH_CHECK(false, "count_logprob_ge: float32, bfloat16 or float16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("topk_candidates", &topk_candidates, "heap top-k candidates of each row");
  m.def("count_logprob_ge", &count_logprob_ge, "entries whose float32 logprob is >= t");
}
