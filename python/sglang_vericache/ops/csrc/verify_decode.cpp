// Batched verify attention on CPU: every row's n_b queries (its last committed token and its
// drafts) over its full KV, causal within the last n_b keys, in one parallel region per layer
// (``ops/cpu_verify_decode.py`` says why; built with ``draft_decode.cpp``: ``ops/cpu_kernels.py``).
//
// The queries are ragged, as the verify forward computes them (rows drafting less than the
// batch's width have fewer): row b's n_b queries are rows q0_b .. q0_b + n_b - 1 of q
// (q0_b = n_0 + ... + n_{b-1}). Row b's keys and values are [H_kv, T_b, D] (its full KV
// through its last query, where it lies: a host buffer or a gather, any head and token stride,
// unit channel stride); its query i is at position T_b - n_b + i and sees keys 0 .. T_b - n_b + i:
//
//   keys of row b   0 .............................. T_b - n_b | T_b - n_b .... T_b - 1
//   query i         sees every key                             | sees keys <= T_b - n_b + i
//
// A work item is (row b, KV head h, chunk c of its keys): the G * n_b queries of the head's group
// (G = H_q / H_kv) over the chunk, in blocks of BLOCK keys, each block's keys and values read
// once for all of them (from L1, the queries' loops go over the block), with an online softmax:
//
//   per block   s[q][t] = scale * <q, K[t]>  (-inf where masked);  m' = max(m, max_t s[q][t])
//               l = l * exp(m - m') + sum_t exp(s[q][t] - m');   acc = acc * exp(m - m') + ...
//   merge       out[q] = sum_c exp(m_c - m) acc_c / sum_c exp(m_c - m) l_c,  m = max_c m_c
//
// Chunks exist so a small batch still gives every thread work (3 KV heads of one row would keep
// one of two threads idle a third of the time); a row's chunks are merged after the region.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;  // keys per block: 16 KiB of K and of V at D 64 (L1 holds both)

struct RowKV {
  const float* keys;
  const float* values;
  int64_t key_head, value_head, key_token, value_token, T;
};

// Partial result of one item for its Q = G * n queries: max, sum and unnormalized output.
struct Partial {
  std::vector<float> m, l, acc;
  void reset(int64_t Q, int64_t D) {
    m.assign(Q, -INFINITY);
    l.assign(Q, 0.f);
    acc.assign(Q * D, 0.f);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp(x) for 8 floats (Cephes' expf: x = k ln2 + r, a degree-6 polynomial in r, times 2^k;
// within 2 ulp of std::exp). Below -87.3 it returns 0, where std::exp underflows to 0 or a
// denormal: a logit that far below its block's max weighs nothing.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The 8 sums of 8 vectors: out[k] = sum of v[k]'s lanes.
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves of the lanes)
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(lo, hi);
}
#define VERICACHE_AVX2 1
#endif

// s[t] = scale * <q, K[t]> for the nb keys of a block starting at kt (token stride ks).
inline void block_logits(const float* q, const float* kt, int64_t ks, int64_t nb, int64_t D,
                         float scale, float* s) {
  int64_t t = 0;
#ifdef VERICACHE_AVX2
  const __m256 sc = _mm256_set1_ps(scale);
  for (; t + 8 <= nb; t += 8) {
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
      for (int k = 0; k < 8; ++k)
        acc[k] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + (t + k) * ks + d), acc[k]);
    }
    _mm256_storeu_ps(s + t, _mm256_mul_ps(sum8(acc), sc));
  }
#endif
  for (; t < nb; ++t) {
    const float* k = kt + t * ks;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
    s[t] = dot * scale;
  }
}

// s[t] = exp(s[t] - m) for t < nb; returns their sum.
inline float block_exp(float* s, int64_t nb, float m) {
  int64_t t = 0;
  float total = 0.f;
#ifdef VERICACHE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= nb; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, p);
    acc = _mm256_add_ps(acc, p);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float x : lanes) total += x;
#endif
  for (; t < nb; ++t) {
    s[t] = std::exp(s[t] - m);
    total += s[t];
  }
  return total;
}

// a[0 .. D) += sum_t p[t] * V[t] over the nb values of a block starting at vt (stride vs).
inline void block_values(const float* p, const float* vt, int64_t vs, int64_t nb, int64_t D,
                         float* a) {
#ifdef VERICACHE_AVX2
  if (D == 64) {  // the accumulator stays in 8 registers across the block
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_loadu_ps(a + 8 * k);
    for (int64_t t = 0; t < nb; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* v = vt + t * vs;
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * k), acc[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(a + 8 * k, acc[k]);
    return;
  }
#endif
  for (int64_t t = 0; t < nb; ++t) {
    const float pt = p[t];
    const float* v = vt + t * vs;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += pt * v[d];
  }
}

// The largest of s[0 .. nb), nb >= 1: the same float as a scalar scan's (max is exact), taken
// 8 lanes at a time (the whole kernel measured 1.05-1.13x faster at 3-6 queries a row).
inline float block_max(const float* s, int64_t nb) {
  int64_t t = 0;
  float m = -INFINITY;
#ifdef VERICACHE_AVX2
  if (nb >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (t = 8; t + 8 <= nb; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    m = *std::max_element(lanes, lanes + 8);
  }
#endif
  for (; t < nb; ++t) m = std::max(m, s[t]);
  return m;
}

// The n queries of item (b, h) (q: the row's first) are ordered q = i * G + j (query position
// i, head h * G + j).
void attend_chunk(const RowKV& row, const float* q, int64_t h, int64_t n, int64_t G, int64_t D,
                  int64_t Hq, int64_t c0, int64_t c1, float scale, std::vector<float>& s,
                  Partial& part) {
  const int64_t Q = G * n;
  part.reset(Q, D);
  const float* kp = row.keys + h * row.key_head;
  const float* vp = row.values + h * row.value_head;
  for (int64_t b0 = c0; b0 < c1; b0 += BLOCK) {
    const int64_t b1 = std::min(c1, b0 + BLOCK);
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t i = qi / G, j = qi % G;
      const int64_t seen = std::min(b1, row.T - n + i + 1) - b0;  // keys of the block it sees
      float* sq = s.data() + qi * BLOCK;
      if (seen <= 0) {
        std::fill(sq, sq + (b1 - b0), 0.f);
        continue;
      }
      block_logits(q + (i * Hq + h * G + j) * D, kp + b0 * row.key_token, row.key_token, seen,
                   D, scale, sq);
      const float m_new = std::max(part.m[qi], block_max(sq, seen));
      const float alpha = std::exp(part.m[qi] - m_new);  // 0 for its first block
      part.l[qi] = part.l[qi] * alpha + block_exp(sq, seen, m_new);
      std::fill(sq + seen, sq + (b1 - b0), 0.f);
      part.m[qi] = m_new;
      if (alpha != 1.f) {
        float* aq = part.acc.data() + qi * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) aq[d] *= alpha;
      }
    }
    // the block's values, from L1 for every query: only those the query sees. A value past its
    // position may be anything (a caller may pass keys past a row's last query: slots it did
    // not write), and 0 * NaN would be NaN.
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t seen = std::min(b1, row.T - n + qi / G + 1) - b0;
      if (seen > 0)
        block_values(s.data() + qi * BLOCK, vp + b0 * row.value_token, row.value_token, seen, D,
                     part.acc.data() + qi * D);
    }
  }
}

}  // namespace

// q, out: [N, H_q, D] float32, contiguous, N = sum of n; n: per row, its queries; keys[b],
// values[b]: [H_kv, T_b, D] (T_b >= n_b); chunks: most key chunks per (row, head) (1: none split).
void verify_decode(const at::Tensor& q, const std::vector<at::Tensor>& keys,
                   const std::vector<at::Tensor>& values, at::Tensor& out, double scale,
                   int64_t chunks, const std::vector<int64_t>& n) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 &&
                  q.is_contiguous(), "q: a contiguous float32 CPU tensor [N, H_q, D] is required");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: a contiguous float32 tensor shaped like q");
  const int64_t B = static_cast<int64_t>(n.size()), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(values.size()) == B,
              "one query count, one keys view and one values view per row");
  TORCH_CHECK(chunks >= 1, "chunks must be at least 1");
  std::vector<int64_t> first_query(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(n[b] >= 1, "query counts must be at least 1");
    first_query[b + 1] = first_query[b] + n[b];
  }
  TORCH_CHECK(first_query[B] == q.size(0), "q has ", q.size(0), " queries, the counts sum to ",
              first_query[B]);
  if (B == 0) return;
  const int64_t Hkv = keys[0].size(0);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "H_q must be a multiple of H_kv");
  const int64_t G = Hq / Hkv;
  std::vector<RowKV> rows(B);
  std::vector<int64_t> first_item(B + 1, 0), row_chunks(B);
  for (int64_t b = 0; b < B; ++b) {
    for (const at::Tensor* t : {&keys[b], &values[b]}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                      t->size(0) == Hkv && t->size(2) == D && t->stride(2) == 1,
                  "keys/values: float32 CPU [H_kv, T, D] with contiguous channels, got ",
                  t->sizes());
    }
    const int64_t T = keys[b].size(1);
    TORCH_CHECK(values[b].size(1) == T && T >= n[b], "row ", b, ": keys and values need the ",
                "same length, at least the ", n[b], " queries");
    rows[b] = {keys[b].data_ptr<float>(), values[b].data_ptr<float>(), keys[b].stride(0),
               values[b].stride(0), keys[b].stride(1), values[b].stride(1), T};
    row_chunks[b] = std::min<int64_t>(chunks, (T + BLOCK - 1) / BLOCK);
    first_item[b + 1] = first_item[b] + Hkv * row_chunks[b];
  }
  const int64_t items = first_item[B];
  const int64_t widest = *std::max_element(n.begin(), n.end());
  std::vector<Partial> parts(items);
  const float* qp = q.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * widest * BLOCK);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) -
                        first_item.begin() - 1;
      const int64_t local = item - first_item[b], h = local / row_chunks[b];
      const int64_t c = local % row_chunks[b], T = rows[b].T;
      const int64_t per = (T + row_chunks[b] - 1) / row_chunks[b];
      const int64_t c0 = std::min(T, c * per), c1 = std::min(T, c0 + per);
      attend_chunk(rows[b], qp + first_query[b] * Hq * D, h, n[b], G, D, Hq, c0, c1, s, scores,
                   parts[item]);
    }
  });
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv, k = row_chunks[b];
      const int64_t first = first_item[b] + h * k;
      for (int64_t qi = 0; qi < G * n[b]; ++qi) {
        float m = -INFINITY;
        for (int64_t c = 0; c < k; ++c) m = std::max(m, parts[first + c].m[qi]);
        float total = 0.f;
        float* o = op + ((first_query[b] + qi / G) * Hq + h * G + qi % G) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t c = 0; c < k; ++c) {
          const Partial& p = parts[first + c];
          if (p.m[qi] == -INFINITY) continue;
          const float w = std::exp(p.m[qi] - m);
          total += w * p.l[qi];
          const float* a = p.acc.data() + qi * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}
