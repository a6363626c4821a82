// The linear layers, out[m, n] = dot(x[m], w[n]) scaled + bias[n], for the three ways a weight is stored:
//   linear_f32      float32 weights in float32 arithmetic, exact (bf16 ones widened to float32 the same way, on a
//                   CPU without AVX512-BF16)
//   linear_bf16     bfloat16 weights times the input rounded to bfloat16, products summed in float32: AVX512-BF16's
//                   dot product (vdpbf16ps) where the CPU has it, the weights widened to float32 where not
//   linear_w8a8     int8 weights (a scale per row) times the input quantized to int8 in blocks of 32 columns (a
//                   scale per block, as llama.cpp quantizes activations for Q8_0), each block's products summed
//                   exactly in int32 (AVX512-VNNI's vpdpbusd, or AVX2's vpmaddubsw), then scaled into float32
// All three stream each weight row once for all rows of x: up to 8 rows at a time in registers, more in tiles of 8
// over a run of weight rows that stays in L1. At a small batch a linear layer is a stream of its weights, and the
// point is to read them at the memory's speed; at a large one, to keep the vector units busy: from *_GEMM_MIN_ROWS
// rows, float32, bf16 with AVX512-BF16 and int8 (AVX512-VNNI, or AVX2) are GEMMs over packed panels of weights
// instead (f32_gemm, bf16_gemm, w8a8_gemm), and from a few rows (PACKED_*_MIN_ROWS) where the panels were packed at
// load (pack_gemm_weight), as every linear of a model the engine loads on a CPU is; there bf16 without AVX512-BF16
// is a GEMM too, its pairs widened to float32 (bf16w_gemm).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace wbcpu;

// A thread's weight rows lie end to end, so it reads them as one long stream, and the hardware prefetcher is left to
// follow it: on the AVX-512 EPYC (Zen 4; the model's 121 bf16 linears at one row, 2 threads, same process,
// alternating, 2026-12-03) a software prefetch 4 KiB ahead of every line read 24-25 GB/s, none 33 GB/s, and 42-46 GB/s
// with the weights on huge pages (engine/model/hugepages.py); one prefetch per 4 lines had read slower still. U
// accumulators per input row hide the dot product's latency: at one row two read 35 GB/s where four read 33 and
// eight 31 (same test). From a few rows up a line of weights takes long enough to compute that the stream stalls
// between lines, and a software prefetch PREFETCH bytes ahead pays, into L2 (_MM_HINT_T1), not L1. The likely
// reason: the rows of x live in L1 (5 rows of a 1536-wide input are 30 KiB of its 32), and weights prefetched into
// L1 push them out; into L1 gained nothing where into L2 gained a quarter. The model's 121 linears (same process,
// alternating, median of 7, 2026-12-03), no prefetch / into L1 / into L2, ms:
//   fp32 3 rows 29.9 / - / 23.2; 5 rows 35.7 / 35.7 / 26.8 (40.1 / - / 23.5 in another run); 8 rows 39.8 / 39.8 / 30.8
//   bf16 3 rows 15.4 / - / 12.3; 5 rows 18.4 / 17.9 / 12.6; 8 rows 20.8 / 20.8 / 18.2
//   int8 2-3 rows 7.1-7.8 / - / 8.5-9.5; 5 rows 14.5 / 14.4 / 11.3-14.2
// How far ahead: 2 KiB was the first choice, and 8 KiB ahead reads a quarter faster from two rows up (same method,
// median of 9, 2026-12-03, a slower hour; into L2, no prefetch / 2 / 8 / 16 KiB ahead, ms):
//   fp32 2 rows 30.1 / 25.9 / 24.2 / 21.3; 5 rows 35.3 / 28.9 / 21.5 / 21.3; 8 rows 40.7 / 32.6 / 25.3 / 26.2
//   bf16 2 rows 9.9 / 13.5 / 8.6 / 8.9; 5 rows 18.0 / 15.2 / 11.6 / 12.2; 8 rows 25.7 / 18.9 / 15.7 / 14.9
//   int8 2-3 rows 7.7-7.8 / 8.8-8.9 / 9.0-9.1 / 9.2-9.5; 5 rows 11.2 / 11.4 / 10.7 / 10.0; 8 rows 20.5 / 15.5 / 15.0 / 15.4
//   the AVX2 build, fp32 5 rows 28.7 / 26.2 / 18.7 / 20.3; 8 rows 46.6 / 32.6 / 25.3 / 25.4; bf16 5 rows 21.3 / 19.9
//   / 18.9 / 18.5
// The likely reason: at 5 rows a thread computes a line in about 3 ns, so a line asked for 2 KiB ahead is needed
// some 100 ns later, about one memory latency, and the stream stalls.
// At one row no distance paid clearly (fp32 21.7 / 20.3 / 20.9 / 20.8, bf16 7.4 / 7.7 / 8.5 / 8.4), and int8 is slower
// below 5 rows: each kind says from how many rows it prefetches (PREFETCH_ROWS). A batch-1 EAGLE k=4 verification
// (5 rows) went from 0.85x to 1.14x of no speculation with it (chat prompts, alternating by request).
// Not blocked over weight rows (R rows per load of x, M * R accumulators): the R rows are R streams, and streamed
// from memory that ran level or slower (bf16 at 2 rows 10.8 -> 14.5 ms; fp32 at 5 rows 22.9 -> 24.0, 2026-12-03).
template <int M> constexpr int unroll() { return M <= 4 ? 2 : 1; }
template <typename D, int M> constexpr bool prefetches() { return M >= D::PREFETCH_ROWS; }
constexpr int64_t PREFETCH = 8192;
constexpr int64_t TILE_BYTES = 16 << 10;  // weight rows per run: half of Zen 3's 32 KiB L1d
constexpr int64_t QBLOCK = 32;            // int8 x's columns per scale (quantize_blocks)

// ---- the dot kinds: how a vector of one weight row meets the same columns of a row of x ------------------------
// Each kind has: X (x's elements as prepared), W (the weight's), V (elements per vector step), Acc, zero(), w(p)
// (load weights), step(acc, w, x, lane_scales) (multiply-add), add, reduce, and tail() for columns past the last
// whole vector. lane_scales: Int8Dot's per-lane block scales of x (one float per 4 columns); the others ignore it.

// float32 arithmetic over float32 x: 16 floats where the build has AVX-512 (-march=native), 8 under AVX2.
template <typename W_>
struct FloatDot {
  using X = float;
  using W = W_;
  static constexpr int PREFETCH_ROWS = 2;
#if defined(__AVX512F__)
  using Acc = __m512;
  static constexpr int64_t V = 16;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc w(const float* p) { return _mm512_loadu_ps(p); }
  static Acc w(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static Acc step(Acc a, Acc wv, const float* x, const float*) { return _mm512_fmadd_ps(wv, _mm512_loadu_ps(x), a); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
#else
  using Acc = __m256;
  static constexpr int64_t V = 8;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Acc w(const W* p) { return load8(p); }
  static Acc step(Acc a, Acc wv, const float* x, const float*) { return _mm256_fmadd_ps(wv, _mm256_loadu_ps(x), a); }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float reduce(Acc a) { return hsum(a); }
#endif
  static float tail(const W* w, const float* x, int64_t k, int64_t K, const float*) {
    float s = 0.f;
    for (; k < K; ++k) s += to_float(w[k]) * x[k];
    return s;
  }
};

#if defined(__AVX512BF16__)
// bf16 x bf16 pairs summed into float32 lanes (vdpbf16ps): 32 weights per instruction, x already rounded to bf16.
struct Bf16Dot {
  using X = at::BFloat16;
  using W = at::BFloat16;
  static constexpr int PREFETCH_ROWS = 2;
  using Acc = __m512;
  static constexpr int64_t V = 32;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512i w(const W* p) { return _mm512_loadu_si512(p); }
  static Acc step(Acc a, __m512i wv, const X* x, const float*) {
    return _mm512_dpbf16_ps(a, (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x));
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
  static float tail(const W* w, const X* x, int64_t k, int64_t K, const float*) {
    float s = 0.f;
    for (; k < K; ++k) s += static_cast<float>(w[k]) * static_cast<float>(x[k]);
    return s;
  }
};
#endif

// int8 x int8: each 4 columns' products summed exactly in an int32 lane, which is then scaled by its block's scale
// of x (lane_scales) into a float32 accumulator. OFFSET: what the kind adds to every weight (vpdpbusd multiplies an
// unsigned byte by a signed one, so the weight goes in as w + 128, and the block scales times 128 * sum(x) come off
// after: linear_w8a8's correction).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
struct Int8Dot {
  using X = int8_t;
  using W = int8_t;
  static constexpr int PREFETCH_ROWS = 5;
  using Acc = __m512;
  static constexpr int64_t V = 64;
  static constexpr int32_t OFFSET = 128;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512i w(const W* p) { return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(char(0x80))); }
  // sum += (w + 128) . x over each lane's 4 bytes (w already offset)
  static __m512i dot4(__m512i sum, __m512i wv, __m512i xv) { return _mm512_dpbusd_epi32(sum, wv, xv); }
  static Acc step(Acc a, __m512i wv, const X* x, const float* lane_scales) {
    const __m512i lanes = dot4(_mm512_setzero_si512(), wv, _mm512_loadu_si512(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_loadu_ps(lane_scales), a);
  }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
#else
// AVX2: vpmaddubsw on |x| and w with x's sign (|x|, |w| <= 127, so a pair's sum fits int16), then pairs to int32.
struct Int8Dot {
  using X = int8_t;
  using W = int8_t;
  static constexpr int PREFETCH_ROWS = 5;
  using Acc = __m256;
  static constexpr int64_t V = 32;
  static constexpr int32_t OFFSET = 0;
  static Acc zero() { return _mm256_setzero_ps(); }
  static __m256i w(const W* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // sum += w . x over each lane's 4 bytes
  static __m256i dot4(__m256i sum, __m256i wv, __m256i xv) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
    return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static Acc step(Acc a, __m256i wv, const X* x, const float* lane_scales) {
    const __m256i lanes = dot4(_mm256_setzero_si256(), wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_loadu_ps(lane_scales), a);
  }
  static Acc add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float reduce(Acc a) { return hsum(a); }
#endif
  static float tail(const W* w, const X* x, int64_t k, int64_t K, const float* lane_scales) {
    float s = 0.f;
    for (; k < K; ++k) s += static_cast<float>((static_cast<int32_t>(w[k]) + OFFSET) * x[k]) * lane_scales[k / 4];
    return s;
  }
};

// ---- one weight row against M rows of x, then the tiles ------------------------------------------------------
// ls: the rows' lane scales ([M, LS] floats, LS = lane_stride(K)), or null for the kinds that take none.
constexpr int64_t lane_stride(int64_t K) { return (K + 3) / 4; }

template <typename D, int M>
inline void dot_rows(const typename D::X* x, const float* ls, const typename D::W* wn, float* out, int64_t K) {
  const int64_t LS = lane_stride(K);
  const auto lanes = [&](int m, int64_t k) { return ls ? ls + m * LS + k / 4 : nullptr; };
  constexpr int U = unroll<M>();
  constexpr int64_t V = D::V;
  typename D::Acc acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = D::zero();
  int64_t k = 0;
  for (; k + V * U <= K; k += V * U) {
    for (int u = 0; u < U; ++u) {
      constexpr int64_t BYTES = V * sizeof(typename D::W);  // a vector's weights: a cache line (AVX-512) or half
      if (prefetches<D, M>() && (k + V * u) * static_cast<int64_t>(sizeof(typename D::W)) % 64 < BYTES)
        _mm_prefetch(reinterpret_cast<const char*>(wn + k + V * u) + PREFETCH, _MM_HINT_T1);
      const auto wv = D::w(wn + k + V * u);
      for (int m = 0; m < M; ++m) acc[m][u] = D::step(acc[m][u], wv, x + m * K + k + V * u, lanes(m, k + V * u));
    }
  }
  for (; k + V <= K; k += V) {
    const auto wv = D::w(wn + k);
    for (int m = 0; m < M; ++m) acc[m][0] = D::step(acc[m][0], wv, x + m * K + k, lanes(m, k));
  }
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) acc[m][0] = D::add(acc[m][0], acc[m][u]);
    out[m] = D::reduce(acc[m][0]) + D::tail(wn, x + m * K, k, K, lanes(m, 0));
  }
}

// out[m, n] = epilogue(m, n, dot(x[m], w[n])) over weight rows [n0, n1) of M <= 8 rows of x.
template <typename D, int M, typename E>
void tile_rows(const typename D::X* x, const float* ls, const typename D::W* w, const E& epilogue, int64_t m0,
               int64_t K, int64_t n0, int64_t n1) {
  float s[M];
  for (int64_t n = n0; n < n1; ++n) {
    dot_rows<D, M>(x, ls, w + n * K, s, K);
    for (int m = 0; m < M; ++m) epilogue(m0 + m, n, s[m]);
  }
}

// Threads split the weight rows (whole cache lines of output rows per task); within a thread, tiles of up to 8 rows
// of x over a run of weight rows short enough to stay in L1 (TILE_BYTES): the first tile reads the weights from
// memory, the others from L1, so the weights stream once whatever M is.
template <typename D, typename E>
void linear_tiles(int64_t M, const typename D::X* x, const float* ls, const typename D::W* w, const E& epilogue,
                  int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const int64_t run = std::max<int64_t>(1, TILE_BYTES / (K * static_cast<int64_t>(sizeof(typename D::W))));
    for (int64_t r0 = n0; r0 < n1; r0 += run) {
      const int64_t r1 = std::min(n1, r0 + run);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const auto* xt = x + m0 * K;
        const float* lt = ls ? ls + m0 * lane_stride(K) : nullptr;
        switch (std::min<int64_t>(8, M - m0)) {
#define CASE(m) case m: tile_rows<D, m>(xt, lt, w, epilogue, m0, K, r0, r1); break;
          CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
      }
    }
  });
}

// ---- many rows: a GEMM over packed panels of weights (float32, bf16 and int8) ---------------------------------
// Past a few rows a linear is compute-bound, and the dot form above is then bound by its loads: each dot product
// loads its own vector of x (a tile of 8 rows takes 9 loads for 8 products), and every output ends in a horizontal
// sum. Here a panel of GEMM_NR weight rows is packed into the dot instruction's layout (lane j of vector p holds
// dword p of weight row j: columns 2p, 2p + 1 of bf16 for vdpbf16ps, 4p..4p + 3 of int8 for vpdpbusd), and a tile of
// MR rows of x takes GEMM_NV loads of weights and MR broadcasts of x per MR * GEMM_NV products, summed straight into
// the outputs' lanes. The panels are packed 16 rows by 16 dwords at a time, transposed in registers: once, when the
// model is loaded (pack_gemm_weight, kept beside the weight by engine/model/linear.py's Linear.pack), or by each call
// that is given none. The model's 121 bf16 linears (AVX-512 EPYC, 2 threads, same process, alternating,
// median of 9, 2026-12-03), tiles / this GEMM / oneDNN's bf16 GEMM, ms:
//   16 rows 30.9 / 32.8 / 47.7; 20 rows 42.2 / 36.6 / 51.4; 64 rows 90.9 / 59.4 / 71.8; 512 rows 793 / 433 / 461
// (packed by gathers instead, a 16-row call took 58.9 ms where the tiles took 36.3; packed as here, 29.9 to 30.5).
// A 3072x576 layer at 512 rows runs at 330 GFLOP/s where oneDNN's runs 369. The 121 int8 linears (W8A8, same method),
// tiles / this GEMM: 20 rows 36.5 / 29.7; 64 rows 100.5 / 57.2; 512 rows 831 / 385; a 3072x576 layer at 512 rows runs
// at 410 GOP/s where torch._int_mm (int8 into int32, no scales) runs 756: each block of 32 columns ends in a
// conversion and a multiply-add per output vector, and int32 sums and float32 outputs together fit only 4 x 48.
// AVX2 (an AVX2-only CPU, or the forced build) runs the int8 GEMM 8 lanes wide with vpmaddubsw (Int8Dot's AVX2
// step, 4 instructions where vpdpbusd is one); bf16 there stays on the widening tiles. The AVX2 build on the AVX-512
// EPYC (same method), 121 int8 linears, tiles / GEMM: 17 rows 41.5 / 40.9; 64 rows 140 / 117; 512 rows 1293 / 935.
// From how many rows each kind is a GEMM. With the tiles' prefetch 8 KiB ahead (2026-12-03, same method, tiles /
// this GEMM, ms): bf16 16 rows 29.1 / 36.8, 20 rows 36.8 / 41.1, 24 rows 42.8 / 44.8, 32 rows 55.8 / 53.5; int8 12
// rows 23.0 / 22.8, 16 rows 28.1 / 26.2, 20 rows 34.2 / 28.3.
constexpr int64_t BF16_GEMM_MIN_ROWS = 25;
constexpr int64_t W8A8_GEMM_MIN_ROWS = 17;
constexpr int64_t F32_GEMM_MIN_ROWS = 17;
// Where the weight's panels were packed at load there is no packing to pay for, and the GEMM takes over far sooner:
// the model's 121 linears over panels packed at load (AVX-512 EPYC, 2 threads, same process, alternating, median of
// 9, 2026-12-04), the tiles / this GEMM, ms: float32 1 row 17.7 / 17.5, 2 rows 15.3 / 12.3, 4 rows 19.6 / 17.9, 8 rows
// 22.0 / 21.2, 16 rows 43.5 / 26.1, 24 rows 57.7 / 34.6; bf16 1 row 10.0 / 9.8, 2 rows 10.6 / 9.9, 8 rows 11.2 / 10.1,
// 16 rows 24.6 / 16.5, 24 rows 36.9 / 22.6; int8 1 row 5.8 / 6.1, 2 rows 6.4 / 6.4, 4 rows 8.6 / 7.1, 16 rows 18.8 /
// 12.0. The AVX2 build: float32 2 rows 15.7 / 13.5, 4 rows 15.6 / 18.4 (20.3 / 20.1 in another run), 8 rows 22.9 /
// 24.2, 10 rows 33.5 / 31.1, 16 rows 47.4 / 38.9; int8 1 row 6.1 / 7.3, 2 rows 7.7 / 9.3, 4 rows 11.9 / 11.6 (14.2 /
// 12.9), 8 rows 19.1 / 14.8. One row stays on the tiles (kernels/cpu/ops.py's PACKED_SMALL_M mirrors float32's).
#if defined(__AVX512F__)
constexpr int64_t PACKED_F32_MIN_ROWS = 2;
constexpr int64_t PACKED_BF16_MIN_ROWS = 2;
#else
constexpr int64_t PACKED_F32_MIN_ROWS = 9;
#endif
constexpr int64_t PACKED_W8A8_MIN_ROWS = 4;
// bf16 without AVX512-BF16, widened in the GEMM (bf16w_gemm, panels packed at load only), against the widening tiles
// (the AVX2 build, same method), ms: 1 row 10.1 / 10.9, 2 rows 11.4 / 13.9, 4 rows 16.5 / 16.6, 8 rows 23.4 / 22.9, 16
// rows 47.4 / 42.8, 64 rows 166.3 / 119.7.
constexpr int64_t PACKED_BF16W_MIN_ROWS = 8;

#if defined(__AVX512F__)
// r[i], 16 dwords of row i, becomes r[q], dword q of rows 0-15: pairs within 128-bit lanes, then quads, then lanes.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + c], lane L: column 4L + c of rows g..g+3
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// The GEMMs' vectors: 16 lanes of int32 or float32.
struct GemmVec {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  static I load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I bytes_xor(I v, uint32_t f) { return _mm512_xor_si512(v, _mm512_set1_epi32(static_cast<int>(f))); }
  static I broadcast(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static __mmask16 mask(int64_t n) { return n >= 16 ? 0xffff : (1u << n) - 1; }
  static F fload(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, int64_t n, F v) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
  static void transpose(I r[16]) { transpose16x16(r); }
  // each lane's pair of bf16 (low half: the even column) as two float32 vectors: the even columns, the odd ones
  static F bf16_even(I v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static F bf16_odd(I v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))); }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WB_W8A8_GEMM 1
  static I dot4(I sum, I w, I x) { return Int8Dot::dot4(sum, w, x); }  // w packed with Int8Dot::OFFSET folded in
#endif
};
constexpr int GEMM_NV = 3;
#else
// r[i], 8 dwords of row i, becomes r[q], dword q of rows 0-7.
inline void transpose8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {  // u[g + c], 128-bit half h: column 4h + c of rows g..g+3
    u[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

// The GEMMs' vectors under AVX2: 8 lanes.
struct GemmVec {
  using I = __m256i;
  using F = __m256;
  static constexpr int L = 8;
  static I load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(uint32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I bytes_xor(I v, uint32_t f) { return _mm256_xor_si256(v, _mm256_set1_epi32(static_cast<int>(f))); }
  static I broadcast(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F fload(const float* p, int64_t n) { return _mm256_maskload_ps(p, mask(n)); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void fstore(float* p, int64_t n, F v) { _mm256_maskstore_ps(p, mask(n), v); }
  static F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
  static void transpose(I r[8]) { transpose8x8(r); }
  static F bf16_even(I v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static F bf16_odd(I v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))); }
#define WB_W8A8_GEMM 1
  static I dot4(I sum, I w, I x) { return Int8Dot::dot4(sum, w, x); }
};
constexpr int GEMM_NV = 2;
#endif
constexpr int64_t GEMM_NR = GemmVec::L * GEMM_NV;
using GI = GemmVec::I;
using GF = GemmVec::F;
constexpr uint32_t W8A8_FLIP = Int8Dot::OFFSET ? 0x80808080u : 0u;  // Int8Dot::OFFSET, added to each weight byte

// panel[p * GEMM_NR + j] = dword p of weight row n0 + j (P dwords a row) XOR flip, zero for rows past n1: L rows by L
// dwords at a time, transposed in registers.
void pack_panel(const uint32_t* w, int64_t P, int64_t n0, int64_t n1, uint32_t flip, uint32_t* panel) {
  constexpr int L = GemmVec::L;
  for (int v = 0; v < GEMM_NV; ++v) {
    const int64_t first = n0 + L * v, rows = std::max<int64_t>(0, std::min<int64_t>(L, n1 - first));
    const uint32_t* base = w + first * P;
    uint32_t* dst = panel + L * v;
    int64_t p0 = 0;
    for (; p0 + L <= P; p0 += L) {
      GI r[L];
      for (int i = 0; i < L; ++i) r[i] = i < rows ? GemmVec::load(base + i * P + p0) : GemmVec::zero();
      GemmVec::transpose(r);
      for (int q = 0; q < L; ++q) GemmVec::store(dst + (p0 + q) * GEMM_NR, GemmVec::bytes_xor(r[q], flip));
    }
    for (; p0 < P; ++p0)
      for (int64_t i = 0; i < L; ++i) dst[p0 * GEMM_NR + i] = i < rows ? base[i * P + p0] ^ flip : 0u;
  }
}

// out[m, n0 + c] = (acc[m][c] - off[m]) * scale[n0 + c] + bias[n0 + c] for the panel's n_valid rows (off, scale and
// bias optional).
template <int MR>
void store_tile(const GF (&acc)[MR][GEMM_NV], float* out, int64_t N, int64_t n0, int64_t n_valid, const float* off,
                const float* scale, const float* bias) {
  constexpr int L = GemmVec::L;
  for (int v = 0; v < GEMM_NV && L * v < n_valid; ++v) {
    const int64_t n = n_valid - L * v;
    const GF s = scale ? GemmVec::fload(scale + n0 + L * v, n) : GemmVec::fset(1.f);
    const GF b = bias ? GemmVec::fload(bias + n0 + L * v, n) : GemmVec::fzero();
    for (int m = 0; m < MR; ++m) {
      const GF a = off ? GemmVec::fsub(acc[m][v], GemmVec::fset(off[m])) : acc[m][v];
      GemmVec::fstore(out + m * N + n0 + L * v, n, GemmVec::fmadd(a, s, b));
    }
  }
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= MR: a tile's row count as a template argument.
template <int MR, typename F>
void with_rows(int64_t rows, const F& f) {
  if constexpr (MR > 1)
    if (rows < MR) return with_rows<MR - 1>(rows, f);
  f(std::integral_constant<int, MR>{});
}

// Threads split the panels; each reads its panel (P dwords by GEMM_NR rows: L2-sized) from `packed`, the panels made
// at load, or packs it from w, and runs every tile of up to MR rows of x over it: tile(first row, rows, panel, n0,
// n_valid). Panels packed at load against packed by each call, the model's 121 linears (AVX-512 EPYC, 2 threads,
// same process, alternating, median of 9, 2026-12-04), ms: float32 32 rows 56.3 / 66.4, 64 rows 94.0 / 101.5, 512
// rows 702 / 704; bf16 32 rows 31.5 / 38.2, 64 rows 54.6 / 60.8, 512 rows 438 / 437; int8 32 rows 17.6 / 19.7, 64
// rows 29.5 / 31.6, 512 rows 320 / 321. A thread's panels packed at load lie end to end, a stream that the hardware
// prefetcher follows; asked for as below as well (ASK_PACKED), float32 and bf16 ran slower and int8 level or faster
// (same method, ms, asked for / not: float32 17 rows 34.9 / 27.1, 32 rows 51.3 / 43.4, 64 rows 91.8 / 82.8, 256 rows
// 351 / 348; bf16 32 rows 32.6 / 28.6, 64 rows 54.2 / 50.6; int8 32 rows 19.8 / 19.6, 64 rows 32.4 / 32.6; the AVX2
// build: float32 32 rows 57.7 / 55.4, 64 rows 97.8 / 97.6; int8 32 rows 45.0 / 47.0, 64 rows 143.5 / 159.1). Each tile
// first asks for its share of the next panel (or of the weight rows it is packed from) into L2, so that packing or
// reading it does not wait on memory:
// the model's 121 linears (AVX-512 EPYC, 2 threads, same process, alternating, median of 11, 2026-12-04), without /
// with, ms: bf16 32 rows 39.5 / 36.5, 64 rows 59.2 / 55.5 (62.0 / 59.2 in another run); int8 20 rows 18.8 / 15.5,
// 64 rows 39.6 / 33.5; the AVX2 build's int8, 20 rows 38.7 / 28.9, 64 rows 96.8 / 86.7. Two panels ahead ran the same.
// Asked for a line per step of the tile's loop instead, slower (both built alike, a slower hour, median of 15, a share
// at the tile's start / a line per step: bf16 32 rows 44.1 / 47.6, 64 rows 62.3 / 69.4; int8 20 rows 18.5 / 22.5).
template <int MR, bool ASK_PACKED, typename Tile>
void panel_gemm(int64_t M, const uint32_t* w, const uint32_t* packed, int64_t P, int64_t N, uint32_t flip,
                const Tile& tile) {
  at::parallel_for(0, (N + GEMM_NR - 1) / GEMM_NR, 1, [&](int64_t q0, int64_t q1) {
    std::vector<uint32_t> buffer(packed ? 0 : P * GEMM_NR);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t n0 = q * GEMM_NR, n_valid = std::min(GEMM_NR, N - n0);
      const uint32_t* panel = packed ? packed + q * P * GEMM_NR : buffer.data();
      if (!packed) pack_panel(w, P, n0, n0 + n_valid, flip, buffer.data());
      // what the next panel is read from: the weight rows it is packed from, or the panel packed at load, which the
      // int8 GEMM alone asks for (ASK_PACKED)
      const char* next = reinterpret_cast<const char*>(packed ? panel + P * GEMM_NR : w + (n0 + GEMM_NR) * P);
      const int64_t next_rows = q + 1 < q1 && (!packed || ASK_PACKED) ? std::min(GEMM_NR, N - n0 - GEMM_NR) : 0;
      const int64_t lines = next_rows * P * 4 / 64, tiles = (M + MR - 1) / MR, share = (lines + tiles - 1) / tiles;
      for (int64_t m0 = 0, i = 0; m0 < M; m0 += MR, ++i) {
        for (int64_t l = i * share; l < std::min(lines, (i + 1) * share); ++l) _mm_prefetch(next + l * 64, _MM_HINT_T1);
        tile(m0, std::min<int64_t>(MR, M - m0), panel, n0, n_valid);
      }
    }
  });
}

// float32: MR rows of x (K floats a row) against a panel of float32 weights, one FMA per weight vector and row. With
// 16 lanes 8 x 48 outputs (24 of the 32 registers); with AVX2's 8 lanes and 16 registers, 6 x 16 (12). Where oneDNN's
// GEMM had taken float32 linears of more than 24 rows (the weight as stored, packed by each call as here): smollm2's
// 120 layer linears (AVX-512 EPYC, 2 threads, same process, alternating, median of 7, 2026-12-04), this / oneDNN /
// the tiles, ms: 24 rows 47.1 / 58.9 / 60.4; 32 rows 56.2 / 64.8 / 79.2; 64 rows 87.8 / 110.6 / 136.1; 512 rows
// 537 / 552; the AVX2 build against oneDNN held to AVX2: 17 rows 44.1 / 62.2 / 44.3; 24 rows 50.3 / 69.0 / 57.8;
// 64 rows 106.7 / 147.6 / 151.2; 512 rows 613 / 605.
#if defined(__AVX512F__)
constexpr int F32_GEMM_MR = 8;
#else
constexpr int F32_GEMM_MR = 6;
#endif

template <int MR>
void f32_tile(const float* x, int64_t K, const uint32_t* panel, float* out, int64_t N, int64_t n0, int64_t n_valid,
              const float* scale, const float* bias) {
  GF acc[MR][GEMM_NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fzero();
  const float* wp = reinterpret_cast<const float*>(panel);
  for (int64_t p = 0; p < K; ++p) {
    GF wv[GEMM_NV];
    for (int v = 0; v < GEMM_NV; ++v) wv[v] = GemmVec::fload(wp + p * GEMM_NR + GemmVec::L * v);
    for (int m = 0; m < MR; ++m) {
      const GF xv = GemmVec::fset(x[m * K + p]);
      for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fmadd(wv[v], xv, acc[m][v]);
    }
  }
  store_tile<MR>(acc, out, N, n0, n_valid, nullptr, scale, bias);
}

void f32_gemm(int64_t M, const float* x, const float* w, const uint32_t* packed, const float* scale, const float* bias,
              float* out, int64_t K, int64_t N) {
  const auto tile = [&](int64_t m0, int64_t rows, const uint32_t* panel, int64_t n0, int64_t n_valid) {
    with_rows<F32_GEMM_MR>(rows, [&](auto mr) {
      f32_tile<decltype(mr)::value>(x + m0 * K, K, panel, out + m0 * N, N, n0, n_valid, scale, bias);
    });
  };
  panel_gemm<F32_GEMM_MR, false>(M, reinterpret_cast<const uint32_t*>(w), packed, K, N, 0u, tile);
}

#if defined(__AVX512BF16__)
// MR rows of x (P pairs a row) against a panel: 8 x 48 outputs take 11 loads per 24 vdpbf16ps.
template <int MR>
void bf16_tile(const uint32_t* x, int64_t P, const uint32_t* panel, float* out, int64_t N, int64_t n0,
               int64_t n_valid, const float* bias) {
  __m512 acc[MR][GEMM_NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh wv[GEMM_NV];
    for (int v = 0; v < GEMM_NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(panel + p * GEMM_NR + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * P + p]));
      for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xv);
    }
  }
  store_tile<MR>(acc, out, N, n0, n_valid, nullptr, nullptr, bias);
}

void bf16_gemm(int64_t M, const at::BFloat16* x, const at::BFloat16* w, const uint32_t* packed, const float* bias,
               float* out, int64_t K, int64_t N) {
  const int64_t P = K / 2;
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const auto tile = [&](int64_t m0, int64_t rows, const uint32_t* panel, int64_t n0, int64_t n_valid) {
    with_rows<8>(rows, [&](auto mr) {
      bf16_tile<decltype(mr)::value>(xp + m0 * P, P, panel, out + m0 * N, N, n0, n_valid, bias);
    });
  };
  panel_gemm<8, false>(M, reinterpret_cast<const uint32_t*>(w), packed, P, N, 0u, tile);
}
#endif

#if !defined(__AVX512BF16__)
// bf16 without AVX512-BF16: MR rows of x (rounded to bf16, as float32: K a row) against a panel of bf16 pairs, each
// widened to float32 as it is loaded (its even and its odd columns), in float32 FMAs: the arithmetic of the widening
// tiles (FloatDot<bf16>), over panels packed at load only. Registers: MR x GEMM_NV sums, 2 x GEMM_NV widened weights
// and two broadcasts: 4 x 16 of AVX2's 16, 6 x 48 of AVX-512's 32.
#if defined(__AVX512F__)
constexpr int BF16W_GEMM_MR = 6;
#else
constexpr int BF16W_GEMM_MR = 4;
#endif

template <int MR>
void bf16w_tile(const float* x, int64_t K, const uint32_t* panel, float* out, int64_t N, int64_t n0, int64_t n_valid,
                const float* bias) {
  GF acc[MR][GEMM_NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fzero();
  for (int64_t p = 0; p < K / 2; ++p) {
    GF even[GEMM_NV], odd[GEMM_NV];
    for (int v = 0; v < GEMM_NV; ++v) {
      const GI pairs = GemmVec::load(panel + p * GEMM_NR + GemmVec::L * v);
      even[v] = GemmVec::bf16_even(pairs);
      odd[v] = GemmVec::bf16_odd(pairs);
    }
    for (int m = 0; m < MR; ++m) {
      const GF xe = GemmVec::fset(x[m * K + 2 * p]), xo = GemmVec::fset(x[m * K + 2 * p + 1]);
      for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fmadd(odd[v], xo, GemmVec::fmadd(even[v], xe, acc[m][v]));
    }
  }
  store_tile<MR>(acc, out, N, n0, n_valid, nullptr, nullptr, bias);
}

void bf16w_gemm(int64_t M, const float* x, const uint32_t* packed, const float* bias, float* out, int64_t K,
                int64_t N) {
  const auto tile = [&](int64_t m0, int64_t rows, const uint32_t* panel, int64_t n0, int64_t n_valid) {
    with_rows<BF16W_GEMM_MR>(rows, [&](auto mr) {
      bf16w_tile<decltype(mr)::value>(x + m0 * K, K, panel, out + m0 * N, N, n0, n_valid, bias);
    });
  };
  panel_gemm<BF16W_GEMM_MR, false>(M, nullptr, packed, K / 2, N, 0u, tile);
}
#endif

#if defined(WB_W8A8_GEMM)
// MR rows of int8 x (P quads a row; ls: their lane scales, one per quad, as quantize_blocks writes them) against a
// panel of int8 weights (+ Int8Dot::OFFSET): each block of 32 columns (8 quads) sums exactly in int32, then into
// float32 at its row's scale of x. With 16 lanes both sums hold 4 x 48 outputs: 24 of the 32 vector registers.
template <int MR>
void w8a8_tile(const uint32_t* x, const float* ls, int64_t P, const uint32_t* panel, float* out, int64_t N, int64_t n0,
               int64_t n_valid, const float* off, const float* scale, const float* bias) {
  GF acc[MR][GEMM_NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fzero();
  for (int64_t p0 = 0; p0 < P; p0 += QBLOCK / 4) {
    GI sum[MR][GEMM_NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < GEMM_NV; ++v) sum[m][v] = GemmVec::zero();
    for (int64_t p = p0; p < p0 + QBLOCK / 4; ++p) {
      GI wv[GEMM_NV];
      for (int v = 0; v < GEMM_NV; ++v) wv[v] = GemmVec::load(panel + p * GEMM_NR + GemmVec::L * v);
      for (int m = 0; m < MR; ++m) {
        const GI xv = GemmVec::broadcast(x[m * P + p]);
        for (int v = 0; v < GEMM_NV; ++v) sum[m][v] = GemmVec::dot4(sum[m][v], wv[v], xv);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const GF sx = GemmVec::fset(ls[m * P + p0]);
      for (int v = 0; v < GEMM_NV; ++v) acc[m][v] = GemmVec::fmadd(GemmVec::to_float(sum[m][v]), sx, acc[m][v]);
    }
  }
  store_tile<MR>(acc, out, N, n0, n_valid, off, scale, bias);
}

void w8a8_gemm(int64_t M, const int8_t* xq, const float* ls, const float* off, const int8_t* w, const uint32_t* packed,
               const float* scale, const float* bias, float* out, int64_t K, int64_t N) {
  const int64_t P = K / 4;
  const auto* xp = reinterpret_cast<const uint32_t*>(xq);
  const auto tile = [&](int64_t m0, int64_t rows, const uint32_t* panel, int64_t n0, int64_t n_valid) {
    with_rows<4>(rows, [&](auto mr) {
      w8a8_tile<decltype(mr)::value>(xp + m0 * P, ls + m0 * P, P, panel, out + m0 * N, N, n0, n_valid, off + m0,
                                     scale, bias);
    });
  };
  panel_gemm<4, true>(M, reinterpret_cast<const uint32_t*>(w), packed, P, N, W8A8_FLIP, tile);
}
#endif

// Dwords per weight row of the GEMM that this build runs over `weight`'s dtype (float32: a column each; bf16: pairs;
// int8: quads), or 0 where it has none for this dtype and width: bf16 of an odd width, int8 whose rows are not whole
// blocks of 32.
int64_t gemm_dwords(const at::Tensor& weight) {
  const int64_t K = weight.size(1);
  switch (weight.scalar_type()) {
    case at::kFloat: return K;
    case at::kBFloat16: return K % 2 == 0 ? K / 2 : 0;  // vdpbf16ps's pairs, or widened by bf16w_gemm
#if defined(WB_W8A8_GEMM)
    case at::kChar: return K % QBLOCK == 0 ? K / 4 : 0;
#endif
    default: return 0;
  }
}

// The weight [N, K] as the GEMM's panels, packed once (at load) instead of at every call: [ceil(N / GEMM_NR), P,
// GEMM_NR] dwords, panel q being what pack_panel makes of rows q * GEMM_NR on; None where gemm_dwords has no GEMM.
// GEMM_NR is the build's (48 under AVX-512, 16 under AVX2), so panels are made and read by the same build.
c10::optional<at::Tensor> pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_gemm_weight: weight must be [N, K]");
  const int64_t P = gemm_dwords(weight), N = weight.size(0), Q = (N + GEMM_NR - 1) / GEMM_NR;
  if (P == 0) return c10::nullopt;
  const auto wc = weight.contiguous();
  auto panels = at::empty({Q, P, GEMM_NR}, wc.options().dtype(at::kInt));
  const auto* w = static_cast<const uint32_t*>(wc.data_ptr());
  auto* out = reinterpret_cast<uint32_t*>(panels.data_ptr<int32_t>());
  const uint32_t flip = weight.scalar_type() == at::kChar ? W8A8_FLIP : 0u;
  at::parallel_for(0, Q, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      pack_panel(w, P, q * GEMM_NR, std::min(N, (q + 1) * GEMM_NR), flip, out + q * P * GEMM_NR);
  });
  return panels;
}

// The packed panels' data, checked against the weight they were packed from; null where there are none.
const uint32_t* packed_data(const c10::optional<at::Tensor>& packed, const at::Tensor& weight) {
  if (!packed.has_value()) return nullptr;
  const int64_t P = gemm_dwords(weight), Q = (weight.size(0) + GEMM_NR - 1) / GEMM_NR;
  TORCH_CHECK(packed->scalar_type() == at::kInt && packed->is_contiguous() && P > 0 &&
                  packed->sizes() == at::IntArrayRef({Q, P, GEMM_NR}),
              "packed: expected pack_gemm_weight's [", Q, ", ", P, ", ", GEMM_NR, "] int32 panels of this weight, got ",
              packed->sizes());
  return reinterpret_cast<const uint32_t*>(packed->data_ptr<int32_t>());
}

void check_linear(const char* name, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be [M, K] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), name, ": weight must be [N, K]");
}

const float* optional_data(const c10::optional<at::Tensor>& t, at::Tensor& keep) {
  if (!t.has_value()) return nullptr;
  keep = t->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// float32 arithmetic, exact: float32 weights, or bfloat16 ones widened (the bf16 path of a CPU without AVX512-BF16,
// x then already rounded to bf16 by linear_bf16).
template <typename W>
void float_linear(int64_t M, int64_t K, const float* x, const W* w, const float* scale, const float* bias,
                  at::Tensor& out) {
  const int64_t N = out.size(1);
  float* o = out.data_ptr<float>();
  const auto epilogue = [&](int64_t m, int64_t n, float s) {
    o[m * N + n] = (scale ? s * scale[n] : s) + (bias ? bias[n] : 0.f);
  };
  linear_tiles<FloatDot<W>>(M, x, nullptr, w, epilogue, K, N);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& packed) {
  check_linear("linear_f32", x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "linear_f32: weight must be float32");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty({xc.size(0), wc.size(0)}, xc.options());
  at::Tensor keep_scale, keep_bias;
  const int64_t M = xc.size(0), K = xc.size(1);
  if (M >= (packed.has_value() ? PACKED_F32_MIN_ROWS : F32_GEMM_MIN_ROWS)) {
    f32_gemm(M, xc.data_ptr<float>(), wc.data_ptr<float>(), packed_data(packed, wc), optional_data(scale, keep_scale),
             optional_data(bias, keep_bias), out.data_ptr<float>(), K, wc.size(0));
    return out;
  }
  float_linear(M, K, xc.data_ptr<float>(), wc.data_ptr<float>(), optional_data(scale, keep_scale),
               optional_data(bias, keep_bias), out);
  return out;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& packed) {
  check_linear("linear_bf16", x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: weight must be bfloat16");
  auto wc = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wc.size(0);
  auto out = at::empty({M, N}, x.options());
  at::Tensor keep_bias;
  const float* b = optional_data(bias, keep_bias);
  const auto* w = wc.data_ptr<at::BFloat16>();
  const auto xc = x.contiguous();
#if defined(__AVX512BF16__)
  thread_local std::vector<uint16_t> xb;  // x rounded to bf16: the calling thread's, read by the workers
  xb.resize(static_cast<size_t>(M * K));
  round_to_bf16(xc.data_ptr<float>(), xb.data(), M * K);
  const auto* xp = reinterpret_cast<const at::BFloat16*>(xb.data());
  float* o = out.data_ptr<float>();
  if (M >= (packed.has_value() ? PACKED_BF16_MIN_ROWS : BF16_GEMM_MIN_ROWS) && K % 2 == 0) {
    bf16_gemm(M, xp, w, packed_data(packed, wc), b, o, K, N);
    return out;
  }
  const auto epilogue = [&](int64_t m, int64_t n, float s) { o[m * N + n] = s + (b ? b[n] : 0.f); };
  linear_tiles<Bf16Dot>(M, xp, nullptr, w, epilogue, K, N);
#else
  thread_local std::vector<float> xr;  // x rounded to bf16, as float32
  xr.resize(static_cast<size_t>(M * K));
  round_to_bf16(xc.data_ptr<float>(), xr.data(), M * K);
  if (packed.has_value() && M >= PACKED_BF16W_MIN_ROWS) {
    bf16w_gemm(M, xr.data(), packed_data(packed, wc), b, out.data_ptr<float>(), K, N);
    return out;
  }
  float_linear(M, K, xr.data(), w, nullptr, b, out);
#endif
  return out;
}

// x quantized in blocks of 32 columns, symmetric: per block sx = max(max|x|, 1e-12) / 127 and xq = round-half-even(
// x / sx) in [-127, 127], the arithmetic of kernels.reference.quantize_blocks. Per row, each lane of 4 columns gets
// its block's scale (ls), and offset[m] = OFFSET * sum over blocks of sx * sum(xq): Int8Dot's correction. Per token
// (one scale per row) was tried first: on smollm2-135m greedy against int8 weights alone it kept 11 of 96 tokens
// (blocks of 32: 61; of 64: 24), the model's outlier columns crushing the rest of a row to a few levels.

// One whole block, 8 floats at a time (AVX2, so both builds share it): the same division, rounding and clamp as the
// scalar loop below, so the same xq; returns the block's scale, and the sum of its xq in *sum.
inline float quantize_block(const float* x, int8_t* xq, int32_t* sum) {
  static_assert(QBLOCK == 32, "four vectors of 8 floats");
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(x + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float s = std::max(std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4))), 1e-12f) / 127.f;
  const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    total = _mm256_add_epi32(total, q[i]);
  }
  // packs interleave 128-bit lanes: bytes come out as 4 of q0, q1, q2, q3, then the next 4 of each
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
  return s;
}

void quantize_blocks(const float* x, int64_t M, int64_t K, int8_t* xq, float* ls, float* offset) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      float correction = 0.f;
      for (int64_t b = 0; b < K; b += QBLOCK) {
        const int64_t e = std::min(K, b + QBLOCK);
        int32_t sum = 0;
        float s;
        if (e - b == QBLOCK) {
          s = quantize_block(row + b, xq + m * K + b, &sum);
        } else {
          float amax = 0.f;
          for (int64_t k = b; k < e; ++k) amax = std::max(amax, std::fabs(row[k]));
          s = std::max(amax, 1e-12f) / 127.f;
          for (int64_t k = b; k < e; ++k) {
            const float q = std::min(127.f, std::max(-127.f, std::nearbyint(row[k] / s)));
            xq[m * K + k] = static_cast<int8_t>(q);
            sum += static_cast<int32_t>(q);
          }
        }
        for (int64_t l = b / 4; l < (e + 3) / 4; ++l) ls[m * lane_stride(K) + l] = s;
        correction += s * static_cast<float>(Int8Dot::OFFSET * sum);
      }
      offset[m] = correction;
    }
  });
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& packed) {
  check_linear("linear_w8a8", x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "linear_w8a8: weight must be int8");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto out = at::empty({M, N}, xc.options());
  auto xq = at::empty({M, K}, xc.options().dtype(at::kChar));
  // one lane past the row's last so a vector of lane scales never reads beyond the allocation
  auto ls = at::empty({M * lane_stride(K) + 16}, xc.options());
  auto offset = at::empty({M}, xc.options());
  quantize_blocks(xc.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), ls.data_ptr<float>(), offset.data_ptr<float>());
  at::Tensor keep_scale, keep_bias;
  const float* sw = optional_data(scale, keep_scale);
  const float* b = optional_data(bias, keep_bias);
  const float* off = offset.data_ptr<float>();
  float* o = out.data_ptr<float>();
#if defined(WB_W8A8_GEMM)
  if (M >= (packed.has_value() ? PACKED_W8A8_MIN_ROWS : W8A8_GEMM_MIN_ROWS) && K % QBLOCK == 0) {
    w8a8_gemm(M, xq.data_ptr<int8_t>(), ls.data_ptr<float>(), off, wc.data_ptr<int8_t>(), packed_data(packed, wc), sw,
              b, o, K, N);
    return out;
  }
#endif
  const auto epilogue = [&](int64_t m, int64_t n, float s) { o[m * N + n] = (s - off[m]) * sw[n] + (b ? b[n] : 0.f); };
  linear_tiles<Int8Dot>(M, xq.data_ptr<int8_t>(), ls.data_ptr<float>(), wc.data_ptr<int8_t>(), epilogue, K, N);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench_cpu, m) {
  m.def("linear_f32(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("linear_w8a8(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor? packed=None) -> Tensor");
  m.def("pack_gemm_weight(Tensor weight) -> Tensor?");
}

TORCH_LIBRARY_IMPL(workbench_cpu, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("pack_gemm_weight", &pack_gemm_weight);
}
