// Batched draft decode attention on CPU: every row and KV head of one draft forward's layer in
// one parallel region (``ops/cpu_draft_decode.py`` says why and how it is built).
//
// Per work item (row b, KV head h), for its G = H_q / H_kv query heads, in float32:
//
//   pass 1   logits[j][t] = scale * <q[b, h*G + j], K[h, t]>      one read of K[h]
//   pass 2   p[j][t] = exp(logits[j][t] - max_j) / sum_j           (in place, scalar)
//   pass 3   out[b, h*G + j] = sum_t p[j][t] * V[h, t]            one read of V[h]
//
// The views are read where they lie: keys[b] / values[b] are [H_kv, T_b, D] with a unit stride
// on D and a stride of D on T (a compressed cache's buffer, sliced to its view and chain); the
// head stride is free.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_view(const at::Tensor& t, int64_t heads, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              name, ": a float32 CPU tensor is required");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == heads && t.size(2) == dim,
              name, ": [H_kv, T, D] expected, got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == dim),
              name, ": the token rows must be contiguous (strides [*, D, 1])");
}

}  // namespace

void draft_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values, at::Tensor& out, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.is_contiguous(), "q: a contiguous float32 CPU tensor [B, H_q, D] is required");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(values.size()) == B,
              "one keys and one values view per row of q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: a contiguous float32 tensor shaped like q");
  if (B == 0) return;
  const int64_t Hkv = keys[0].size(0);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "H_q must be a multiple of H_kv");
  for (int64_t b = 0; b < B; ++b) {
    check_view(keys[b], Hkv, D, "keys");
    check_view(values[b], Hkv, D, "values");
    TORCH_CHECK(keys[b].size(1) == values[b].size(1), "keys and values differ in length");
  }
  const int64_t G = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits, acc(G * D), mx(G), sum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t T = keys[b].size(1);
      const float* qh = qp + (b * Hq + h * G) * D;
      float* oh = op + (b * Hq + h * G) * D;
      if (T == 0) {  // nothing to attend over: zeros, as the reference gives
        std::fill(oh, oh + G * D, 0.f);
        continue;
      }
      const float* kp = keys[b].data_ptr<float>() + h * keys[b].stride(0);
      const float* vp = values[b].data_ptr<float>() + h * values[b].stride(0);
      logits.resize(G * T);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t t = 0; t < T; ++t) {
        const float* kt = kp + t * D;
        for (int64_t j = 0; j < G; ++j) {
          const float* qj = qh + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qj[d] * kt[d];
          dot *= s;
          logits[j * T + t] = dot;
          mx[j] = std::max(mx[j], dot);
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        float* lj = logits.data() + j * T;
        float total = 0.f;
        for (int64_t t = 0; t < T; ++t) {
          lj[t] = std::exp(lj[t] - mx[j]);
          total += lj[t];
        }
        sum[j] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float* vt = vp + t * D;
        for (int64_t j = 0; j < G; ++j) {
          const float p = logits[j * T + t];
          float* aj = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) aj[d] += p * vt[d];
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        const float inv = 1.f / sum[j];
        for (int64_t d = 0; d < D; ++d) oh[j * D + d] = acc[j * D + d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draft_decode", &draft_decode,
        "Batched one-query decode attention of every row over its own KV view (float32, CPU)");
}
