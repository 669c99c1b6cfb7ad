// A row's packed KIVI body as the draft-decode kernel reads it (``draft_decode.cpp``), checked
// once per call: a KiviBlock's tensors, or pages of SGLang's KV pool.
//
// Tensors (``compress/kivi.KiviBlock``): codes [H_kv, n, D * bits / 8] uint8, key scale/zero
// [H_kv, n / group, D], value scale/zero [H_kv, n, 1], float32, each with contiguous tokens.
// Pages (``compress/kivi_pages.py``): the layer's pool buffers [S, H_kv, D] float32 and the page
// slots, group g in slots pages[g * P .. g * P + P - 1], its bytes in order:
//
//   key buffer     scale [H, D] | zero [H, D] | codes [H, G, D * bits / 8]
//   value buffer   codes [H, G, D * bits / 8] | (whole slots) | scale, zero [2, H, G]
//   byte o of a page's string is byte o % slot_bytes of slot pages[g * P + o / slot_bytes]
//
// Head-major, as a KiviBlock: a work item (row, head) reads its head's bytes only, each run of
// them in a slot contiguous. No token's codes or scale straddle two slots (a slot's bytes are a
// multiple of both), so a reader walks each slot as one run of tokens.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace vericache {

inline void check_rows(const at::Tensor& t, c10::ScalarType dtype, int64_t heads,
                       int64_t tokens, int64_t width, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, ": a CPU ", dtype,
              " tensor is required");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == heads && t.size(1) == tokens && t.size(2) == width,
              name, ": [", heads, ", ", tokens, ", ", width, "] expected, got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == width),
              name, ": the token rows must be contiguous");
}

// One row's packed KIVI body, checked: the six tensors of a KiviBlock, or pages of the pool.
// The accessors give token t's (or group g's) parts of head h either way.
struct PackedBody {
  int64_t n = 0;  // tokens
  int64_t group = 1, width = 0, D = 0, Hkv = 0;
  // a KiviBlock's tensors
  const uint8_t* keys = nullptr;
  const float* key_scale = nullptr;
  const float* key_zero = nullptr;
  const uint8_t* values = nullptr;
  const float* value_scale = nullptr;
  const float* value_zero = nullptr;
  int64_t codes_head = 0, kscale_head = 0, vscale_head = 0, vcodes_head = 0;
  // or pages: P = per_group slots a group, slot_bytes a slot, value scales at scales_at
  const uint8_t* key_pool = nullptr;
  const uint8_t* value_pool = nullptr;
  const int64_t* pages = nullptr;
  int64_t slot_bytes = 0, per_group = 0, scales_at = 0;

  inline const float* ks(int64_t g, int64_t h) const {
    return pages ? reinterpret_cast<const float*>(key_pool + pages[g * per_group] * slot_bytes) +
                       h * D
                 : key_scale + h * kscale_head + g * D;
  }
  inline const float* kz(int64_t g, int64_t h) const {
    return pages ? reinterpret_cast<const float*>(key_pool + pages[g * per_group + 1] * slot_bytes) +
                       h * D
                 : key_zero + h * kscale_head + g * D;
  }
  // f(t, codes) for each token t of group g in order, codes: head h's packed bytes.
  template <class F>
  inline void key_codes(int64_t g, int64_t h, F&& f) const {
    if (pages)
      return page_run(key_pool, g, 2 * slot_bytes + h * group * width, width,
                      [&](int64_t i, const uint8_t* p) { f(g * group + i, p); });
    for (int64_t t = g * group; t < (g + 1) * group; ++t) f(t, keys + h * codes_head + t * width);
  }
  template <class F>
  inline void value_codes(int64_t g, int64_t h, F&& f) const {
    if (pages)
      return page_run(value_pool, g, h * group * width, width,
                      [&](int64_t i, const uint8_t* p) { f(g * group + i, p); });
    for (int64_t t = g * group; t < (g + 1) * group; ++t) f(t, values + h * vcodes_head + t * width);
  }
  // Group g's value scales and zeros of head h into vs[0 .. group - 1], vz[...].
  inline void value_scales(int64_t g, int64_t h, float* vs, float* vz) const {
    if (!pages) {
      std::copy_n(value_scale + h * vscale_head + g * group, group, vs);
      std::copy_n(value_zero + h * vscale_head + g * group, group, vz);
      return;
    }
    const auto load = [](float* dst) {
      return [dst](int64_t i, const uint8_t* p) { std::memcpy(dst + i, p, sizeof(float)); };
    };
    page_run(value_pool, g, scales_at + h * group * 4, 4, load(vs));
    page_run(value_pool, g, scales_at + (Hkv + h) * group * 4, 4, load(vz));
  }
  // f(i, p) for i < group, p: bytes start + i * unit of group g's page string. A slot holds
  // whole units (slot_bytes % unit == 0), so each slot is one run: a division per slot, not per
  // token.
  template <class F>
  inline void page_run(const uint8_t* pool, int64_t g, int64_t start, int64_t unit, F&& f) const {
    const int64_t* slots = pages + g * per_group;
    const int64_t sb = slot_bytes, count = group;  // locals: f's stores cannot change them
    for (int64_t i = 0, o = start; i < count;) {
      const int64_t within = o % sb;
      const uint8_t* run = pool + slots[o / sb] * sb + within;
      const int64_t m = std::min(count - i, (sb - within) / unit);
      for (int64_t k = 0; k < m; ++k) f(i + k, run + k * unit);
      i += m, o += m * unit;
    }
  }
};

// Pool buffers [S, H_kv, D] float32 and pages [n / group * P] int64 (``KiviPageLayout``).
inline PackedBody paged_body(const std::vector<at::Tensor>& parts, int64_t Hkv, int64_t D,
                             int64_t bits, int64_t group) {
  const at::Tensor &kbuf = parts[0], &vbuf = parts[1], &pages = parts[2];
  for (const at::Tensor* buf : {&kbuf, &vbuf}) {
    TORCH_CHECK(buf->device().is_cpu() && buf->scalar_type() == at::kFloat && buf->dim() == 3 &&
                    buf->size(1) == Hkv && buf->size(2) == D && buf->is_contiguous(),
                "paged body: the pool buffers must be contiguous float32 [S, ", Hkv, ", ", D, "]");
  }
  TORCH_CHECK(pages.device().is_cpu() && pages.scalar_type() == at::kLong && pages.dim() == 1 &&
                  pages.is_contiguous(), "paged body: pages must be a contiguous 1-D int64 tensor");
  PackedBody body;
  body.group = group, body.D = D, body.Hkv = Hkv, body.width = D * bits / 8;
  body.slot_bytes = Hkv * D * 4;
  const int64_t code_slots = (group * Hkv * body.width + body.slot_bytes - 1) / body.slot_bytes;
  const int64_t scale_slots = (group * 2 * Hkv * 4 + body.slot_bytes - 1) / body.slot_bytes;
  body.per_group = std::max(2 + code_slots, code_slots + scale_slots);
  body.scales_at = code_slots * body.slot_bytes;
  TORCH_CHECK(pages.numel() % body.per_group == 0, "paged body: ", pages.numel(),
              " pages is not a whole number of groups of ", body.per_group);
  body.n = pages.numel() / body.per_group * group;
  body.pages = pages.data_ptr<int64_t>();
  if (pages.numel()) {
    const auto [lo, hi] = std::minmax_element(body.pages, body.pages + pages.numel());
    TORCH_CHECK(*lo >= 0 && *hi < kbuf.size(0) && *hi < vbuf.size(0), "paged body: pages must "
                "lie in [0, ", std::min(kbuf.size(0), vbuf.size(0)), "), got [", *lo, ", ", *hi, "]");
  }
  body.key_pool = reinterpret_cast<const uint8_t*>(kbuf.data_ptr<float>());
  body.value_pool = reinterpret_cast<const uint8_t*>(vbuf.data_ptr<float>());
  return body;
}

inline PackedBody packed_body(const std::vector<at::Tensor>& parts, int64_t Hkv, int64_t D,
                              int64_t bits, int64_t group) {
  PackedBody body;
  if (parts.empty()) return body;
  if (parts.size() == 3) return paged_body(parts, Hkv, D, bits, group);
  TORCH_CHECK(parts.size() == 6, "a packed body is 6 tensors (KiviBlock.stored_tensors()) or "
              "3 (pool key and value buffers, pages)");
  const int64_t n = parts[0].size(1), width = D * bits / 8;
  TORCH_CHECK(n % group == 0, "packed body: ", n, " tokens is not a multiple of group ", group);
  check_rows(parts[0], at::kByte, Hkv, n, width, "packed keys");
  check_rows(parts[1], at::kFloat, Hkv, n / group, D, "key scale");
  check_rows(parts[2], at::kFloat, Hkv, n / group, D, "key zero");
  check_rows(parts[3], at::kByte, Hkv, n, width, "packed values");
  check_rows(parts[4], at::kFloat, Hkv, n, 1, "value scale");
  check_rows(parts[5], at::kFloat, Hkv, n, 1, "value zero");
  TORCH_CHECK(parts[1].strides() == parts[2].strides() && parts[4].strides() == parts[5].strides(),
              "packed body: scales and zeros must share strides");
  body.n = n;
  body.group = group, body.D = D, body.Hkv = Hkv, body.width = width;
  body.keys = parts[0].data_ptr<uint8_t>();
  body.key_scale = parts[1].data_ptr<float>();
  body.key_zero = parts[2].data_ptr<float>();
  body.values = parts[3].data_ptr<uint8_t>();
  body.value_scale = parts[4].data_ptr<float>();
  body.value_zero = parts[5].data_ptr<float>();
  body.codes_head = parts[0].stride(0);
  body.vcodes_head = parts[3].stride(0);
  body.kscale_head = parts[1].stride(0);
  body.vscale_head = parts[4].stride(0);
  return body;
}


}  // namespace vericache
