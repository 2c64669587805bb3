// Prefill attention that reads the paged KV cache in place: every prefill chunk of a step at once, each query
// attending causally to its sequence's tokens up to its own position (the cached ones before the chunk and the
// chunk's own), flash style: scores never leave registers, softmax online, no padded batch, no gathered copy of K/V.
// bfloat16 on AVX512-BF16 (vdpbf16ps: bf16 pairs summed into float32; the output rounded once), float32 on AVX512F
// (FMA). Built and loaded by gpu_worker/engine/cpu_kernels.py (plain C ABI through ctypes; OpenMP shares torch's
// runtime). Where the CPU lacks them it builds to a stub that declines (returns 1; `conveyor_paged_prefill_dtypes`
// says which it takes).
//
// Layout (gpu_worker/engine/kv_cache.py): a layer's K and V are [KV, slots, D]; token t of chunk b's sequence sits
// at slot tables[b][t / block_size] * block_size + t % block_size.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int KB = 64;  // keys a step of the online softmax takes: four vectors of 16 scores
constexpr int MR = 4;   // query vectors computed together (their dot products share each K/V load); <= 16
constexpr int RT = 32;  // query rows a work item takes (times the query heads sharing its KV head)
constexpr int64_t kSerialBelow = 1 << 16;  // (query, key) pairs a call must have to run on more than one thread

// 2^x for x <= 0: 2^round(x) * p(x - round(x)), p degree 6 on [-0.5, 0.5] (relative error ~2e-7)
inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// The element type's 32-bit unit: a pair of bfloat16 (dot products over pairs, vdpbf16ps) or one float32 (FMA).
// K, V and the probabilities are handled in these units: `per` elements each.
template <typename T>
struct Unit;
template <>
struct Unit<float> {
    static constexpr int per = 1;
    static __m512 dot(__m512 acc, __m512i a, __m512i b) {
        return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
    }
};
#ifdef __AVX512BF16__
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

// MR query vectors (rows `qs` of q, positions `pos`) against keys 0 .. max(pos), out rows `os`. NV = D / 16.
template <typename T, int NV>
void attend_tile(const uint32_t* const* qs, const int* pos, T* const* os, int nq, const uint32_t* kp,
                 const uint32_t* vp, float scale_log2) {
    constexpr int D = NV * 16, per = Unit<T>::per, P = D / per, NK = KB / 16;
    int maxpos = pos[0], minpos = pos[0];
    for (int q = 1; q < nq; ++q) {
        maxpos = pos[q] > maxpos ? pos[q] : maxpos;
        minpos = pos[q] < minpos ? pos[q] : minpos;
    }
    alignas(64) float o[MR][D];
    alignas(64) uint32_t pb[MR][KB / per];  // a block's probabilities, in units
    std::memset(o, 0, sizeof o);
    float m[MR];
    __m512 l[MR];
    for (int q = 0; q < MR; ++q) {
        m[q] = -INFINITY;
        l[q] = _mm512_setzero_ps();
    }
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 vscale = _mm512_set1_ps(scale_log2), ninf = _mm512_set1_ps(-INFINITY);
    const int blocks = maxpos / KB + 1;
    for (int b = 0; b < blocks; ++b) {
        // scores: each K load serves MR queries, each query's broadcast NK vectors of keys
        const uint32_t* kb = kp + static_cast<int64_t>(b) * P * KB;
        __m512 s[MR][NK];
        for (int q = 0; q < MR; ++q)
            for (int n = 0; n < NK; ++n) s[q][n] = _mm512_setzero_ps();
        for (int j = 0; j < P; ++j) {
            __m512i a[MR];
            for (int q = 0; q < MR; ++q) a[q] = _mm512_set1_epi32(static_cast<int>(qs[q][j]));
            for (int n = 0; n < NK; ++n) {
                const __m512i k = _mm512_load_si512(kb + j * KB + n * 16);
                for (int q = 0; q < MR; ++q) s[q][n] = Unit<T>::dot(s[q][n], k, a[q]);
            }
        }
        const bool masked = (b + 1) * KB - 1 > minpos;
        __mmask16 valid[MR][NK];
        alignas(64) float alpha[16] = {};
        for (int q = 0; q < MR; ++q) {
            __m512 mx = ninf;
            for (int n = 0; n < NK; ++n) {
                s[q][n] = _mm512_mul_ps(s[q][n], vscale);
                valid[q][n] = 0xFFFF;
                if (masked) {  // keys past the query's position
                    const __m512i lim = _mm512_set1_epi32(pos[q] - b * KB - n * 16);
                    valid[q][n] = _mm512_cmp_epi32_mask(iota, lim, _MM_CMPINT_LE);
                    s[q][n] = _mm512_mask_mov_ps(ninf, valid[q][n], s[q][n]);
                }
                mx = _mm512_max_ps(mx, s[q][n]);
            }
            const float bmax = _mm512_reduce_max_ps(mx);
            const float mn = bmax > m[q] ? bmax : m[q];  // finite: key 0 is every query's, in block 0
            alpha[q] = m[q] - mn;  // -inf in block 0: its factor scales nothing yet
            m[q] = mn;
        }
        _mm512_store_ps(alpha, exp2_ps(_mm512_load_ps(alpha)));
        for (int q = 0; q < MR; ++q) {
            const __m512 vm = _mm512_set1_ps(m[q]);
            __m512 sum = _mm512_setzero_ps();
            for (int n = 0; n < NK; n += 2) {
                const __m512 p0 = _mm512_maskz_mov_ps(valid[q][n], exp2_ps(_mm512_sub_ps(s[q][n], vm)));
                const __m512 p1 = _mm512_maskz_mov_ps(valid[q][n + 1], exp2_ps(_mm512_sub_ps(s[q][n + 1], vm)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
#ifdef __AVX512BF16__
                if constexpr (per == 2) {
                    _mm512_store_si512(pb[q] + n * 8, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                    continue;
                }
#endif
                _mm512_store_ps(reinterpret_cast<float*>(pb[q] + n * 16), p0);
                _mm512_store_ps(reinterpret_cast<float*>(pb[q] + n * 16 + 16), p1);
            }
            l[q] = _mm512_fmadd_ps(l[q], _mm512_set1_ps(alpha[q]), sum);
        }
        // out += probabilities x V: each V load serves MR queries, 4 vectors of out at a time
        const uint32_t* vb = vp + static_cast<int64_t>(b) * P * KB;
        for (int g = 0; g < NV; g += 4) {
            constexpr int W = NV < 4 ? NV : 4;
            __m512 ov[MR][W];
            for (int q = 0; q < MR; ++q) {
                const __m512 a = _mm512_set1_ps(alpha[q]);
                for (int w = 0; w < W; ++w) ov[q][w] = _mm512_mul_ps(_mm512_load_ps(o[q] + (g + w) * 16), a);
            }
            for (int p = 0; p < KB / per; ++p) {
                __m512i v[W];
                for (int w = 0; w < W; ++w) v[w] = _mm512_load_si512(vb + p * D + (g + w) * 16);
                for (int q = 0; q < MR; ++q) {
                    const __m512i c = _mm512_set1_epi32(static_cast<int>(pb[q][p]));
                    for (int w = 0; w < W; ++w) ov[q][w] = Unit<T>::dot(ov[q][w], v[w], c);
                }
            }
            for (int q = 0; q < MR; ++q)
                for (int w = 0; w < W; ++w) _mm512_store_ps(o[q] + (g + w) * 16, ov[q][w]);
        }
    }
    for (int q = 0; q < nq; ++q) {
        const float inv = 1.f / _mm512_reduce_add_ps(l[q]);
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

template <typename T, int NV>
void prefill(const T* q, int64_t q_stride, const T* kc, const T* vc, const Chunks& c, int chunks, int H, int KV,
             int64_t slots, int bs, float scale, T* out, uint32_t* work, int threads) {
    constexpr int D = NV * 16, U = D / Unit<T>::per;
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
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (parallel)
    for (int64_t it = 0; it < items; ++it) {
        int64_t rest = it;
        const int b = chunk_of(rest, key_blocks);
        const int nblk = (c.starts[b] + c.lengths[b] + KB - 1) / KB;
        const int h = static_cast<int>(rest / nblk), blk = static_cast<int>(rest % nblk);
        const int64_t base = c.packed[b * KV + h];
        pack<T>(kc + h * slots * D, vc + h * slots * D, c.tables + static_cast<int64_t>(b) * c.max_blocks,
                c.starts[b] + c.lengths[b], bs, D, blk, work + base, work + base + static_cast<int64_t>(nblk) * U * KB);
    }
    // attend: an item is (chunk, KV head, RT query rows), its rows' G query heads each
    int64_t tiles = 0;
    for (int b = 0; b < chunks; ++b) tiles += row_tiles(b);
    const float scale_log2 = scale * 1.4426950408889634f;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (parallel)
    for (int64_t it = 0; it < tiles; ++it) {
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
            attend_tile<T, NV>(qs, pos, os, nq, kp, vp, scale_log2);
        }
    }
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
        case 16: prefill<T, 1>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 32: prefill<T, 2>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 64: prefill<T, 4>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 128: prefill<T, 8>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 256: prefill<T, 16>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        default: return 1;
    }
}

}  // namespace

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
#ifdef __AVX512BF16__
    return prefill_as<uint16_t>(q, q_stride, kc, vc, c, chunks, H, KV, D, slots, bs, scale, out, work, threads);
#else
    return 1;
#endif
}

// The dtypes this build takes: 1 float32, 2 bfloat16 (a bit each).
int conveyor_paged_prefill_dtypes() {
#ifdef __AVX512BF16__
    return 3;
#else
    return 1;
#endif
}

}

#else  // no AVX512 on this CPU: the model keeps its other paths

extern "C" {
int64_t conveyor_paged_prefill_workspace(const int32_t*, const int32_t*, int, int, int, int) { return 0; }
int conveyor_paged_prefill(const void*, int64_t, const void*, const void*, int, const int32_t*, int, const int32_t*,
                           const int32_t*, const int32_t*, int, int, int, int, int64_t, int, float, void*, void*,
                           int) {
    return 1;
}
int conveyor_paged_prefill_dtypes() { return 0; }
}

#endif
