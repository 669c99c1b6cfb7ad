// Batched draft decode attention on CPU: every row and KV head of one draft forward's layer in
// one parallel region (``ops/cpu_draft_decode.py`` says why and how it is built).
//
// Row b attends over its view: an optional KIVI-packed body (the oldest tokens, read as packed
// codes, never dequantized into a tensor), then float32 tokens (a dropper's kept tokens, or a
// quantized body's full-precision residual and window, then the draft chain):
//
//   tokens of row b   | packed body: n_q tokens | float32: T_f tokens |
//   logits column     0                        n_q                  n_q + T_f
//
// The float32 tokens are a dense row's columns 0 .. T_f - 1 of keys[b] and values[b], or an
// indexed row's columns index[b][0 .. T_f - 1] (paged attention with pages of one token): a view
// kept as slots of SGLang's KV pool is read there, in the order its index gives, with no gather:
//
//   pool buffer       [S, H_kv, D] float32 (slot-major), keys[b] = buffer.transpose(0, 1)
//                     = [H_kv, S, D], strides [D, H_kv * D, 1]
//   index[b]          [T_f] int64: s_0, s_1, ..., s_{T_f - 1}   (any order, each < S)
//   float token t     keys[b][h, s_t], values[b][h, s_t]        at base + s_t * token stride
//
// Per work item (row b, KV head h), for its G = H_q / H_kv query heads, in float32:
//
//   pass 1   logits[j][t] = scale * <q[b, h*G + j], K[h, t]>      one read of K[h]
//   pass 2   p[j][t] = exp(logits[j][t] - max_j) / sum_j           (in place, scalar)
//   pass 3   out[b, h*G + j] = sum_t p[j][t] * V[h, t]            one read of V[h]
//
// A packed key of group g is code * ks[g] + kz[g] per channel, so its logit is
// <q * ks[g], code> + <q, kz[g]>: q is scaled once per group, each token costs its codes only.
// A packed value is code * vs[t] + vz[t] per token, so pass 3 adds p * vs[t] * code and, once
// per head, sum_t p * vz[t].
//
// Float tokens are read where they lie: [H_kv, T, D] with a unit stride on D, the token and head
// strides free (a compressed cache's buffer sliced to its view and chain, or a pool's slot-major
// buffer transposed, whose tokens are H_kv * D apart); an index is bounds-checked once per row
// against T, so a bad slot raises instead of reading outside the buffer. A packed body is a
// KiviBlock's tensors or pages of the pool (``packed_body.h``).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "packed_body.h"

namespace {

using vericache::PackedBody;
using vericache::packed_body;

void check_view(const at::Tensor& t, int64_t heads, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              name, ": a float32 CPU tensor is required");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == heads && t.size(2) == dim,
              name, ": [H_kv, T, D] expected, got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1, name,
              ": each token's channels must be contiguous (strides [*, *, 1])");
}

// One row's float32 tokens: where keys and values lie, and which of their columns are read.
struct FloatView {
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t key_head = 0, value_head = 0, key_token = 0, value_token = 0;
  int64_t n = 0;                   // tokens attended: T, or the index's length
  const int64_t* index = nullptr;  // null: columns 0 .. n - 1; else columns index[0 .. n - 1]
};

FloatView float_view(const at::Tensor& keys, const at::Tensor& values,
                     const std::optional<at::Tensor>& index) {
  FloatView view;
  view.keys = keys.data_ptr<float>();
  view.values = values.data_ptr<float>();
  view.key_head = keys.stride(0);
  view.value_head = values.stride(0);
  view.key_token = keys.stride(1);
  view.value_token = values.stride(1);
  view.n = keys.size(1);
  if (!index.has_value()) return view;
  const at::Tensor& idx = *index;
  TORCH_CHECK(idx.device().is_cpu() && idx.scalar_type() == at::kLong && idx.dim() == 1 &&
                  idx.is_contiguous(), "index: a contiguous 1-D int64 CPU tensor is required");
  view.n = idx.numel();
  view.index = idx.data_ptr<int64_t>();
  if (view.n == 0) return view;
  // Once per row, here, so the parallel region reads no slot it was not checked for.
  const auto [lo, hi] = std::minmax_element(view.index, view.index + view.n);
  TORCH_CHECK(*lo >= 0 && *hi < keys.size(1), "index: slots must lie in [0, ", keys.size(1),
              "), got [", *lo, ", ", *hi, "]");
  return view;
}

// Packed channels are read slot-major: byte k of a token holds channels k * PER + s for its
// PER = 8 / bits slots s (low bits first, ``compress/packing.pack_bits``), so channel
// k * PER + s is kept at s * K + k (K = D / PER). Each slot then unpacks as one shift and mask
// over K contiguous bytes, which vectorizes; the query (times the key scale) is permuted to
// match once per key group, and the value sums are permuted back once per item.
template <int BITS>
inline void unpack(const uint8_t* src, float* dst, int64_t D) {
  constexpr int PER = 8 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int64_t K = D / PER;
  for (int s = 0; s < PER; ++s) {
    float* out = dst + s * K;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<float>((src[k] >> (s * BITS)) & MASK);
  }
}

template <int BITS>
inline int64_t slot_major(int64_t d, int64_t D) {  // channel d's place in an unpacked token
  constexpr int PER = 8 / BITS;
  return (d % PER) * (D / PER) + d / PER;
}

// Scratch of one work item, reused across the items a thread runs.
struct Scratch {
  std::vector<float> logits, acc, mx, sum, qs, qz, codes, zacc, vs, vz;
  Scratch(int64_t G, int64_t D, int64_t group)
      : acc(G * D), mx(G), sum(G), qs(G * D), qz(G), codes(D), zacc(G), vs(group), vz(group) {}
};

// pass 1 over a packed body: logits[j * T + t] for t < body.n
template <int BITS>
void score_packed(const PackedBody& body, int64_t h, const float* qh, int64_t G, int64_t D,
                  int64_t group, int64_t T, float s, Scratch& w) {
  for (int64_t g = 0; g < body.n / group; ++g) {
    const float* ksg = body.ks(g, h);
    const float* kzg = body.kz(g, h);
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = qh + j * D;
      float* qsj = w.qs.data() + j * D;
      float z = 0.f;
#pragma omp simd reduction(+ : z)
      for (int64_t d = 0; d < D; ++d) z += qj[d] * kzg[d];
      for (int64_t d = 0; d < D; ++d) qsj[slot_major<BITS>(d, D)] = s * qj[d] * ksg[d];
      w.qz[j] = s * z;
    }
    body.key_codes(g, h, [&](int64_t t, const uint8_t* codes) {
      unpack<BITS>(codes, w.codes.data(), D);
      const float* c = w.codes.data();
      for (int64_t j = 0; j < G; ++j) {
        const float* qsj = w.qs.data() + j * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qsj[d] * c[d];
        dot += w.qz[j];
        w.logits[j * T + t] = dot;
        w.mx[j] = std::max(w.mx[j], dot);
      }
    });
  }
}

// pass 3 over a packed body: acc[j] += sum_{t < body.n} p[j][t] * V[t]
template <int BITS>
void accumulate_packed(const PackedBody& body, int64_t h, int64_t G, int64_t D, int64_t T,
                       Scratch& w) {
  std::fill(w.zacc.begin(), w.zacc.end(), 0.f);
  for (int64_t g = 0; g < body.n / body.group; ++g) {
    body.value_scales(g, h, w.vs.data(), w.vz.data());
    body.value_codes(g, h, [&](int64_t t, const uint8_t* codes) {
      unpack<BITS>(codes, w.codes.data(), D);
      const float* c = w.codes.data();
      const float vs = w.vs[t - g * body.group], vz = w.vz[t - g * body.group];
      for (int64_t j = 0; j < G; ++j) {
        const float p = w.logits[j * T + t];
        const float pv = p * vs;
        w.zacc[j] += p * vz;
        float* aj = w.acc.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) aj[d] += pv * c[d];
      }
    });
  }
  for (int64_t j = 0; j < G; ++j) {  // back to channel order, the zeros' sum added
    float* aj = w.acc.data() + j * D;
    std::copy(aj, aj + D, w.codes.data());
    for (int64_t d = 0; d < D; ++d) aj[d] = w.codes[slot_major<BITS>(d, D)] + w.zacc[j];
  }
}

// Scattered tokens (an index's slots, or a pool's run whose tokens are H_kv * D floats apart) are
// reads the hardware prefetcher does not follow: each token's lines are requested AHEAD tokens
// before they are read, so their fetches overlap the arithmetic on the tokens before them.
// Measured (8 rows x 6k tokens, H_kv 3, D 64, 2 cores): without it a pool's run of slots took 3x
// the time of contiguous tokens and random slots 4.4x; with it, 1x and 1.6x. 16 ahead: no better.
constexpr int64_t AHEAD = 8;

inline void prefetch_token(const float* p, int64_t D) {
  for (int64_t d = 0; d < D; d += 64 / sizeof(float)) __builtin_prefetch(p + d);
}

template <int BITS>
void attend_item(const PackedBody& body, const FloatView& view, const float* qh, float* oh,
                 int64_t h, int64_t G, int64_t D, int64_t group, float s, Scratch& w) {
  const int64_t nq = body.n, Tf = view.n, T = nq + Tf;
  const float* kp = view.keys + h * view.key_head;
  const float* vp = view.values + h * view.value_head;
  const int64_t* idx = view.index;
  const bool scattered = idx || view.key_token != D || view.value_token != D;
  if (T == 0) {  // nothing to attend over: zeros, as the reference gives
    std::fill(oh, oh + G * D, 0.f);
    return;
  }
  w.logits.resize(G * T);
  std::fill(w.mx.begin(), w.mx.end(), -INFINITY);
  if constexpr (BITS > 0) {
    if (nq) score_packed<BITS>(body, h, qh, G, D, group, T, s, w);
  }
  for (int64_t t = 0; t < Tf; ++t) {
    const float* kt = kp + (idx ? idx[t] : t) * view.key_token;
    if (scattered && t + AHEAD < Tf)
      prefetch_token(kp + (idx ? idx[t + AHEAD] : t + AHEAD) * view.key_token, D);
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = qh + j * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qj[d] * kt[d];
      dot *= s;
      w.logits[j * T + nq + t] = dot;
      w.mx[j] = std::max(w.mx[j], dot);
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    float* lj = w.logits.data() + j * T;
    float total = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      lj[t] = std::exp(lj[t] - w.mx[j]);
      total += lj[t];
    }
    w.sum[j] = total;
  }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  if constexpr (BITS > 0) {
    if (nq) accumulate_packed<BITS>(body, h, G, D, T, w);
  }
  for (int64_t t = 0; t < Tf; ++t) {
    const float* vt = vp + (idx ? idx[t] : t) * view.value_token;
    if (scattered && t + AHEAD < Tf)
      prefetch_token(vp + (idx ? idx[t + AHEAD] : t + AHEAD) * view.value_token, D);
    for (int64_t j = 0; j < G; ++j) {
      const float p = w.logits[j * T + nq + t];
      float* aj = w.acc.data() + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) aj[d] += p * vt[d];
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    const float inv = 1.f / w.sum[j];
    for (int64_t d = 0; d < D; ++d) oh[j * D + d] = w.acc[j * D + d] * inv;
  }
}

template <int BITS>
void run_batch(const at::Tensor& q, const std::vector<FloatView>& views,
               const std::vector<PackedBody>& bodies, at::Tensor& out, int64_t Hkv, int64_t group,
               float s) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t G = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w(G, D, std::max<int64_t>(group, 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      attend_item<BITS>(bodies[b], views[b], qp + (b * Hq + h * G) * D, op + (b * Hq + h * G) * D,
                        h, G, D, group, s, w);
    }
  });
}

}  // namespace

// bodies: per row, the six tensors of its packed KIVI body, or none; bits 0 when no row has one.
// index: per row, None (dense: the view's columns in order) or the int64 columns its float tokens
// are; an empty list for an all-dense batch.
void draft_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                  const std::vector<at::Tensor>& values,
                  const std::vector<std::vector<at::Tensor>>& bodies,
                  const std::vector<std::optional<at::Tensor>>& index, int64_t bits,
                  int64_t group, at::Tensor& out, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.is_contiguous(), "q: a contiguous float32 CPU tensor [B, H_q, D] is required");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(values.size()) == B &&
                  static_cast<int64_t>(bodies.size()) == B,
              "one keys view, one values view and one (maybe empty) body per row of q");
  TORCH_CHECK(index.empty() || static_cast<int64_t>(index.size()) == B,
              "index: one entry (maybe None) per row of q, or none at all");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: a contiguous float32 tensor shaped like q");
  TORCH_CHECK(bits == 0 || bits == 2 || bits == 4 || bits == 8, "bits must be 0, 2, 4 or 8");
  if (B == 0) return;
  const int64_t Hkv = keys[0].size(0);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "H_q must be a multiple of H_kv");
  TORCH_CHECK(D % 8 == 0, "head dim must be a multiple of 8");
  std::vector<PackedBody> packed(B);
  std::vector<FloatView> views(B);
  for (int64_t b = 0; b < B; ++b) {
    check_view(keys[b], Hkv, D, "keys");
    check_view(values[b], Hkv, D, "values");
    TORCH_CHECK(keys[b].size(1) == values[b].size(1), "keys and values differ in length");
    views[b] = float_view(keys[b], values[b], index.empty() ? std::nullopt : index[b]);
    TORCH_CHECK(bits > 0 || bodies[b].empty(), "a packed body needs bits 2, 4 or 8");
    if (!bodies[b].empty()) {
      TORCH_CHECK(group > 0, "a packed body needs a key group of at least 1 token");
      packed[b] = packed_body(bodies[b], Hkv, D, bits, group);
    }
  }
  const float s = static_cast<float>(scale);
  switch (bits) {
    case 2: run_batch<2>(q, views, packed, out, Hkv, group, s); break;
    case 4: run_batch<4>(q, views, packed, out, Hkv, group, s); break;
    case 8: run_batch<8>(q, views, packed, out, Hkv, group, s); break;
    default: run_batch<0>(q, views, packed, out, Hkv, group, s); break;
  }
}
