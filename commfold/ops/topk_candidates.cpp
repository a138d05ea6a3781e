// The entries of each row that a heap-based top-k (std::partial_sort: torch.topk on
// CPU) could ever take into its heap: the first k, then every x[j] strictly larger
// than the k-th largest of x[0..j). Built and loaded by topk_candidates.py (see its
// docstring for why this reproduces torch.topk's order among ties).
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("topk_candidates", &topk_candidates, "heap top-k candidates of each row");
}
