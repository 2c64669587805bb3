// Prefill attention in bfloat16 that reads the paged KV cache in place: every prefill chunk of a step at once,
// each query attending causally to its sequence's tokens up to its own position (the cached ones before the chunk
// and the chunk's own), flash style: scores never leave registers, softmax online, no padded batch, no gathered
// copy of K/V. Dot products on AVX512-BF16 (vdpbf16ps: bf16 pairs summed into float32); softmax and the output in
// float32, rounded to bfloat16 once. Built and loaded by gpu_worker/engine/cpu_kernels.py (plain C ABI through
// ctypes; OpenMP shares torch's runtime). Without AVX512-BF16 it builds to a stub that declines (returns 1).
//
// Layout (gpu_worker/engine/kv_cache.py): a layer's K and V are [KV, slots, D]; token t of chunk b's sequence sits
// at slot tables[b][t / block_size] * block_size + t % block_size.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int KB = 64;  // keys a step of the online softmax takes: four vectors of 16 scores
constexpr int MR = 4;   // query vectors computed together (their dot products share each K/V load); <= 16
constexpr int RT = 32;  // query rows a work item takes (times the query heads sharing its KV head)

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

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Chunks {
    const int32_t* tables;
    int max_blocks;
    const int32_t* starts;   // each chunk's first position
    const int32_t* lengths;  // its token count
    const int32_t* offsets;  // its first row among the prefill rows
    std::vector<int64_t> packed;  // where each (chunk, KV head)'s K/V are packed in the workspace, int32 units
};

// Chunk b's keys 0..nkeys-1 for KV head h, packed for vdpbf16ps, KB keys a block:
//   K: [block][D/2][KB] int32, the pair (d, d+1) of each key: the block's scores are dot products across lanes;
//   V: [block][KB/2][D] int32, the pair (key, key+1) at each d: a pair of probabilities times it adds to out[d].
// Keys past nkeys are zeros (their scores are masked; their probabilities zero).
void pack(const uint32_t* kc, const uint32_t* vc, const int32_t* table, int nkeys, int bs, int D,
          int block, uint32_t* kp, uint32_t* vp) {
    const int P = D / 2;
    uint32_t* kb = kp + static_cast<int64_t>(block) * P * KB;
    uint32_t* vb = vp + static_cast<int64_t>(block) * P * KB;
    for (int i = 0; i < KB; ++i) {
        const int t = block * KB + i;
        if (t < nkeys) {
            const int64_t slot = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
            const uint32_t* k = kc + slot * P;
            for (int j = 0; j < P; ++j) kb[j * KB + i] = k[j];
        } else {
            for (int j = 0; j < P; ++j) kb[j * KB + i] = 0;
        }
    }
    const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vc);
    for (int i = 0; i < KB; i += 2) {
        const int t = block * KB + i;
        const uint16_t* v0 = nullptr;
        const uint16_t* v1 = nullptr;
        if (t < nkeys) v0 = v16 + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * D;
        if (t + 1 < nkeys) v1 = v16 + (static_cast<int64_t>(table[(t + 1) / bs]) * bs + (t + 1) % bs) * D;
        uint32_t* row = vb + (i / 2) * D;
        for (int d = 0; d < D; ++d)
            row[d] = (v0 ? v0[d] : 0u) | (static_cast<uint32_t>(v1 ? v1[d] : 0u) << 16);
    }
}

// MR query vectors (rows `qs` of q, positions `pos`) against keys 0 .. max(pos), out rows `os`. NV = D / 16.
template <int NV>
void attend_tile(const uint32_t* const* qs, const int* pos, uint16_t* const* os, int nq, const uint32_t* kp,
                 const uint32_t* vp, float scale_log2) {
    constexpr int D = NV * 16, P = D / 2, NK = KB / 16;
    int maxpos = pos[0], minpos = pos[0];
    for (int q = 1; q < nq; ++q) {
        maxpos = pos[q] > maxpos ? pos[q] : maxpos;
        minpos = pos[q] < minpos ? pos[q] : minpos;
    }
    alignas(64) float o[MR][D];
    alignas(64) uint16_t pb[MR][KB];
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
                for (int q = 0; q < MR; ++q) s[q][n] = dp(s[q][n], k, a[q]);
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
                _mm512_store_si512(pb[q] + n * 16, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
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
            for (int p = 0; p < KB / 2; ++p) {
                __m512i v[W];
                for (int w = 0; w < W; ++w) v[w] = _mm512_load_si512(vb + p * D + (g + w) * 16);
                for (int q = 0; q < MR; ++q) {
                    int32_t pair;
                    std::memcpy(&pair, pb[q] + 2 * p, sizeof pair);
                    const __m512i c = _mm512_set1_epi32(pair);
                    for (int w = 0; w < W; ++w) ov[q][w] = dp(ov[q][w], v[w], c);
                }
            }
            for (int q = 0; q < MR; ++q)
                for (int w = 0; w < W; ++w) _mm512_store_ps(o[q] + (g + w) * 16, ov[q][w]);
        }
    }
    for (int q = 0; q < nq; ++q) {
        const float inv = 1.f / _mm512_reduce_add_ps(l[q]);
        for (int d = 0; d < D; ++d) os[q][d] = to_bf16(o[q][d] * inv);
    }
}

template <int NV>
void prefill(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc, const Chunks& c, int chunks,
             int H, int KV, int64_t slots, int bs, float scale, uint16_t* out, uint32_t* work, int threads) {
    constexpr int D = NV * 16, P = D / 2;
    const int G = H / KV;
    // pack every chunk's K/V, a block of KB keys per item
    int64_t items = 0;
    for (int b = 0; b < chunks; ++b) items += static_cast<int64_t>(KV) * ((c.starts[b] + c.lengths[b] + KB - 1) / KB);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t it = 0; it < items; ++it) {
        int64_t rest = it;
        int b = 0;
        for (;; ++b) {
            const int64_t n = static_cast<int64_t>(KV) * ((c.starts[b] + c.lengths[b] + KB - 1) / KB);
            if (rest < n) break;
            rest -= n;
        }
        const int nblk = (c.starts[b] + c.lengths[b] + KB - 1) / KB;
        const int h = static_cast<int>(rest / nblk), blk = static_cast<int>(rest % nblk);
        const int64_t base = c.packed[b * KV + h];
        pack(reinterpret_cast<const uint32_t*>(kc + h * slots * D), reinterpret_cast<const uint32_t*>(vc + h * slots * D),
             c.tables + static_cast<int64_t>(b) * c.max_blocks, c.starts[b] + c.lengths[b], bs, D, blk,
             work + base, work + base + static_cast<int64_t>(nblk) * P * KB);
    }
    // attend: an item is (chunk, KV head, RT query rows), its rows' G query heads each
    int64_t tiles = 0;
    for (int b = 0; b < chunks; ++b) tiles += static_cast<int64_t>(KV) * ((c.lengths[b] + RT - 1) / RT);
    const float scale_log2 = scale * 1.4426950408889634f;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < tiles; ++it) {
        int64_t rest = it;
        int b = 0;
        for (;; ++b) {
            const int64_t n = static_cast<int64_t>(KV) * ((c.lengths[b] + RT - 1) / RT);
            if (rest < n) break;
            rest -= n;
        }
        const int ntile = (c.lengths[b] + RT - 1) / RT;
        const int h = static_cast<int>(rest / ntile), r0 = static_cast<int>(rest % ntile) * RT;
        const int r1 = r0 + RT < c.lengths[b] ? r0 + RT : c.lengths[b];
        const int nblk = (c.starts[b] + c.lengths[b] + KB - 1) / KB;
        const uint32_t* kp = work + c.packed[b * KV + h];
        const uint32_t* vp = kp + static_cast<int64_t>(nblk) * P * KB;
        const int nvec = (r1 - r0) * G;
        for (int v0 = 0; v0 < nvec; v0 += MR) {
            const uint32_t* qs[MR];
            uint16_t* os[MR];
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
            attend_tile<NV>(qs, pos, os, nq, kp, vp, scale_log2);
        }
    }
}

}  // namespace

extern "C" {

// Workspace int32 units the call needs (64-byte aligned): every (chunk, KV head)'s packed K and V.
int64_t conveyor_paged_prefill_workspace(const int32_t* starts, const int32_t* lengths, int chunks, int KV, int D) {
    int64_t n = 0;
    for (int b = 0; b < chunks; ++b) n += static_cast<int64_t>(KV) * ((starts[b] + lengths[b] + KB - 1) / KB) * KB * D;
    return n;
}

// q: the prefill rows' queries, row r's head hh at q + r * q_stride + hh * D (bfloat16); kc, vc: a layer's cache;
// tables [chunks, max_blocks] int32; starts, lengths, offsets [chunks] int32; out [rows, H, D] bfloat16; work:
// conveyor_paged_prefill_workspace's int32 units. Returns 1 (nothing done) for a head_dim
// other than 16, 32, 64, 128 or 256, or heads that do not group.
int conveyor_paged_prefill(const void* q, int64_t q_stride, const void* kc, const void* vc, const int32_t* tables,
                           int max_blocks, const int32_t* starts, const int32_t* lengths, const int32_t* offsets,
                           int chunks, int H, int KV, int D, int64_t slots, int bs, float scale, void* out, void* work,
                           int threads) {
    if (KV <= 0 || H % KV || chunks <= 0) return 1;
    Chunks c{tables, max_blocks, starts, lengths, offsets, std::vector<int64_t>(static_cast<size_t>(chunks) * KV)};
    int64_t at = 0;
    for (int b = 0; b < chunks; ++b)
        for (int h = 0; h < KV; ++h, at += static_cast<int64_t>((starts[b] + lengths[b] + KB - 1) / KB) * KB * D)
            c.packed[b * KV + h] = at;
    const auto* qq = static_cast<const uint16_t*>(q);
    const auto* k = static_cast<const uint16_t*>(kc);
    const auto* v = static_cast<const uint16_t*>(vc);
    auto* o = static_cast<uint16_t*>(out);
    auto* w = static_cast<uint32_t*>(work);
    switch (D) {
        case 16: prefill<1>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 32: prefill<2>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 64: prefill<4>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 128: prefill<8>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        case 256: prefill<16>(qq, q_stride, k, v, c, chunks, H, KV, slots, bs, scale, o, w, threads); return 0;
        default: return 1;
    }
}

int conveyor_paged_prefill_supported() { return 1; }

}

#else  // no AVX512-BF16 on this CPU: the model keeps its batched-matmul path

extern "C" {
int64_t conveyor_paged_prefill_workspace(const int32_t*, const int32_t*, int, int, int) { return 0; }
int conveyor_paged_prefill(const void*, int64_t, const void*, const void*, const int32_t*, int, const int32_t*,
                           const int32_t*, const int32_t*, int, int, int, int, int64_t, int, float, void*, void*, int) {
    return 1;
}
int conveyor_paged_prefill_supported() { return 0; }
}

#endif
