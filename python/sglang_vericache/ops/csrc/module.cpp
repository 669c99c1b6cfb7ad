// The CPU attention kernels' Python module (built by ``ops/cpu_kernels.py``).

#include <torch/extension.h>

#include <optional>
#include <vector>

void draft_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values,
                  const std::vector<std::vector<at::Tensor>>& bodies,
                  const std::vector<std::optional<at::Tensor>>& index, int64_t bits,
                  int64_t group, at::Tensor& out, double scale);

void verify_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                   const std::vector<at::Tensor>& values, at::Tensor& out, double scale,
                   int64_t chunks, const std::vector<int64_t>& n);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draft_decode", &draft_decode,
        "Batched one-query decode attention of every row over its own view: an optional packed "
        "KIVI body, then float32 tokens, in order or through a per-row index of slots (CPU)");
  m.def("verify_decode", &verify_decode,
        "Batched verify attention: each row's n_b queries (ragged: [sum n_b, H_q, D]) over its "
        "full KV, causal within the last n_b keys (CPU)");
}
