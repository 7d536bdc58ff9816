// Fused CPU kernels for the small stages of a decoder layer, in bf16 activations.
//
// Eager torch runs each stage of a layer (residual add + RMSNorm, rotary + KV store,
// single-query attention over the paged cache, SiLU-and-mul) as 3-15 separate ops,
// each costing 5-15 us of dispatch on a small CPU however few rows it touches: on a
// 135M model that was as much time as all the matmuls of a decode step. Each function
// here does one stage in one call, in float32, rounding to bf16 exactly where the
// torch (Hugging Face) version rounds, so results equal the torch ops up to float32
// summation order (spindle/layers/cpu_kernels.py loads this file; tests compare every
// function with its torch version).
//
// Built once per machine with -march=native and ATen's vector types
// (at::vec::Vectorized, whose exp is the one torch's own kernels use).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using bf16 = at::BFloat16;
using fVec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = fVec::size();
// Rows of x up to which bf16_linear runs its own kernel (a decode step's batch); more
// rows go to torch's GEMM, which blocks for cache and wins there.
constexpr int64_t kBf16DotMaxRows = 32;

// ---------------------------------------------------------------- float helpers

inline void to_float(const bf16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    fVec v;
    at::vec::load_fp32_from_bf16(src + i, v);
    v.store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void from_float(const float* src, bf16* dst, int64_t n) {
  at::vec::convert(src, dst, n);  // round to nearest even, as torch's casts
}

// x rounded to bf16 and back, in place (where the torch version stores a bf16 tensor).
inline void round_bf16(float* x, int64_t n) {
  bf16 lanes[kLanes];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    at::vec::convert(x + i, lanes, kLanes);
    fVec v;
    at::vec::load_fp32_from_bf16(lanes, v);
    v.store(x + i);
  }
  for (; i < n; ++i) x[i] = static_cast<float>(static_cast<bf16>(x[i]));
}

inline float horizontal_sum(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#endif
  float lanes[kLanes];
  v.store(lanes);
  float sum = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) sum += lanes[i];
  return sum;
}

#if defined(__AVX512F__)
// The 16 horizontal sums of v[0..15] in one vector: lane 4k + m holds
// _mm512_reduce_add_ps(v[4m + k]), the same bits (its lanes added in its order: the
// 256-bit halves, the 128-bit quarters, lanes (0, 2) and (1, 3), then those two; IEEE
// addition commutes). About 30 instructions instead of 16 reductions of 8.
inline __m512 horizontal_sums_16(const __m512 (&v)[16]) {
  __m512 h[8], q[4], p[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(q[2 * i]), b = _mm512_castps_pd(q[2 * i + 1]);
    p[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(fVec::loadu(a + i), fVec::loadu(b + i), acc);
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline float sum_of_squares(const float* a, int64_t n) { return dot(a, a, n); }

// y[i] += w * x[i]
inline void axpy(float w, const float* x, float* y, int64_t n) {
  fVec wv(w);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) at::vec::fmadd(wv, fVec::loadu(x + i), fVec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += w * x[i];
}

inline float max_of(const float* x, int64_t n) {
  fVec top(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = at::vec::maximum(top, fVec::loadu(x + i));
  float lanes[kLanes];
  top.store(lanes);
  float best = *std::max_element(lanes, lanes + kLanes);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// out[0:d] = sum_j w[j] * rows[j * d : (j + 1) * d], 64 columns at a time in registers.
inline void weighted_sum(const float* w, const float* rows, int64_t n, int64_t d, float* out) {
  constexpr int64_t kTile = 4 * kLanes;
  int64_t c = 0;
  for (; c + kTile <= d; c += kTile) {
    fVec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const fVec wj(w[j]);
      const float* r = rows + j * d + c;
      a0 = at::vec::fmadd(wj, fVec::loadu(r), a0);
      a1 = at::vec::fmadd(wj, fVec::loadu(r + kLanes), a1);
      a2 = at::vec::fmadd(wj, fVec::loadu(r + 2 * kLanes), a2);
      a3 = at::vec::fmadd(wj, fVec::loadu(r + 3 * kLanes), a3);
    }
    a0.store(out + c);
    a1.store(out + c + kLanes);
    a2.store(out + c + 2 * kLanes);
    a3.store(out + c + 3 * kLanes);
  }
  if (c < d) {
    std::fill(out + c, out + d, 0.0f);
    for (int64_t j = 0; j < n; ++j) axpy(w[j], rows + j * d + c, out + c, d - c);
  }
}

// x[i] = exp(x[i] - shift), returning the sum (softmax's numerator and denominator).
inline float exp_shifted(float* x, float shift, int64_t n) {
  fVec sv(shift), acc(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    fVec e = (fVec::loadu(x + i) - sv).exp();
    e.store(x + i);
    acc = acc + e;
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// Rows of at most `work` elements each: enough per task that a thread's start-up cost
// (a few microseconds) pays off.
// An A/B switch of a kernel: on unless the environment variable is "0".
// An on/off switch from the environment, on when unset: "0" or "1", anything else refused
// by name (spindle/switches.py's rule).
inline bool env_switch_on(const char* name) {
  const char* flag = std::getenv(name);
  if (flag == nullptr) return true;
  const std::string value(flag);
  TORCH_CHECK_VALUE(value == "0" || value == "1", name, " must be 0 or 1, got '", value, "'");
  return value == "1";
}

inline int64_t grain_rows(int64_t row_elems, int64_t work = 1 << 14) {
  return std::max<int64_t>(1, work / std::max<int64_t>(1, row_elems));
}

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
}

// ---------------------------------------------------------------- RMSNorm

// HF's LlamaRMSNorm on one row h (float32, already the bf16 input's values):
// h * rsqrt(mean(h^2) + eps), rounded to bf16, times the weight, rounded again.
inline void rms_norm_row(float* h, const float* w, bf16* out, int64_t n, float eps) {
  float inv = 1.0f / std::sqrt(sum_of_squares(h, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<float>(static_cast<bf16>(h[i] * inv)) * w[i];
  from_float(h, out, n);
}

// x [T, H] (rows may be strided) -> out [T, H]; with residual: the row is first
// residual + x, which is also returned: rounded to bf16 for a bf16 residual (as torch
// adds), kept in float32 for a float32 one (the float32 residual stream, norm.py).
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight,
                                    double eps, const c10::optional<torch::Tensor>& residual) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "weight must be [H] contiguous");
  auto out = torch::empty({rows, n}, x.options());
  torch::Tensor new_residual;
  const bool has_res = residual.has_value();
  bool f32_res = false;
  int64_t res_stride = 0;
  if (has_res) {
    f32_res = residual->scalar_type() == at::kFloat;
    TORCH_CHECK(f32_res || residual->scalar_type() == at::kBFloat16,
                "residual must be bfloat16 or float32, got ", residual->scalar_type());
    TORCH_CHECK(residual->device().is_cpu(), "residual must be a CPU tensor");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1,
                "residual must be [T, H] like x");
    new_residual = torch::empty({rows, n}, residual->options());
    res_stride = residual->stride(0);
  }
  const bf16* xp = x.data_ptr<bf16>();
  const int64_t x_stride = x.stride(0);
  std::vector<float> w(n);
  to_float(weight.data_ptr<bf16>(), w.data(), n);
  bf16* op = out.data_ptr<bf16>();
  // The residual in and out: float32 or bf16 rows (by f32_res).
  const void* res_in = has_res ? residual->data_ptr() : nullptr;
  void* res_out = has_res ? new_residual.data_ptr() : nullptr;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n), r(n);
    for (int64_t row = begin; row < end; ++row) {
      to_float(xp + row * x_stride, h.data(), n);
      if (has_res && f32_res) {
        const float* rr = static_cast<const float*>(res_in) + row * res_stride;
        float* out_res = static_cast<float*>(res_out) + row * n;
        for (int64_t i = 0; i < n; ++i) out_res[i] = h[i] = h[i] + rr[i];
      } else if (has_res) {
        to_float(static_cast<const bf16*>(res_in) + row * res_stride, r.data(), n);
        for (int64_t i = 0; i < n; ++i) h[i] += r[i];
        round_bf16(h.data(), n);
        from_float(h.data(), static_cast<bf16*>(res_out) + row * n, n);
      }
      rms_norm_row(h.data(), w.data(), op + row * n, n, static_cast<float>(eps));
    }
  });
  if (has_res) return {out, new_residual};
  return {out};
}

// ---------------------------------------------------------------- SiLU and mul

// x [T, 2F] = [gate | up] -> silu(gate) * up [T, F]; silu as torch computes it
// (x / (1 + exp(-x)) in float32), rounded to bf16 before the product.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [T, 2F] with contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1) / 2, x_stride = x.stride(0);
  auto out = torch::empty({rows, width}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // Split along the features too: one row is the whole step at batch 1.
  const int64_t chunk = std::min<int64_t>(width, 512);
  const int64_t chunks_per_row = (width + chunk - 1) / chunk;
  at::parallel_for(0, rows * chunks_per_row, grain_rows(chunk), [&](int64_t begin, int64_t end) {
    std::vector<float> g(chunk), u(chunk);
    const fVec one(1.0f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks_per_row, start = (task % chunks_per_row) * chunk;
      const int64_t n = std::min(chunk, width - start);
      to_float(xp + row * x_stride + start, g.data(), n);
      to_float(xp + row * x_stride + width + start, u.data(), n);
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        fVec v = fVec::loadu(g.data() + i);
        (v / (one + v.neg().exp())).store(g.data() + i);
      }
      for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i]));
      round_bf16(g.data(), n);
      for (int64_t j = 0; j < n; ++j) g[j] *= u[j];
      from_float(g.data(), op + row * width + start, n);
    }
  });
  return out;
}

// ---------------------------------------------------------------- q/k norm + rotary + KV store

struct HeadRows {
  bf16* base;
  int64_t token_stride, head_stride, heads;
};

HeadRows head_rows(const torch::Tensor& t, const char* name) {
  check_bf16(t, name);
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [T, heads, D] with contiguous heads");
  return {t.data_ptr<bf16>(), t.stride(0), t.stride(1), t.size(1)};
}

// One head in place: optional per-head RMSNorm (weight w), then the neox rotary
// embedding with the token's bf16-rounded cos/sin: x * cos + rotate_half(x) * sin,
// each product rounded to bf16, then the sum (as apply_rotary in torch).
inline void norm_rope_head(bf16* head, const float* w, const float* cos, const float* sin,
                           float* x, float* y, int64_t d, float eps) {
  to_float(head, x, d);
  if (w != nullptr) {
    float inv = 1.0f / std::sqrt(sum_of_squares(x, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) x[i] = static_cast<float>(static_cast<bf16>(x[i] * inv)) * w[i];
    round_bf16(x, d);
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    y[i] = -x[i + half] * sin[i];
    y[i + half] = x[i] * sin[i + half];
  }
  round_bf16(y, d);
  for (int64_t i = 0; i < d; ++i) x[i] *= cos[i];
  round_bf16(x, d);
  for (int64_t i = 0; i < d; ++i) x[i] += y[i];
  from_float(x, head, d);
}

// In place on q [T, Hq, D] and k [T, Hk, D] (views into the qkv output): per-head RMSNorm
// when weights are given, then the rotary embedding at positions (float32 tables
// [P, D]); with caches (flat [slots, Hk, D]) and slots [T] (int64; < 0: skip) it also
// writes each token's rotated k and its v into its slot.
void qk_norm_rope_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions,
                   const torch::Tensor& cos_cache, const torch::Tensor& sin_cache,
                   const c10::optional<torch::Tensor>& q_weight,
                   const c10::optional<torch::Tensor>& k_weight, double eps,
                   const c10::optional<torch::Tensor>& v,
                   const c10::optional<torch::Tensor>& key_cache,
                   const c10::optional<torch::Tensor>& value_cache,
                   const c10::optional<torch::Tensor>& slots) {
  HeadRows qr = head_rows(q, "q"), kr = head_rows(k, "k");
  const int64_t tokens = q.size(0), d = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == d, "k must be [T, Hk, D] like q");
  TORCH_CHECK(d % 2 == 0, "the rotary embedding needs an even head dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == tokens,
              "positions must be int64 [T]");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
              cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == d &&
              sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin caches must be contiguous float32 [P, D]");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "give both q/k norm weights or none");
  const bool store = key_cache.has_value();
  TORCH_CHECK(store == value_cache.has_value() && store == slots.has_value() && store == v.has_value(),
              "storing needs v, both caches and the slots");
  std::vector<float> qw, kw;
  if (q_weight.has_value()) {
    check_bf16(*q_weight, "q_weight");
    check_bf16(*k_weight, "k_weight");
    TORCH_CHECK(q_weight->numel() == d && k_weight->numel() == d, "q/k norm weights must be [D]");
    qw.resize(d);
    kw.resize(d);
    to_float(q_weight->contiguous().data_ptr<bf16>(), qw.data(), d);
    to_float(k_weight->contiguous().data_ptr<bf16>(), kw.data(), d);
  }
  HeadRows vr{nullptr, 0, 0, 0};
  bf16 *kc = nullptr, *vc = nullptr;
  const int64_t* sp = nullptr;
  int64_t cache_slots = 0;
  if (store) {
    vr = head_rows(*v, "v");
    check_bf16(*key_cache, "key_cache");
    check_bf16(*value_cache, "value_cache");
    TORCH_CHECK(key_cache->is_contiguous() && value_cache->is_contiguous() && key_cache->dim() == 3 &&
                key_cache->size(1) == kr.heads && key_cache->size(2) == d &&
                value_cache->sizes() == key_cache->sizes(),
                "caches must be contiguous [slots, Hk, D]");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->numel() == tokens && slots->is_contiguous(),
                "slots must be int64 [T]");
    kc = key_cache->data_ptr<bf16>();
    vc = value_cache->data_ptr<bf16>();
    sp = slots->data_ptr<int64_t>();
    cache_slots = key_cache->size(0);
  }
  const auto pos_tensor = positions.contiguous();  // (held: a copy when strided)
  const int64_t* pos = pos_tensor.data_ptr<int64_t>();
  const float* cos_base = cos_cache.data_ptr<float>();
  const float* sin_base = sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_cache.size(0);
  const float* qwp = qw.empty() ? nullptr : qw.data();
  const float* kwp = kw.empty() ? nullptr : kw.data();
  const int64_t row = kr.heads * d;
  at::parallel_for(0, tokens, grain_rows((qr.heads + kr.heads) * d * 4), [&](int64_t begin, int64_t end) {
    std::vector<float> cos(d), sin(d), x(d), y(d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "position ", p, " is outside the rotary table");
      std::copy(cos_base + p * d, cos_base + (p + 1) * d, cos.begin());
      std::copy(sin_base + p * d, sin_base + (p + 1) * d, sin.begin());
      round_bf16(cos.data(), d);  // torch casts the tables to the activation dtype
      round_bf16(sin.data(), d);
      for (int64_t h = 0; h < qr.heads; ++h)
        norm_rope_head(qr.base + t * qr.token_stride + h * qr.head_stride, qwp, cos.data(), sin.data(),
                       x.data(), y.data(), d, static_cast<float>(eps));
      for (int64_t h = 0; h < kr.heads; ++h)
        norm_rope_head(kr.base + t * kr.token_stride + h * kr.head_stride, kwp, cos.data(), sin.data(),
                       x.data(), y.data(), d, static_cast<float>(eps));
      if (!store || sp[t] < 0) continue;
      TORCH_CHECK(sp[t] < cache_slots, "slot ", sp[t], " is outside the cache");
      for (int64_t h = 0; h < kr.heads; ++h) {
        std::copy_n(kr.base + t * kr.token_stride + h * kr.head_stride, d, kc + sp[t] * row + h * d);
        std::copy_n(vr.base + t * vr.token_stride + h * vr.head_stride, d, vc + sp[t] * row + h * d);
      }
    }
  });
}

// ---------------------------------------------------------------- decode attention

// scores[g * span + j] = (q_g . k_j) * scale, soft-capped when cap > 0, for the group's
// query rows q [group, d] and the keys [span, d] (float32). The products and sums are
// dot()'s, in its order, so the scores are the same bits; with AVX-512, 16 keys' sums
// come out of one transposing reduction (horizontal_sums_16).
inline void attention_scores(const float* q, const float* keys, int64_t group, int64_t span, int64_t d,
                             float scale, float cap, float* scores) {
  auto finish = [&](float dot_value) {
    float s = dot_value * scale;
    return cap > 0.0f ? std::tanh(s / cap) * cap : s;
  };
  int64_t j0 = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (d % 16 == 0) {
    alignas(64) float sums[16];
    for (; j0 + 16 <= span; j0 += 16)
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c += 16) {
          const __m512 qc = _mm512_loadu_ps(q + g * d + c);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(keys + (j0 + j) * d + c), acc[j]);
        }
        _mm512_store_ps(sums, horizontal_sums_16(acc));
        // Lane 4k + m holds key 4m + k.
        for (int k = 0; k < 4; ++k)
          for (int m = 0; m < 4; ++m) scores[g * span + j0 + 4 * m + k] = finish(sums[4 * k + m]);
      }
  }
#endif
  for (; j0 < span; ++j0)
    for (int64_t g = 0; g < group; ++g) scores[g * span + j0] = finish(dot(q + g * d, keys + j0 * d, d));
}

#if defined(CPU_CAPABILITY_AVX512)
// weighted_sum for NH heads at once (w: NH rows of span weights), d a multiple of 64:
// each row of values is loaded once for the NH heads.
template <int NH>
inline void weighted_heads(const float* w, const float* rows, int64_t span, int64_t d, float* out) {
  for (int64_t c = 0; c < d; c += 64) {
    __m512 a[NH][4];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[h][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; ++j) {
      const float* r = rows + j * d + c;
      const __m512 r0 = _mm512_loadu_ps(r), r1 = _mm512_loadu_ps(r + 16), r2 = _mm512_loadu_ps(r + 32),
                   r3 = _mm512_loadu_ps(r + 48);
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) {
        const __m512 wj = _mm512_set1_ps(w[h * span + j]);
        a[h][0] = _mm512_fmadd_ps(wj, r0, a[h][0]);
        a[h][1] = _mm512_fmadd_ps(wj, r1, a[h][1]);
        a[h][2] = _mm512_fmadd_ps(wj, r2, a[h][2]);
        a[h][3] = _mm512_fmadd_ps(wj, r3, a[h][3]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + h * d + c + 16 * i, a[h][i]);
  }
}
#endif

// out[g * d : (g + 1) * d] = weighted_sum(w + g * span, rows, span, d) for g < group, the
// same bits (each sum runs over j in order, as there); with AVX-512 and d a multiple of
// 64, up to 4 heads at once, so each row of values is loaded once for them rather than
// once per head.
inline void weighted_sums(const float* w, const float* rows, int64_t group, int64_t span, int64_t d,
                          float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (d % 64 == 0) {
    for (int64_t g = 0; g < group; g += 4) {
      const float* wg = w + g * span;
      float* og = out + g * d;
      switch (std::min<int64_t>(4, group - g)) {
        case 4: weighted_heads<4>(wg, rows, span, d, og); break;
        case 3: weighted_heads<3>(wg, rows, span, d, og); break;
        case 2: weighted_heads<2>(wg, rows, span, d, og); break;
        default: weighted_heads<1>(wg, rows, span, d, og); break;
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) weighted_sum(w + g * span, rows, span, d, out + g * d);
}

// One query per request, q [B, H, D] (rows may be strided), over its context in the
// paged caches (flat [slots, Hk, D], block_size tokens per block): request b's keys are
// positions [start, seq_lens[b]), start = seq_len - window when a window is given.
// Scores (q . k) * scale, soft-capped when soft_cap > 0, softmax and the weighted sum of
// the values in float32; out [B, H, D] in bf16. The query heads of one KV head are
// done together, one task per (request, KV head).
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                               const torch::Tensor& seq_lens, int64_t block_size, double scale,
                               int64_t window, double soft_cap) {
  HeadRows qr = head_rows(q, "q");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  check_bf16(key_cache, "key_cache");
  check_bf16(value_cache, "value_cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 3 &&
              key_cache.size(2) == d && value_cache.sizes() == key_cache.sizes(),
              "caches must be contiguous [slots, Hk, D]");
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
              block_tables.size(0) >= batch && block_tables.stride(1) == 1,
              "block_tables must be int32 [>= B, blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() >= batch && seq_lens.is_contiguous(),
              "seq_lens must be int32 [>= B]");
  TORCH_CHECK(block_size > 0, "block_size must be > 0");
  const int64_t group = heads / kv_heads, row = kv_heads * d, slots = key_cache.size(0);
  const int64_t table_stride = block_tables.stride(0), max_blocks = block_tables.size(1);
  auto out = torch::empty({batch, heads, d}, q.options());
  const bf16* kc = key_cache.data_ptr<bf16>();
  const bf16* vc = value_cache.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  bf16* op = out.data_ptr<bf16>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  // A task's positions in the cache: its block table row, [start, len), its head's offset.
  struct TaskRows {
    const int32_t* table = nullptr;
    int64_t start = 0, len = 0, head = 0;
  };
  auto task_rows = [&](int64_t task) {
    const int64_t b = task / kv_heads, len = lens[b];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return TaskRows{tables + b * table_stride, start, len, (task % kv_heads) * d};
  };
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), keys, values, acc(group * d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const TaskRows own = task_rows(task);
      const int64_t len = own.len, start = own.start, span = len - start;
      TORCH_CHECK(len >= 1 && (len + block_size - 1) / block_size <= max_blocks,
                  "seq_len ", len, " does not fit the block table");
      for (int64_t g = 0; g < group; ++g)
        to_float(qr.base + b * qr.token_stride + (kvh * group + g) * qr.head_stride, qf.data() + g * d, d);
      // This head's keys and values of positions [start, len), block by block, as float32.
      // Each position's rows of the next task are asked for (into L2) as this task reads
      // its own: they are 2 x d values per position, scattered over the cache, too short
      // a stream for the hardware prefetchers (16 requests x 85 positions, SmolLM2's
      // heads, the cache not in L3: 1.2-2x faster per layer with them).
      const TaskRows next = task + 1 < end ? task_rows(task + 1) : TaskRows{};
      // (its positions clipped to the table: a bad seq_len is its own task's error)
      const int64_t next_end = std::min(next.len, max_blocks * block_size);
      keys.resize(span * d);
      values.resize(span * d);
      for (int64_t p = start; p < len;) {
        const int64_t block = tables[b * table_stride + p / block_size];
        const int64_t first = p % block_size, n = std::min(block_size - first, len - p);
        TORCH_CHECK(block >= 0 && (block + 1) * block_size <= slots, "block table entry ", block,
                    " is outside the cache");
        for (int64_t i = 0; i < n; ++i) {
          const int64_t j = p - start + i;
          if (next.start + j < next_end) {
            const int64_t np = next.start + j, nblock = next.table[np / block_size];
            if (nblock >= 0 && (nblock + 1) * block_size <= slots) {  // (else: that task's error)
              const int64_t noffset = (nblock * block_size + np % block_size) * row + next.head;
              for (int64_t line = 0; line < d * int64_t(sizeof(bf16)); line += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(kc + noffset) + line, 0, 2);  // (L2)
                __builtin_prefetch(reinterpret_cast<const char*>(vc + noffset) + line, 0, 2);
              }
            }
          }
          const int64_t offset = (block * block_size + first + i) * row + kvh * d;
          to_float(kc + offset, keys.data() + j * d, d);
          to_float(vc + offset, values.data() + j * d, d);
        }
        p += n;
      }
      scores.resize(group * span);
      attention_scores(qf.data(), keys.data(), group, span, d, fscale, cap, scores.data());
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * span;
        const float top = max_of(sg, span);
        const float inv = 1.0f / exp_shifted(sg, top, span);
        for (int64_t j = 0; j < span; ++j) sg[j] *= inv;
      }
      weighted_sums(scores.data(), values.data(), group, span, d, acc.data());
      for (int64_t g = 0; g < group; ++g)
        from_float(acc.data() + g * d, op + (b * heads + kvh * group + g) * d, d);
    }
  });
  return out;
}

// ---------------------------------------------------------------- bf16 GEMM for a few rows

// y [M, N] = x [M, K] @ W^T (+ bias) for bf16 x and W [N, K] as stored (no repacking),
// float32 sums (the bias added in float32) rounded once to bf16, as torch's bf16 linear
// rounds. At the 1-32 rows of a decode step torch's bf16 GEMM is slow on a small CPU
// (SmolLM2's projections on 2 Zen 4 cores: 1 row 4-7x, 16 rows 1.2-1.5x this kernel's
// time, the weight in cache). Here each NB x MB tile of dot products runs along K in
// AVX-512 BF16 pair products (vdpbf16ps: 16 lanes, each adding two products to a
// float32 sum), its NB weight rows read once from memory (fetched ahead) and kept in
// L1 while every MB-row block of x passes over them.
#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
constexpr int64_t kDotChunk = 32;  // bf16 values per 512-bit register

// A span of cache lines to bring into L2 while a tile runs (the weight rows after it).
struct Prefetch {
  const char* first;
  int64_t lines;
};

template <int NB, int MB>
inline void bf16_dot_tile(const bf16* w, const bf16* x, const float* bias, bf16* out, int64_t n0,
                          int64_t m0, int64_t K, int64_t N, Prefetch ahead) {
  // (The loops over nb and mb are unrolled by hand-given pragmas: left rolled, GCC keeps
  // the accumulators in memory and the stores bound the loop.)
  __m512 acc[NB][MB];
#pragma GCC unroll 8
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb) acc[nb][mb] = _mm512_setzero_ps();
  const bf16* wt = w + n0 * K;
  const bf16* xt = x + m0 * K;
  // One chunk of K from k: the NB weight rows' and MB x rows' values (load), then
  // their NB x MB pair products.
  auto chunk = [&](int64_t k, auto load) {
    __m512bh wv[NB], xv[MB];
#pragma GCC unroll 8
    for (int nb = 0; nb < NB; ++nb) wv[nb] = load(wt + nb * K + k);
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb) xv[mb] = load(xt + mb * K + k);
#pragma GCC unroll 8
    for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 8
      for (int mb = 0; mb < MB; ++mb) acc[nb][mb] = _mm512_dpbf16_ps(acc[nb][mb], wv[nb], xv[mb]);
  };
  // The prefetches go out a few per chunk rather than all at once: a burst of them
  // fills the core's queue of misses and stalls the loads of the tile itself.
  const int64_t chunks = std::max<int64_t>(1, K / kDotChunk);
  const int64_t per_chunk = (ahead.lines + chunks - 1) / chunks;
  int64_t line = 0;
  auto prefetch = [&](int64_t count) {
    for (const int64_t stop = std::min(ahead.lines, line + count); line < stop; ++line)
      _mm_prefetch(ahead.first + line * 64, _MM_HINT_T1);
  };
  // Whole chunks with plain loads (all-ones masked loads were slower on Zen 4), then
  // the first K - k values of the last chunk, if any, masked.
  int64_t k = 0;
  for (; k + kDotChunk <= K; k += kDotChunk) {
    prefetch(per_chunk);
    chunk(k, [](const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); });
  }
  prefetch(ahead.lines);
  if (k < K) {
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    chunk(k, [mask](const bf16* p) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); });
  }
#pragma GCC unroll 8
  for (int nb = 0; nb < NB; ++nb)
#pragma GCC unroll 8
    for (int mb = 0; mb < MB; ++mb)
      out[(m0 + mb) * N + n0 + nb] = bf16(_mm512_reduce_add_ps(acc[nb][mb]) + (bias ? bias[n0 + nb] : 0.0f));
}

// Weight rows [begin, end): kDotRows at a time (then one by one), each against all M
// rows of x, kDotCols rows at a time (then the rest).
constexpr int kDotRows = 4, kDotCols = 4;  // 16 accumulators + 8 operands of 32 registers
constexpr int64_t kDotAhead = 8;           // weight rows between a tile and its prefetch

template <int NB>
inline void bf16_dot_rows(const bf16* w, const bf16* x, const float* bias, bf16* out, int64_t n, int64_t M,
                          int64_t K, int64_t N) {
  // The weight rows kDotAhead on are brought into L2 while these run, their lines shared
  // out over the tiles of x. A weight row is a short stream (1-3 KB), too short for the
  // hardware prefetchers: without this the tiles waited on memory and read the weights
  // at about 10 GB/s, half of what the arithmetic could take at 16 rows of x.
  const int64_t lines = n + kDotAhead + NB <= N ? (NB * K * int64_t(sizeof(bf16)) + 63) / 64 : 0;
  const char* next = reinterpret_cast<const char*>(lines > 0 ? w + (n + kDotAhead) * K : w);
  const int64_t tiles = (M + kDotCols - 1) / kDotCols;
  const int64_t per_tile = (lines + tiles - 1) / tiles;
  auto ahead = [&](int64_t tile) {
    const int64_t first = std::min(lines, tile * per_tile);
    return Prefetch{next + first * 64, std::min(lines, first + per_tile) - first};
  };
  int64_t m = 0, tile = 0;
  for (; m + kDotCols <= M; m += kDotCols, ++tile)
    bf16_dot_tile<NB, kDotCols>(w, x, bias, out, n, m, K, N, ahead(tile));
  switch (M - m) {
    case 3: bf16_dot_tile<NB, 3>(w, x, bias, out, n, m, K, N, ahead(tile)); break;
    case 2: bf16_dot_tile<NB, 2>(w, x, bias, out, n, m, K, N, ahead(tile)); break;
    case 1: bf16_dot_tile<NB, 1>(w, x, bias, out, n, m, K, N, ahead(tile)); break;
    default: break;
  }
}

void bf16_dot_gemm(const bf16* w, const bf16* x, const float* bias, bf16* out, int64_t M, int64_t N,
                   int64_t K) {
  constexpr int64_t kTask = 16;  // weight rows per task
  at::parallel_for(0, (N + kTask - 1) / kTask, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(N, end * kTask);
    int64_t n = begin * kTask;
    for (; n + kDotRows <= n1; n += kDotRows) bf16_dot_rows<kDotRows>(w, x, bias, out, n, M, K, N);
    for (; n < n1; ++n) bf16_dot_rows<1>(w, x, bias, out, n, M, K, N);
  });
}
#else
constexpr bool kHaveBf16Dot = false;
void bf16_dot_gemm(const bf16*, const bf16*, const float*, bf16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "this build has no AVX-512 BF16 instructions");
}
#endif

// Whether bf16_linear would run the kernel above for x (rows, dtypes, layout); else it
// calls torch's linear.
bool bf16_dot_applies(const torch::Tensor& x, const torch::Tensor& weight) {
  // SPINDLE_CPU_BF16_GEMM=0: torch's GEMM everywhere (the A/B switch), read once.
  static const bool switched_on = env_switch_on("SPINDLE_CPU_BF16_GEMM");
  return kHaveBf16Dot && switched_on && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kBf16DotMaxRows &&
         x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.is_contiguous() && x.size(1) == weight.size(1) && x.device().is_cpu() &&
         weight.device().is_cpu();
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias) {
  if (!bf16_dot_applies(x, weight)) return at::linear(x, weight, bias);
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  c10::optional<torch::Tensor> bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " values, got ", bias->numel());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  auto out = torch::empty({M, N}, x.options());
  bf16_dot_gemm(weight.data_ptr<bf16>(), xc.data_ptr<bf16>(), bias_f ? bias_f->data_ptr<float>() : nullptr,
                out.data_ptr<bf16>(), M, N, K);
  return out;
}

// ---------------------------------------------------------------- int4 GEMM for a few rows

// y [M, N] = x [M, K] @ W^T in bf16 for W held in torch's packed CPU int4 layout
// (layers/int4.py): w = (q - 8) * s + z for 4-bit codes q, with a bf16 scale s and zero
// z per row and group of 32 along K (scale_zero [K / 32, N, 2]). torch's own kernel
// (_weight_int4pack_mm_for_cpu) takes 6-7x its one-row time at 16 rows; here the codes are
// dequantized once per call and every row of x reuses them. On AVX-512 torch packs
// 64-row blocks one after another, each K-major: byte k * 32 + n % 32 of a block holds
// row n's code at column k, rows 0-31 in the low nibble and 32-63 in the high one.
// Per group the kernel sums (q - 8) * x in AVX-512 BF16 pair products (the codes -8..7
// and the products are exact), then adds s * that sum + z * (the group's sum of x) to
// each row's float32 total, and rounds the total to bf16 once, as torch's kernel
// returns. int4_dot_applies checks the layout once per process against torch's kernel
// (int4_layout_matches_torch) before this runs.
constexpr int64_t kQuantGroup = 32;    // values per scale and offset (layers/int4.py's GROUP)
constexpr int64_t kInt4Block = 64;     // weight rows per packed block (torch on AVX-512)
constexpr int64_t kInt4MaxRows = 32;   // rows of x up to which int4_linear runs its own kernel

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kHaveInt4Dot = true;

// The bf16 bits of q - 8 for q = 0..15 (entries 16-31 unused), a vpermw table.
inline __m512i int4_code_table() {
  alignas(64) uint16_t table[32] = {};
  for (int q = 0; q < 16; ++q) {
    const bf16 v(static_cast<float>(q - 8));
    std::memcpy(&table[q], &v, sizeof(uint16_t));
  }
  return _mm512_load_si512(table);
}

// Codes of 16 rows at columns k and k + 1 as bf16 pairs (row i in lanes 2i, 2i + 1):
// a holds column k's bytes for these rows, b column k + 1's; high: the high nibbles.
inline __m512i int4_pairs(__m128i a, __m128i b, bool high, __m512i table) {
  const __m256i bytes = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
  __m512i codes = _mm512_cvtepu8_epi16(bytes);
  if (high) codes = _mm512_srli_epi16(codes, 4);
  codes = _mm512_and_si512(codes, _mm512_set1_epi16(0x0F));
  return _mm512_permutexvar_epi16(codes, table);
}

// MB rows of x from m0 against one group's code pairs: MB x 4 chains of pair products
// (enough independent sums to keep the dot-product unit busy), then each row's totals
// take s * sum + z * (the group's sum of x).
template <int MB>
inline void int4_rows(const __m512i* pairs, const __m512 (&s)[4], const __m512 (&z)[4], const bf16* x,
                      const float* xsums, float* totals, int64_t m0, int64_t K, int64_t groups, int64_t g) {
  __m512 acc[MB][4];
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; ++mb)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[mb][q] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t kp = 0; kp < kQuantGroup / 2; ++kp) {
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) {
      int32_t word;
      std::memcpy(&word, x + (m0 + mb) * K + g * kQuantGroup + 2 * kp, sizeof(word));
      xv[mb] = (__m512bh)_mm512_set1_epi32(word);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512bh w = (__m512bh)pairs[kp * 4 + q];
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) acc[mb][q] = _mm512_dpbf16_ps(acc[mb][q], w, xv[mb]);
    }
  }
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; ++mb) {
    const __m512 xs = _mm512_set1_ps(xsums[(m0 + mb) * groups + g]);
    float* t = totals + (m0 + mb) * kInt4Block;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512 sum = _mm512_fmadd_ps(s[q], acc[mb][q], _mm512_loadu_ps(t + 16 * q));
      _mm512_storeu_ps(t + 16 * q, _mm512_fmadd_ps(z[q], xs, sum));
    }
  }
}

// One 64-row block against all M rows of x: out rows [m, n0 .. n0 + 64).
inline void int4_block(const uint8_t* block, const bf16* scale_zero, const bf16* x, const float* xsums,
                       bf16* out, int64_t M, int64_t N, int64_t K, int64_t n0, __m512i table,
                       float* totals, __m512i* pairs) {
  const int64_t groups = K / kQuantGroup;
  std::fill(totals, totals + M * kInt4Block, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    // The group's codes as bf16 pairs: [column pair][16-row quarter], once for all rows of x.
    for (int64_t kp = 0; kp < kQuantGroup / 2; ++kp) {
      const uint8_t* col = block + (g * kQuantGroup + 2 * kp) * (kInt4Block / 2);
      const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col));
      const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 16));
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 32));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + 48));
      pairs[kp * 4 + 0] = int4_pairs(a0, b0, false, table);
      pairs[kp * 4 + 1] = int4_pairs(a1, b1, false, table);
      pairs[kp * 4 + 2] = int4_pairs(a0, b0, true, table);
      pairs[kp * 4 + 3] = int4_pairs(a1, b1, true, table);
    }
    // The 64 rows' scales and zeros: bf16 (s, z) pairs, widened to float32.
    __m512 s[4], z[4];
    for (int q = 0; q < 4; ++q) {
      const __m512i sz = _mm512_loadu_si512(scale_zero + (g * N + n0 + 16 * q) * 2);
      s[q] = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
      z[q] = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) int4_rows<4>(pairs, s, z, x, xsums, totals, m, K, groups, g);
    for (; m + 2 <= M; m += 2) int4_rows<2>(pairs, s, z, x, xsums, totals, m, K, groups, g);
    if (m < M) int4_rows<1>(pairs, s, z, x, xsums, totals, m, K, groups, g);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < kInt4Block; ++r) out[m * N + n0 + r] = bf16(totals[m * kInt4Block + r]);
}
#else
constexpr bool kHaveInt4Dot = false;
#endif

torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zero);

// Whether this process's torch packs int4 weights as int4_block reads them: a small
// weight of random codes, unit scales and zeros of one half, and small integer x, so
// every product and sum is exact and both kernels must give the same bits.
bool int4_layout_matches_torch() {
  if (!kHaveInt4Dot) return false;
  const int64_t N = 2 * kInt4Block, K = 2 * kQuantGroup, M = 3;
  auto codes = torch::empty({N, K}, torch::kInt32);
  auto x = torch::empty({M, K}, torch::kFloat);
  uint32_t state = 12345;  // a fixed LCG: the check is the same in every process
  auto next = [&state] { state = state * 1664525u + 1013904223u; return state >> 16; };
  for (int64_t i = 0; i < N * K; ++i) codes.data_ptr<int32_t>()[i] = static_cast<int32_t>(next() % 16);
  for (int64_t i = 0; i < M * K; ++i) x.data_ptr<float>()[i] = static_cast<float>(static_cast<int>(next() % 9) - 4);
  auto scale_zero = torch::empty({K / kQuantGroup, N, 2}, torch::kFloat);
  scale_zero.select(2, 0).fill_(1.0);
  scale_zero.select(2, 1).fill_(0.5);
  const auto packed = at::_convert_weight_to_int4pack_for_cpu(codes, 1);
  const auto xb = x.to(at::kBFloat16);
  const auto sz = scale_zero.to(at::kBFloat16);
  return at::equal(int4_dot(xb, packed, sz), at::_weight_int4pack_mm_for_cpu(xb, packed, 32, sz));
}

// Whether int4_linear runs the kernel above (else torch's): this build has it, switched
// on (SPINDLE_CPU_INT4_GEMM, read once), torch's packing checked once to be the one it
// reads, a few bf16 rows, whole 64-row blocks.
bool int4_dot_applies(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zero) {
  static const bool layout_ok = env_switch_on("SPINDLE_CPU_INT4_GEMM") && int4_layout_matches_torch();
  if (!(layout_ok && x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
        packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
        scale_zero.dim() == 3 && scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous()))
    return false;
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1);
  return M >= 1 && M <= kInt4MaxRows && N % kInt4Block == 0 && K % kQuantGroup == 0 && packed.size(1) * 2 == K &&
         scale_zero.size(0) == K / kQuantGroup && scale_zero.size(1) == N && scale_zero.size(2) == 2;
}

// x [M, K] bf16 @ the packed int4 weight [N, K / 2] -> bf16 [M, N]: the kernel above at
// a decode step's few rows, torch's _weight_int4pack_mm_for_cpu otherwise.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zero) {
  if (!int4_dot_applies(x, packed, scale_zero)) return at::_weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero);
  return int4_dot(x, packed, scale_zero);
}

// The kernel itself, for shapes int4_dot_applies accepts (M >= 1, whole blocks).
torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zero) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  const auto xc = x.contiguous();
  const int64_t M = x.size(0), N = packed.size(0), K = x.size(1), groups = K / kQuantGroup;
  // Each group's sum of x, for the zeros' term (float32, in order).
  auto xsums = torch::empty({M, groups}, x.options().dtype(at::kFloat));
  const bf16* xp = xc.data_ptr<bf16>();
  float* sp = xsums.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t j = 0; j < kQuantGroup; ++j) sum += static_cast<float>(xp[m * K + g * kQuantGroup + j]);
      sp[m * groups + g] = sum;
    }
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const bf16* szp = scale_zero.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const __m512i table = int4_code_table();
  at::parallel_for(0, N / kInt4Block, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> totals(M * kInt4Block);
    alignas(64) __m512i pairs[kQuantGroup / 2 * 4];
    for (int64_t b = begin; b < end; ++b)
      int4_block(wp + b * kInt4Block * (K / 2), szp, xp, sp, op, M, N, K, b * kInt4Block, table, totals.data(),
                 pairs);
  });
  return out;
#else
  return at::_weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero);
#endif
}

// ---------------------------------------------------------------- a whole decoder layer

// One linear layer as the Python side hands it over: (weight, scale_zero, planes, bias).
// With scale_zero: torch's packed int4 weight (layers/int4.py; planes 2: 8-bit codes as
// two nibble planes, the activations repeated to match); without: a dense weight.
using Linear = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, int64_t, c10::optional<torch::Tensor>>;

torch::Tensor linear(const torch::Tensor& x, const Linear& layer) {
  const auto& [weight, scale_zero, planes, bias] = layer;
  if (!scale_zero.has_value()) return bf16_linear(x, weight, bias);
  auto y = int4_linear(planes == 2 ? at::cat({x, x}, 1) : x, weight, *scale_zero);
  return bias.has_value() ? y + *bias : y;
}

// A pre-norm Llama-family layer on a decode step (one new token per request, requests
// in token order), the same operations in the same order as the Python modules run
// them: residual add + input norm, qkv, q/k norm + rotary + KV store, attention, o_proj,
// residual add + post-attention norm, gate_up, SiLU-and-mul, down. Returns (the MLP
// output, the residual), as LlamaDecoderLayer.forward does; one call instead of some
// forty Python-level ones.
std::vector<torch::Tensor> decode_layer(
    const torch::Tensor& hidden, const c10::optional<torch::Tensor>& residual,
    const torch::Tensor& input_norm, const torch::Tensor& post_norm, double eps, const Linear& qkv,
    const Linear& o_proj, const Linear& gate_up, const Linear& down,
    const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
    double qk_eps, const torch::Tensor& positions, const torch::Tensor& cos_cache,
    const torch::Tensor& sin_cache, const torch::Tensor& kv_cache, const torch::Tensor& slots,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == kv_heads &&
              kv_cache.size(4) == head_dim, "kv_cache must be [2, blocks, block_size, Hk, D]");
  const int64_t tokens = hidden.size(0);
  torch::Tensor x, res;
  if (residual.has_value()) {
    auto outs = rms_norm(hidden, input_norm, eps, residual);
    x = outs[0];
    res = outs[1];
  } else {
    x = rms_norm(hidden, input_norm, eps, c10::nullopt)[0];
    res = hidden;
  }
  auto qkv_out = linear(x, qkv);
  auto q = qkv_out.narrow(1, 0, heads * head_dim).view({tokens, heads, head_dim});
  auto k = qkv_out.narrow(1, heads * head_dim, kv_heads * head_dim).view({tokens, kv_heads, head_dim});
  auto v = qkv_out.narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)
               .view({tokens, kv_heads, head_dim});
  auto key_cache = kv_cache[0].view({-1, kv_heads, head_dim});
  auto value_cache = kv_cache[1].view({-1, kv_heads, head_dim});
  qk_norm_rope_(q, k, positions, cos_cache, sin_cache, q_norm, k_norm, qk_eps, v, key_cache, value_cache,
                slots);
  auto attn = decode_attention(q, key_cache, value_cache, block_tables, seq_lens, kv_cache.size(2), scale,
                               window, soft_cap);
  auto after = rms_norm(linear(attn.view({tokens, heads * head_dim}), o_proj), post_norm, eps, res);
  return {linear(silu_and_mul(linear(after[0], gate_up)), down), after[1]};
}

// ---------------------------------------------------------------- int8 group-quantized matmul

// kLanes int8 codes widened to float32 (exact).
inline fVec load_codes(const int8_t* c) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
#else
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(c[i]);
  return fVec::loadu(lanes);
#endif
}

constexpr int64_t kRowBlock = 8;     // rows of x per pass over a tile of the weight
constexpr int64_t kTileN = 64;       // weight rows per task (36 KB of codes at K = 576)
constexpr int64_t kPrefetchRows = 16;  // how far ahead of the rows being read to prefetch

// out[m, n] for the NB weight rows n0.. and the MB rows of x m0..: the NB x MB dot
// products held in registers, each weight vector dequantized once (scale * code +
// offset, one rounding) and multiplied into the MB rows; float32 throughout.
template <int NB, int MB>
inline void group_tile(const int8_t* codes, const float* scale, const float* offset, const float* x,
                       float* out, int64_t n0, int64_t m0, int64_t K, int64_t N) {
  const int64_t groups = K / kQuantGroup;
  fVec acc[NB][MB];
  for (int nb = 0; nb < NB; ++nb)
    for (int mb = 0; mb < MB; ++mb) acc[nb][mb] = fVec(0.0f);
  const int8_t* c = codes + n0 * K;
  const float* xs = x + m0 * K;
  // The rows kPrefetchRows on (contiguous: codes, then scales and offsets) are fetched
  // a share per group: reading NB rows side by side is that many streams, which the
  // hardware prefetchers follow too late.
  const bool fetch = n0 + kPrefetchRows + NB <= N;
  const char* next_codes = reinterpret_cast<const char*>(c + kPrefetchRows * K);
  const int64_t code_lines = fetch ? (NB * K + 63) / 64 : 0;
  const int64_t scale_lines = fetch ? (NB * groups * 4 + 63) / 64 : 0;
  const char* next_scale = reinterpret_cast<const char*>(scale + (n0 + kPrefetchRows) * groups);
  const char* next_offset = reinterpret_cast<const char*>(offset + (n0 + kPrefetchRows) * groups);
  // A share of the lines per group, counted up without dividing in the loop.
  const int64_t code_step = (code_lines + groups - 1) / groups;
  const int64_t scale_step = (scale_lines + groups - 1) / groups;
  int64_t code_line = 0, scale_line = 0;
  for (int64_t g = 0; g < groups; ++g) {
    for (const int64_t stop = std::min(code_lines, code_line + code_step); code_line < stop; ++code_line)
      __builtin_prefetch(next_codes + 64 * code_line);
    for (const int64_t stop = std::min(scale_lines, scale_line + scale_step); scale_line < stop; ++scale_line) {
      __builtin_prefetch(next_scale + 64 * scale_line);
      __builtin_prefetch(next_offset + 64 * scale_line);
    }
    fVec s[NB], o[NB];
    for (int nb = 0; nb < NB; ++nb) {
      s[nb] = fVec(scale[(n0 + nb) * groups + g]);
      o[nb] = fVec(offset[(n0 + nb) * groups + g]);
    }
    for (int64_t j = 0; j < kQuantGroup; j += kLanes) {
      const int64_t k = g * kQuantGroup + j;
      fVec w[NB];
      for (int nb = 0; nb < NB; ++nb) w[nb] = at::vec::fmadd(s[nb], load_codes(c + nb * K + k), o[nb]);
      for (int mb = 0; mb < MB; ++mb) {
        const fVec xv = fVec::loadu(xs + mb * K + k);
        for (int nb = 0; nb < NB; ++nb) acc[nb][mb] = at::vec::fmadd(w[nb], xv, acc[nb][mb]);
      }
    }
  }
  for (int nb = 0; nb < NB; ++nb)
    for (int mb = 0; mb < MB; ++mb) out[(m0 + mb) * N + n0 + nb] = horizontal_sum(acc[nb][mb]);
}

// Weight rows [begin, end) against the MB rows of x from m0: NB rows at a time, then one.
template <int NB, int MB>
inline void group_rows(const int8_t* codes, const float* scale, const float* offset, const float* x,
                       float* out, int64_t begin, int64_t end, int64_t m0, int64_t K, int64_t N) {
  int64_t n = begin;
  for (; n + NB <= end; n += NB) group_tile<NB, MB>(codes, scale, offset, x, out, n, m0, K, N);
  for (; n < end; ++n) group_tile<1, MB>(codes, scale, offset, x, out, n, m0, K, N);
}

// Registers: NB x MB accumulators and NB dequantized weight vectors (32 vector
// registers with AVX-512, 16 with AVX2).
constexpr int tile_rows(int mb) {
  return kLanes >= 16 ? (mb >= 6 ? 2 : mb >= 3 ? 4 : 8) : (mb >= 3 ? 1 : 4);
}

// The tiling of int8_group_matmul and fp8_matmul: the weight's rows in tiles of kTileN
// (the parallel tasks), each tile read once and multiplied by x kRowBlock rows at a time;
// rows(std::integral_constant<int, MB>, n0, n1, m0) does weight rows [n0, n1) against
// x's MB rows from m0.
template <typename RowsFn>
void for_each_tile(int64_t M, int64_t N, const RowsFn& rows) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kTileN, n1 = std::min(N, n0 + kTileN);
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        switch (std::min(kRowBlock, M - m0)) {
#define SPINDLE_ROW_BLOCK(MB) \
  case MB: rows(std::integral_constant<int, MB>(), n0, n1, m0); break;
          SPINDLE_ROW_BLOCK(1)
          SPINDLE_ROW_BLOCK(2)
          SPINDLE_ROW_BLOCK(3)
          SPINDLE_ROW_BLOCK(4)
          SPINDLE_ROW_BLOCK(5)
          SPINDLE_ROW_BLOCK(6)
          SPINDLE_ROW_BLOCK(7)
          SPINDLE_ROW_BLOCK(8)
#undef SPINDLE_ROW_BLOCK
        }
      }
    }
  });
}

// y [M, N] float32 = x [M, K] (float32 or bf16) @ W^T for W [N, K] held as int8 codes
// and a float32 scale and offset per group of 32 along K (w = scale * code + offset:
// layers/int4.py's GroupQuantized): the LM head of a GGUF model, whose logits the
// bf16 int4 kernel rounds to bf16. The weight is split into tiles of kTileN rows (the
// tasks); each tile is read once from memory and multiplied by all of x, kRowBlock rows
// at a time, from cache.
torch::Tensor int8_group_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                                const torch::Tensor& scale, const torch::Tensor& offset) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu() &&
              offset.device().is_cpu(), "int8_group_matmul takes CPU tensors");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % kQuantGroup == 0, "K must be a multiple of ", kQuantGroup);
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == N && t->size(1) == K / kQuantGroup,
                "scale and offset must be contiguous float32 [N, K / 32]");
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  for_each_tile(M, N, [&](auto block, int64_t n0, int64_t n1, int64_t m0) {
    constexpr int MB = decltype(block)::value;
    group_rows<tile_rows(MB), MB>(cp, sp, op, xp, yp, n0, n1, m0, K, N);
  });
  return out;
}

// ---------------------------------------------------------------- float8 weights

// The float32 value of each float8 e4m3fn code (layers/fp8.py's weights): 4 exponent
// bits of bias 7, 3 mantissa bits, subnormals at exponent 0, NaN at S.1111.111.
const float* fp8_e4m3_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int code = 0; code < 256; ++code) {
      const int exponent = (code >> 3) & 15, mantissa = code & 7;
      float v;
      if ((code & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
      else if (exponent == 0) v = std::ldexp(static_cast<float>(mantissa), -9);
      else v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      t[code] = (code & 0x80) ? -v : v;
    }
    return t;
  }();
  return table.data();
}

inline fVec load_fp8(const uint8_t* codes, const float* values) {
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = values[codes[i]];
  return fVec::loadu(lanes);
}

// out[m, n] for the NB weight rows n0.. and the MB rows of x m0..: each weight vector
// widened once from its codes and multiplied into the MB rows. x holds float8 values
// too, so every product is exact in float32; the products are summed in float64, which
// holds the sum exactly for any realistic K (products of two float8 values span
// 2^-18 .. 2^18 with 8-bit significands), and the sum is rounded to float32 once: the
// result does not depend on the order of the sums, the tiling or the thread count.
template <int NB, int MB>
inline void fp8_tile(const uint8_t* codes, const float* values, const float* x, float* out,
                     int64_t n0, int64_t m0, int64_t K, int64_t N) {
  double acc[NB][MB][kLanes] = {};
  float products[kLanes];
  const uint8_t* c = codes + n0 * K;
  const float* xs = x + m0 * K;
  for (int64_t k = 0; k < K; k += kLanes) {
    fVec w[NB];
    for (int nb = 0; nb < NB; ++nb) w[nb] = load_fp8(c + nb * K + k, values);
    for (int mb = 0; mb < MB; ++mb) {
      const fVec xv = fVec::loadu(xs + mb * K + k);
      for (int nb = 0; nb < NB; ++nb) {
        (w[nb] * xv).store(products);
        for (int64_t i = 0; i < kLanes; ++i) acc[nb][mb][i] += products[i];
      }
    }
  }
  for (int nb = 0; nb < NB; ++nb)
    for (int mb = 0; mb < MB; ++mb) {
      double sum = 0.0;
      for (int64_t i = 0; i < kLanes; ++i) sum += acc[nb][mb][i];
      out[(m0 + mb) * N + n0 + nb] = static_cast<float>(sum);
    }
}

template <int NB, int MB>
inline void fp8_rows(const uint8_t* codes, const float* values, const float* x, float* out,
                     int64_t begin, int64_t end, int64_t m0, int64_t K, int64_t N) {
  int64_t n = begin;
  for (; n + NB <= end; n += NB) fp8_tile<NB, MB>(codes, values, x, out, n, m0, K, N);
  for (; n < end; ++n) fp8_tile<1, MB>(codes, values, x, out, n, m0, K, N);
}

// y [M, N] float32 = x [M, K] float32 @ W^T for W [N, K] held as float8 e4m3fn codes
// (uint8), unscaled: layers/fp8.py's CPU product of a few rows, whose x holds values
// already rounded to float8 (so every product is exact and the sums are float32's).
// Tiled as int8_group_matmul (for_each_tile).
torch::Tensor fp8_matmul(const torch::Tensor& x, const torch::Tensor& codes) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "fp8_matmul takes CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K] (float8 e4m3fn bits)");
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(K % kLanes == 0, "K must be a multiple of ", kLanes, ", got ", K);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* values = fp8_e4m3_values();
  float* yp = out.data_ptr<float>();
  for_each_tile(M, N, [&](auto block, int64_t n0, int64_t n1, int64_t m0) {
    constexpr int MB = decltype(block)::value;
    fp8_rows<tile_rows(MB), MB>(cp, values, xp, yp, n0, n1, m0, K, N);
  });
  return out;
}

// ---------------------------------------------------------------- greedy argmax

inline float as_float(float v) { return v; }
inline float as_float(bf16 v) { return static_cast<float>(v); }

// kLanes values of x from x[i], widened to float32.
inline fVec load_lanes(const float* x) { return fVec::loadu(x); }
inline fVec load_lanes(const bf16* x) {
  fVec v;
  at::vec::load_fp32_from_bf16(x, v);
  return v;
}

// The largest value of x[0:n], NaN if x holds one (torch's max semantics).
template <typename T>
inline float max_or_nan(const T* x, int64_t n) {
  fVec top(as_float(x[0]));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = at::vec::maximum(top, load_lanes(x + i));
  float lanes[kLanes];
  top.store(lanes);
  float best = as_float(x[0]);
  for (int64_t l = 0; l < kLanes && !std::isnan(best); ++l) {
    if (std::isnan(lanes[l]) || lanes[l] > best) best = lanes[l];
  }
  for (; i < n && !std::isnan(best); ++i) {
    const float v = as_float(x[i]);
    if (std::isnan(v) || v > best) best = v;
  }
  return best;
}

// The first index where x[i] == target (x[i] is NaN when target is): at most n.
template <typename T>
inline int64_t first_index_of(const T* x, int64_t n, float target) {
  const bool nan = std::isnan(target);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kLanes == 16, "AVX-512: 16 float lanes");
  const __m512 t = _mm512_set1_ps(target);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = load_lanes(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float v = as_float(x[i]);
    if (nan ? std::isnan(v) : v == target) return i;
  }
  return n;
}

// torch.argmax(x, dim=-1) of a float32 or bf16 [B, V] tensor: the index of each row's
// first maximum, or of its first NaN. torch's own CPU argmax carries (value, index)
// pairs through a reduction that does not vectorise (0.7-2 ms for 16 x 49,152 float32
// on this project's 2-core machine, against 45 us for amax); this takes the row's
// maximum with vector max (NaN-propagating), then finds its first position, both in
// cache.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "argmax_rows: x must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "argmax_rows: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, n] with n > 0, got ",
              x.sizes());
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  torch::Tensor out = torch::empty({rows}, x.options().dtype(at::kLong));
  int64_t* idx = out.data_ptr<int64_t>();
  auto run = [&](auto* data) {
    at::parallel_for(0, rows, grain_rows(n, 1 << 15), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto* row = data + r * n;
        idx[r] = first_index_of(row, n, max_or_nan(row, n));
      }
    });
  };
  if (xc.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>());
  } else {
    run(xc.data_ptr<bf16>());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "spindle's fused CPU kernels (bf16): see spindle/layers/cpu_kernels.py";
  m.attr("vector_lanes") = kLanes;
  m.def("rms_norm", &rms_norm, "residual add + RMSNorm", py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("qk_norm_rope_", &qk_norm_rope_, "q/k norm + rotary, in place, + KV store", py::arg("q"),
        py::arg("k"), py::arg("positions"), py::arg("cos_cache"), py::arg("sin_cache"),
        py::arg("q_weight") = py::none(), py::arg("k_weight") = py::none(), py::arg("eps") = 0.0,
        py::arg("v") = py::none(), py::arg("key_cache") = py::none(), py::arg("value_cache") = py::none(),
        py::arg("slots") = py::none());
  m.def("decode_attention", &decode_attention, "single-query attention over the paged cache");
  m.def("decode_layer", &decode_layer, "a Llama-family decoder layer on a decode step");
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias) in bf16, AVX-512 BF16 for a few rows",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("bf16_dot_applies", &bf16_dot_applies, "whether bf16_linear runs its own kernel for x");
  m.def("int4_linear", &int4_linear, "x @ W^T for torch's packed CPU int4 weight, bf16; its own kernel for a few rows");
  m.def("int4_dot_applies", &int4_dot_applies, "whether int4_linear runs its own kernel");
  m.def("int8_group_matmul", &int8_group_matmul,
        "float32 x @ W^T for W as int8 codes with a float32 scale and offset per group of 32");
  m.def("fp8_matmul", &fp8_matmul,
        "float32 x @ W^T for W as float8 e4m3fn codes (uint8), unscaled");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a float32 or bf16 [rows, n] tensor");
}
