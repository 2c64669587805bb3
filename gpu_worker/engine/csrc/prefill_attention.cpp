// Prefill attention that reads the paged KV cache in place: every prefill chunk of a step at once, each query
// attending causally to its sequence's tokens up to its own position (the cached ones before the chunk and the
// chunk's own), flash style: scores never leave registers, softmax online, no padded batch, no gathered copy of K/V.
// bfloat16 on AVX512-BF16 (vdpbf16ps: bf16 pairs summed into float32; the output rounded once), float32 on AVX512F
// (16 lanes) or AVX2 + FMA (8 lanes; `Vec` is the only difference). Built and loaded by
// gpu_worker/engine/cpu_kernels.py (plain C ABI through ctypes; OpenMP shares torch's runtime). Where the CPU has
// neither it builds to a stub that declines (returns 1; `conveyor_paged_prefill_dtypes` says which it takes).
//
// Layout (gpu_worker/engine/kv_cache.py): a layer's K and V are [KV, slots, D]; token t of chunk b's sequence sits
// at slot tables[b][t / block_size] * block_size + t % block_size.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CONVEYOR_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define CONVEYOR_LANES 8
#endif

#ifdef CONVEYOR_LANES
#include <immintrin.h>

#include "parallel.h"

namespace {

constexpr int64_t kSerialBelow = 1 << 16;  // (query, key) pairs a call must have to run on more than one thread
constexpr int RT = 32;                     // query rows a work item takes (times the query heads sharing its KV head)

#if CONVEYOR_LANES == 16
// AVX512: 16 float lanes, lane masks in mask registers. A step of the online softmax takes KB = 64 keys (four
// vectors of scores) for MR = 4 query vectors at once: 16 score accumulators of the 32 registers.
struct Vec {
    using F = __m512;
    using I = __m512i;
    using M = __mmask16;
    static constexpr int L = 16, KB = 64, MR = 4;
    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float x) { return _mm512_set1_ps(x); }
    static I bcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
    static I loadi(const uint32_t* p) { return _mm512_load_si512(p); }
    static F load(const float* p) { return _mm512_load_ps(p); }
    static void store(float* p, F x) { _mm512_store_ps(p, x); }
    static F bits(I x) { return _mm512_castsi512_ps(x); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F max(F a, F b) { return _mm512_max_ps(a, b); }
    static float hmax(F x) { return _mm512_reduce_max_ps(x); }
    static float hsum(F x) { return _mm512_reduce_add_ps(x); }
    static M all() { return 0xFFFF; }
    static M upto(int last) {  // lanes 0..last
        const I iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        return _mm512_cmp_epi32_mask(iota, _mm512_set1_epi32(last), _MM_CMPINT_LE);
    }
    static F select(M k, F a, F other) { return _mm512_mask_mov_ps(other, k, a); }
    static F keep(M k, F a) { return _mm512_maskz_mov_ps(k, a); }
    static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static F times_pow2(F p, F n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
};
#else
// AVX2 + FMA: 8 float lanes, lane masks as all-ones vectors. 16 registers: KB = 32 keys (four vectors) for MR = 2
// query vectors, 8 score accumulators.
struct Vec {
    using F = __m256;
    using I = __m256i;
    using M = __m256;
    static constexpr int L = 8, KB = 32, MR = 2;
    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float x) { return _mm256_set1_ps(x); }
    static I bcast(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
    static I loadi(const uint32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
    static F load(const float* p) { return _mm256_load_ps(p); }
    static void store(float* p, F x) { _mm256_store_ps(p, x); }
    static F bits(I x) { return _mm256_castsi256_ps(x); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F max(F a, F b) { return _mm256_max_ps(a, b); }
    static float hmax(F x) {
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    }
    static float hsum(F x) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
    static M all() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
    static M upto(int last) {  // lanes 0..last (last + 1 > lane)
        const I iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(last + 1), iota));
    }
    static F select(M k, F a, F other) { return _mm256_blendv_ps(other, a, k); }
    static F keep(M k, F a) { return _mm256_and_ps(k, a); }
    static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static F times_pow2(F p, F n) {  // p * 2^n, n integral in [-126, 0]: the exponent field built directly
        const I e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    }
};
#endif

constexpr int KB = Vec::KB;  // keys a step of the online softmax takes (NK = KB / L vectors of scores)
constexpr int MR = Vec::MR;  // query vectors computed together (their dot products share each K/V load); <= L

// 2^x for x <= 0: 2^round(x) * p(x - round(x)), p degree 6 on [-0.5, 0.5] (relative error ~2e-7)
inline Vec::F exp2_ps(Vec::F x) {
    x = Vec::max(x, Vec::set1(-126.f));
    const Vec::F n = Vec::round(x);
    const Vec::F f = Vec::sub(x, n);
    Vec::F p = Vec::set1(1.5403530e-4f);
    p = Vec::fmadd(p, f, Vec::set1(1.3333558e-3f));
    p = Vec::fmadd(p, f, Vec::set1(9.6181291e-3f));
    p = Vec::fmadd(p, f, Vec::set1(5.5504109e-2f));
    p = Vec::fmadd(p, f, Vec::set1(2.4022651e-1f));
    p = Vec::fmadd(p, f, Vec::set1(6.9314718e-1f));
    p = Vec::fmadd(p, f, Vec::set1(1.f));
    return Vec::times_pow2(p, n);
}

// The element type's 32-bit unit: a pair of bfloat16 (dot products over pairs, vdpbf16ps) or one float32 (FMA).
// K, V and the probabilities are handled in these units: `per` elements each.
template <typename T>
struct Unit;
template <>
struct Unit<float> {
    static constexpr int per = 1;
    static Vec::F dot(Vec::F acc, Vec::I a, Vec::I b) { return Vec::fmadd(Vec::bits(a), Vec::bits(b), acc); }
};
#if CONVEYOR_LANES == 16 && defined(__AVX512BF16__)
#define CONVEYOR_BF16 1
template <>
struct Unit<uint16_t> {
    static constexpr int per = 2;
    static __m512 dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};
#endif

inline void store_out(float* p, float x) { *p = x; }

inline void store_out(uint16_t* p, float x) {  // to bfloat16, round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Chunks {
    const int32_t* tables;
    int max_blocks;
    const int32_t* starts;   // each chunk's first position
    const int32_t* lengths;  // its token count
    const int32_t* offsets;  // its first row among the prefill rows
    std::vector<int64_t> packed;  // where each (chunk, KV head)'s K/V are packed in the workspace, int32 units
};

// Chunk b's keys 0..nkeys-1 for KV head h, packed in 32-bit units (`Unit<T>`), KB keys a block:
//   K: [block][D/per][KB], unit j of each key (dimensions j*per..): the block's scores are dot products across lanes;
//   V: [block][KB/per][D], at each d the unit of keys per*i..: a unit of probabilities times it adds to out[d].
// Keys past nkeys are zeros (their scores are masked; their probabilities zero).
template <typename T>
void pack(const T* kc, const T* vc, const int32_t* table, int nkeys, int bs, int D, int block, uint32_t* kp,
          uint32_t* vp) {
    constexpr int per = Unit<T>::per;
    const int U = D / per;
    uint32_t* kb = kp + static_cast<int64_t>(block) * U * KB;
    uint32_t* vb = vp + static_cast<int64_t>(block) * U * KB;
    auto row = [&](int t) -> int64_t { return (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * D; };
    for (int i = 0; i < KB; ++i) {
        const int t = block * KB + i;
        const uint32_t* k = t < nkeys ? reinterpret_cast<const uint32_t*>(kc + row(t)) : nullptr;
        for (int j = 0; j < U; ++j) kb[j * KB + i] = k ? k[j] : 0u;
    }
    for (int i = 0; i < KB; i += per) {
        uint32_t* out = vb + (i / per) * D;
        if constexpr (per == 1) {
            const int t = block * KB + i;
            if (t < nkeys)
                std::memcpy(out, vc + row(t), sizeof(float) * D);
            else
                std::memset(out, 0, sizeof(float) * D);
        } else {
            const int t = block * KB + i;
            const T* v0 = t < nkeys ? vc + row(t) : nullptr;
            const T* v1 = t + 1 < nkeys ? vc + row(t + 1) : nullptr;
            for (int d = 0; d < D; ++d)
                out[d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
        }
    }
}

// MR query vectors (rows `qs` of q, positions `pos`) against keys 0 .. max(pos), out rows `os`; head dim D.
template <typename T, int D>
void attend_tile(const uint32_t* const* qs, const int* pos, T* const* os, int nq, const uint32_t* kp,
                 const uint32_t* vp, float scale_log2) {
    constexpr int L = Vec::L, NV = D / L, per = Unit<T>::per, P = D / per, NK = KB / L;
    static_assert(NV >= 1 && NK % 2 == 0 && MR <= L, "tile shape");
    int maxpos = pos[0], minpos = pos[0];
    for (int q = 1; q < nq; ++q) {
        maxpos = pos[q] > maxpos ? pos[q] : maxpos;
        minpos = pos[q] < minpos ? pos[q] : minpos;
    }
    alignas(64) float o[MR][D];
    alignas(64) uint32_t pb[MR][KB / per];  // a block's probabilities, in units
    std::memset(o, 0, sizeof o);
    float m[MR];
    Vec::F l[MR];
    for (int q = 0; q < MR; ++q) {
        m[q] = -INFINITY;
        l[q] = Vec::zero();
    }
    const Vec::F vscale = Vec::set1(scale_log2), ninf = Vec::set1(-INFINITY);
    const int blocks = maxpos / KB + 1;
    for (int b = 0; b < blocks; ++b) {
        // scores: each K load serves MR queries, each query's broadcast NK vectors of keys
        const uint32_t* kb = kp + static_cast<int64_t>(b) * P * KB;
        Vec::F s[MR][NK];
        for (int q = 0; q < MR; ++q)
            for (int n = 0; n < NK; ++n) s[q][n] = Vec::zero();
        for (int j = 0; j < P; ++j) {
            Vec::I a[MR];
            for (int q = 0; q < MR; ++q) a[q] = Vec::bcast(qs[q][j]);
            for (int n = 0; n < NK; ++n) {
                const Vec::I k = Vec::loadi(kb + j * KB + n * L);
                for (int q = 0; q < MR; ++q) s[q][n] = Unit<T>::dot(s[q][n], k, a[q]);
            }
        }
        const bool masked = (b + 1) * KB - 1 > minpos;
        Vec::M valid[MR][NK];
        alignas(64) float alpha[L] = {};
        for (int q = 0; q < MR; ++q) {
            Vec::F mx = ninf;
            for (int n = 0; n < NK; ++n) {
                s[q][n] = Vec::mul(s[q][n], vscale);
                valid[q][n] = Vec::all();
                if (masked) {  // keys past the query's position
                    valid[q][n] = Vec::upto(pos[q] - b * KB - n * L);
                    s[q][n] = Vec::select(valid[q][n], s[q][n], ninf);
                }
                mx = Vec::max(mx, s[q][n]);
            }
            const float bmax = Vec::hmax(mx);
            const float mn = bmax > m[q] ? bmax : m[q];  // finite: key 0 is every query's, in block 0
            alpha[q] = m[q] - mn;  // -inf in block 0: its factor scales nothing yet
            m[q] = mn;
        }
        Vec::store(alpha, exp2_ps(Vec::load(alpha)));
        for (int q = 0; q < MR; ++q) {
            const Vec::F vm = Vec::set1(m[q]);
            Vec::F sum = Vec::zero();
            for (int n = 0; n < NK; n += 2) {
                const Vec::F p0 = Vec::keep(valid[q][n], exp2_ps(Vec::sub(s[q][n], vm)));
                const Vec::F p1 = Vec::keep(valid[q][n + 1], exp2_ps(Vec::sub(s[q][n + 1], vm)));
                sum = Vec::add(sum, Vec::add(p0, p1));
#ifdef CONVEYOR_BF16
                if constexpr (per == 2) {
                    _mm512_store_si512(pb[q] + n * 8, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                    continue;
                }
#endif
                Vec::store(reinterpret_cast<float*>(pb[q] + n * L), p0);
                Vec::store(reinterpret_cast<float*>(pb[q] + n * L + L), p1);
            }
            l[q] = Vec::fmadd(l[q], Vec::set1(alpha[q]), sum);
        }
        // out += probabilities x V: each V load serves MR queries, 4 vectors of out at a time
        const uint32_t* vb = vp + static_cast<int64_t>(b) * P * KB;
        for (int g = 0; g < NV; g += 4) {
            constexpr int W = NV < 4 ? NV : 4;
            Vec::F ov[MR][W];
            for (int q = 0; q < MR; ++q) {
                const Vec::F a = Vec::set1(alpha[q]);
                for (int w = 0; w < W; ++w) ov[q][w] = Vec::mul(Vec::load(o[q] + (g + w) * L), a);
            }
            for (int p = 0; p < KB / per; ++p) {
                Vec::I v[W];
                for (int w = 0; w < W; ++w) v[w] = Vec::loadi(vb + p * D + (g + w) * L);
                for (int q = 0; q < MR; ++q) {
                    const Vec::I c = Vec::bcast(pb[q][p]);
                    for (int w = 0; w < W; ++w) ov[q][w] = Unit<T>::dot(ov[q][w], v[w], c);
                }
            }
            for (int q = 0; q < MR; ++q)
                for (int w = 0; w < W; ++w) Vec::store(o[q] + (g + w) * L, ov[q][w]);
        }
    }
    for (int q = 0; q < nq; ++q) {
        const float inv = 1.f / Vec::hsum(l[q]);
        for (int d = 0; d < D; ++d) store_out(os[q] + d, o[q][d] * inv);
    }
}

// The chunk a flat work item belongs to, items numbered chunk after chunk (`count(b)` of chunk b); `rest` becomes
// the item's index within its chunk.
template <typename F>
int chunk_of(int64_t& rest, F count) {
    int b = 0;
    for (int64_t n = count(0); rest >= n; n = count(++b)) rest -= n;
    return b;
}

template <typename T, int D>
void prefill(const T* q, int64_t q_stride, const T* kc, const T* vc, const Chunks& c, int chunks, int H, int KV,
             int64_t slots, int bs, float scale, T* out, uint32_t* work, int threads) {
    constexpr int U = D / Unit<T>::per;
    const int G = H / KV;
    // (query, key) pairs: below kSerialBelow the call runs on this thread alone, since waking the others (and, on a
    // busy machine, waiting for them to get a core) costs more than the work
    int64_t pairs = 0;
    for (int b = 0; b < chunks; ++b) pairs += static_cast<int64_t>(H) * c.lengths[b] * (c.starts[b] + c.lengths[b]);
    const bool parallel = pairs >= kSerialBelow;
    // work items per chunk: its KV heads' blocks of KB keys (packing), its KV heads' tiles of RT rows (attending)
    auto key_blocks = [&](int b) { return static_cast<int64_t>(KV) * ((c.starts[b] + c.lengths[b] + KB - 1) / KB); };
    auto row_tiles = [&](int b) { return static_cast<int64_t>(KV) * ((c.lengths[b] + RT - 1) / RT); };
    // pack every chunk's K/V, a block of KB keys per item
    int64_t items = 0;
    for (int b = 0; b < chunks; ++b) items += key_blocks(b);
    conveyor::parallel_for(items, parallel, threads, [&](int64_t it) {
        int64_t rest = it;
        const int b = chunk_of(rest, key_blocks);
        const int nblk = (c.starts[b] + c.lengths[b] + KB - 1) / KB;
        const int h = static_cast<int>(rest / nblk), blk = static_cast<int>(rest % nblk);
        const int64_t base = c.packed[b * KV + h];
        pack<T>(kc + h * slots * D, vc + h * slots * D, c.tables + static_cast<int64_t>(b) * c.max_blocks,
                c.starts[b] + c.lengths[b], bs, D, blk, work + base, work + base + static_cast<int64_t>(nblk) * U * KB);
    }, 4);
    // attend: an item is (chunk, KV head, RT query rows), its rows' G query heads each
    int64_t tiles = 0;
    for (int b = 0; b < chunks; ++b) tiles += row_tiles(b);
    const float scale_log2 = scale * 1.4426950408889634f;
    conveyor::parallel_for(tiles, parallel, threads, [&](int64_t it) {
        int64_t rest = it;
        const int b = chunk_of(rest, row_tiles);
        const int ntile = (c.lengths[b] + RT - 1) / RT;
        const int h = static_cast<int>(rest / ntile), r0 = static_cast<int>(rest % ntile) * RT;
        const int r1 = r0 + RT < c.lengths[b] ? r0 + RT : c.lengths[b];
        const int nblk = (c.starts[b] + c.lengths[b] + KB - 1) / KB;
        const uint32_t* kp = work + c.packed[b * KV + h];
        const uint32_t* vp = kp + static_cast<int64_t>(nblk) * U * KB;
        const int nvec = (r1 - r0) * G;
        for (int v0 = 0; v0 < nvec; v0 += MR) {
            const uint32_t* qs[MR];
            T* os[MR];
            int pos[MR];
            const int nq = nvec - v0 < MR ? nvec - v0 : MR;
            for (int i = 0; i < MR; ++i) {
                const int v = v0 + (i < nq ? i : nq - 1);  // a short tile repeats its last vector, not written
                const int r = r0 + v / G, head = h * G + v % G;
                const int64_t row = c.offsets[b] + r;
                qs[i] = reinterpret_cast<const uint32_t*>(q + row * q_stride + head * D);
                os[i] = out + (row * H + head) * D;
                pos[i] = c.starts[b] + r;
            }
            attend_tile<T, D>(qs, pos, os, nq, kp, vp, scale_log2);
        }
    });
}

template <typename T>
int prefill_as(const void* q, int64_t q_stride, const void* kc, const void* vc, const Chunks& c, int chunks, int H,
               int KV, int D, int64_t slots, int bs, float scale, void* out, void* work, int threads) {
    const auto* qq = static_cast<const T*>(q);
    const auto* k = static_cast<const T*>(kc);
    const auto* v = static_cast<const T*>(vc);
    auto* o = static_cast<T*>(out);
    auto* w = static_cast<uint32_t*>(work);
    switch (D) {
        case 16: prefill<T, 16>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 32: prefill<T, 32>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 64: prefill<T, 64>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 128: prefill<T, 128>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 256: prefill<T, 256>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        default: return 1;
    }
}

}  // namespace

CONVEYOR_SET_POOL

extern "C" {

// Workspace int32 units a call needs (64-byte aligned): every (chunk, KV head)'s packed K and V; `bf16` 1 or 0.
int64_t conveyor_paged_prefill_workspace(const int32_t* starts, const int32_t* lengths, int chunks, int KV, int D,
                                         int bf16) {
    int64_t n = 0;
    for (int b = 0; b < chunks; ++b) n += static_cast<int64_t>(KV) * ((starts[b] + lengths[b] + KB - 1) / KB) * KB * D;
    return bf16 ? n : 2 * n;
}

// q: the prefill rows' queries, row r's head hh at q + r * q_stride + hh * D (float32, or bfloat16 where bf16 = 1);
// kc, vc: a layer's cache; tables [chunks, max_blocks] int32; starts, lengths, offsets [chunks] int32; out
// [rows, H, D]; work: conveyor_paged_prefill_workspace's int32 units. Returns 1 (nothing done) for a dtype this
// build lacks, a head_dim other than 16, 32, 64, 128 or 256, or heads that do not group.
int conveyor_paged_prefill(const void* q, int64_t q_stride, const void* kc, const void* vc, int bf16,
                           const int32_t* tables, int max_blocks, const int32_t* starts, const int32_t* lengths,
                           const int32_t* offsets, int chunks, int H, int KV, int D, int64_t slots, int bs, float scale,
                           void* out, void* work, int threads) {
    if (KV <= 0 || H % KV || chunks <= 0) return 1;
    Chunks c{tables, max_blocks, starts, lengths, offsets, std::vector<int64_t>(static_cast<size_t>(chunks) * KV)};
    const int64_t per_key = bf16 ? D : 2 * D;  // K's and V's units
    int64_t at = 0;
    for (int b = 0; b < chunks; ++b)
        for (int h = 0; h < KV; ++h, at += static_cast<int64_t>((starts[b] + lengths[b] + KB - 1) / KB) * KB * per_key)
            c.packed[b * KV + h] = at;
    if (!bf16) return prefill_as<float>(q, q_stride, kc, vc, c, chunks, H, KV, D, slots, bs, scale, out, work, threads);
#ifdef CONVEYOR_BF16
    return prefill_as<uint16_t>(q, q_stride, kc, vc, c, chunks, H, KV, D, slots, bs, scale, out, work, threads);
#else
    return 1;
#endif
}

// The dtypes this build takes: 1 float32, 2 bfloat16 (a bit each).
int conveyor_paged_prefill_dtypes() {
#ifdef CONVEYOR_BF16
    return 3;
#else
    return 1;
#endif
}

// Float lanes of a vector in this build: 16 (AVX512), 8 (AVX2).
int conveyor_paged_prefill_lanes() { return CONVEYOR_LANES; }

}

#else  // neither AVX512 nor AVX2 on this CPU: the model keeps its other paths

extern "C" {
int64_t conveyor_paged_prefill_workspace(const int32_t*, const int32_t*, int, int, int, int) { return 0; }
int conveyor_paged_prefill(const void*, int64_t, const void*, const void*, int, const int32_t*, int, const int32_t*,
                           const int32_t*, const int32_t*, int, int, int, int, int64_t, int, float, void*, void*,
                           int) {
    return 1;
}
int conveyor_paged_prefill_dtypes() { return 0; }
int conveyor_paged_prefill_lanes() { return 0; }
}

#endif
