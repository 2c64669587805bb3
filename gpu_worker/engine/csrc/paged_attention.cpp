// Decode attention that reads the paged KV cache in place: one query token per row, each row reading its
// own blocks up to its own length, no gather into a padded copy. Built and loaded by
// gpu_worker/engine/paged_attention.py (plain C ABI through ctypes; OpenMP shares torch's runtime).
//
// Layout (gpu_worker/engine/kv_cache.py): a layer's K and V are [KV, slots, D]; a row's token t sits at
// slot tables[row][t / block_size] * block_size + t % block_size.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "parallel.h"

namespace {

constexpr int64_t kSerialBelow = 1 << 15;

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bfloat16: the high half of a float32
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Asks for a block's rows of one head ahead of their use. A step reads each row's K/V once, long after the weights
// have pushed it out of cache, and a row's blocks lie apart (a block of one head is a few KB), so the hardware's
// prefetcher, which follows a stream within a page, would start every block on a miss: the K pass asks for the next
// block's K and this block's V (read by the second pass).
template <typename T, int D>
inline void prefetch_block(const T* p, int n) {
    const char* c = reinterpret_cast<const char*>(p);
    const int bytes = n * D * static_cast<int>(sizeof(T));
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Row r, KV head h: the G query heads that share h, against the row's first len tokens. `scores` holds G rows of
// `stride` floats, 64-byte aligned, stride a multiple of 16: the vectorised loops over a row's scores then split
// the same way whatever else is in the batch, so a row's result never depends on its neighbours.
template <typename T, int D>
void attend_one(const float* q, const T* kc, const T* vc, const int32_t* table, int len, int64_t slots, int bs,
                int G, float scale, float* scores, int64_t stride, float* out) {
    const int nblk = (len + bs - 1) / bs;
    auto rows_in = [&](int b) { return len - b * bs < bs ? len - b * bs : bs; };  // block b's tokens
    prefetch_block<T, D>(kc + static_cast<int64_t>(table[0]) * bs * D, rows_in(0));
    for (int b = 0, t = 0; b < nblk; ++b) {
        const int64_t base = static_cast<int64_t>(table[b]) * bs;
        const int n = rows_in(b);
        if (b + 1 < nblk) prefetch_block<T, D>(kc + static_cast<int64_t>(table[b + 1]) * bs * D, rows_in(b + 1));
        prefetch_block<T, D>(vc + base * D, n);
        for (int i = 0; i < n; ++i, ++t) {
            const T* k = kc + (base + i) * D;
            for (int g = 0; g < G; ++g) {
                const float* qg = q + g * D;
                float s = 0.f;
                for (int d = 0; d < D; ++d) s += qg[d] * load(k[d]);
                scores[g * stride + t] = s * scale;
            }
        }
    }
    float inv[64];
    for (int g = 0; g < G; ++g) {
        float* sg = scores + g * stride;
        float m = sg[0];
        for (int t = 1; t < len; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int t = 0; t < len; ++t) {
            sg[t] = std::exp(sg[t] - m);
            sum += sg[t];
        }
        inv[g] = 1.f / sum;
    }
    float acc[64 * D];
    std::memset(acc, 0, sizeof(float) * G * D);
    for (int b = 0, t = 0; b < nblk; ++b) {
        const int64_t base = static_cast<int64_t>(table[b]) * bs;
        const int n = len - t < bs ? len - t : bs;
        for (int i = 0; i < n; ++i, ++t) {
            const T* v = vc + (base + i) * D;
            float vf[D];
            for (int d = 0; d < D; ++d) vf[d] = load(v[d]);
            for (int g = 0; g < G; ++g) {
                const float p = scores[g * stride + t];
                float* a = acc + g * D;
                for (int d = 0; d < D; ++d) a[d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv[g];
}

template <typename T, int D>
void run(const float* q, const T* kc, const T* vc, const int32_t* tables, int max_blocks, const int32_t* lens,
         int rows, int H, int KV, int64_t slots, int bs, float scale, float* out, int threads) {
    const int G = H / KV;
    int longest = 1;
    int64_t read = 0;  // tokens read by all rows
    for (int r = 0; r < rows; ++r) {
        longest = lens[r] > longest ? lens[r] : longest;
        read += lens[r];
    }
    const int64_t stride = (longest + 15) / 16 * 16;
    // below kSerialBelow multiply-adds a step's attention runs on this thread alone: waking the others (and, on a
    // busy machine, waiting for them to get a core) costs more than the work
    conveyor::parallel_for(static_cast<int64_t>(rows) * KV, read * H * D >= kSerialBelow, threads, [&](int64_t task) {
        const int r = static_cast<int>(task / KV), h = static_cast<int>(task % KV);
        attend_one<T, D>(q + (static_cast<int64_t>(r) * H + h * G) * D, kc + h * slots * D, vc + h * slots * D,
                         tables + static_cast<int64_t>(r) * max_blocks, lens[r], slots, bs, G, scale,
                         conveyor::scratch(G * stride), stride, out + (static_cast<int64_t>(r) * H + h * G) * D);
    });
}

template <typename T>
int dispatch(const float* q, const void* kc, const void* vc, const int32_t* tables, int max_blocks,
             const int32_t* lens, int rows, int H, int KV, int D, int64_t slots, int bs, float scale, float* out,
             int threads) {
    const T* k = static_cast<const T*>(kc);
    const T* v = static_cast<const T*>(vc);
    switch (D) {
        case 64: run<T, 64>(q, k, v, tables, max_blocks, lens, rows, H, KV, slots, bs, scale, out, threads); return 0;
        case 128: run<T, 128>(q, k, v, tables, max_blocks, lens, rows, H, KV, slots, bs, scale, out, threads); return 0;
        case 16: run<T, 16>(q, k, v, tables, max_blocks, lens, rows, H, KV, slots, bs, scale, out, threads); return 0;
        case 32: run<T, 32>(q, k, v, tables, max_blocks, lens, rows, H, KV, slots, bs, scale, out, threads); return 0;
        case 256: run<T, 256>(q, k, v, tables, max_blocks, lens, rows, H, KV, slots, bs, scale, out, threads); return 0;
        default: return 1;
    }
}

}  // namespace

CONVEYOR_SET_POOL

extern "C" {

// q: [rows, H, D] float32; kc, vc: one layer's [KV, slots, D] in float32 (bf16 = 0) or bfloat16 (bf16 = 1);
// tables: [rows, max_blocks] int32; lens: [rows] int32, each >= 1; out: [rows, H, D] float32.
// Returns 0, or 1 for a shape it has no kernel for (head_dim not 16/32/64/128/256, or more than 64 query heads
// per KV head): the caller falls back.
int conveyor_paged_decode(const float* q, const void* kc, const void* vc, int bf16, const int32_t* tables,
                          int max_blocks, const int32_t* lens, int rows, int H, int KV, int D, int64_t slots, int bs,
                          float scale, float* out, int threads) {
    if (KV <= 0 || H % KV != 0 || H / KV > 64) return 1;
    if (bf16)
        return dispatch<uint16_t>(q, kc, vc, tables, max_blocks, lens, rows, H, KV, D, slots, bs, scale, out, threads);
    return dispatch<float>(q, kc, vc, tables, max_blocks, lens, rows, H, KV, D, slots, bs, scale, out, threads);
}

}
