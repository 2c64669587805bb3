// A decoder layer's small elementwise steps, each one pass in place of several torch ops (on CPU, at decode
// batch sizes, a step's time there is mostly per-op overhead): RMSNorm, SiLU(gate) * up, RoPE applied to q and k
// with the new K/V written to its cache slots, and the causal softmax of batched prefill attention. float32 (bf16 = 0) or bfloat16 (bf16 = 1), computed in
// float32 and rounded where transformers' own forward rounds. Built and loaded by
// gpu_worker/engine/cpu_kernels.py (plain C ABI through ctypes; OpenMP shares torch's runtime).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "parallel.h"

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float round_as(float, float x) { return x; }
inline float round_as(uint16_t, float x) {
    uint16_t b;
    store(&b, x);
    return load(b);
}

// rows at most this many elements in all run on one thread: below it, waking the others costs more
constexpr int64_t kSerialBelow = 1 << 15;

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t n, int c, float eps, int threads) {
    conveyor::parallel_for(n, n * c >= kSerialBelow, threads, [&](int64_t r) {
        const T* xr = x + r * c;
        float ss = 0.f;
        for (int i = 0; i < c; ++i) ss += load(xr[i]) * load(xr[i]);
        const float inv = 1.f / std::sqrt(ss / c + eps);
        T* o = out + r * c;
        for (int i = 0; i < c; ++i) store(o + i, round_as(T{}, load(xr[i]) * inv) * load(w[i]));
    });
}

template <typename T>
void silu_mul(const T* gu, T* out, int64_t n, int inter, int threads) {
    conveyor::parallel_for(n, n * inter >= kSerialBelow, threads, [&](int64_t r) {
        const T* g = gu + r * 2 * inter;
        const T* u = g + inter;
        T* o = out + r * inter;
        for (int i = 0; i < inter; ++i) {
            const float gv = load(g[i]);
            store(o + i, round_as(T{}, gv / (1.f + std::exp(-gv))) * load(u[i]));
        }
    });
}

// qkv [n, H + 2 KV, D]: RoPE on its first H + KV heads in place (x * cos + roll(x, D/2) * sin_signed, the
// tables [positions, D]), then each token's k and v written to slot slots[t] of kc, vc ([KV, slots, D]).
template <typename T>
void rope_and_cache(T* qkv, const T* cos, const T* sin, const int64_t* pos, const int64_t* slots, T* kc, T* vc,
                    int64_t n, int H, int KV, int D, int64_t cache_slots, int threads) {
    const int half = D / 2, heads = H + 2 * KV;
    conveyor::parallel_for(n, n * heads * D >= kSerialBelow, threads, [&](int64_t t) {
        const T* c = cos + pos[t] * D;
        const T* s = sin + pos[t] * D;
        float x[512];
        for (int h = 0; h < H + KV; ++h) {
            T* row = qkv + (t * heads + h) * D;
            for (int d = 0; d < D; ++d) x[d] = load(row[d]);
            for (int d = 0; d < D; ++d) {
                const float a = round_as(T{}, x[d] * load(c[d]));
                store(row + d, a + x[d < half ? d + half : d - half] * load(s[d]));
            }
        }
        const T* k = qkv + (t * heads + H) * D;
        const T* v = k + KV * D;
        for (int h = 0; h < KV; ++h) {
            std::memcpy(kc + (h * cache_slots + slots[t]) * D, k + h * D, sizeof(T) * D);
            std::memcpy(vc + (h * cache_slots + slots[t]) * D, v + h * D, sizeof(T) * D);
        }
    });
}

// scores [chunks * KV, G * rows, keys], one block of a padded prefill batch's rows (Llama._prefill_batch): its
// query row i of chunk b sits at position starts[b] + row0 + i and sees keys 0 .. that position. Softmax in place
// over those (float32 math, rounded once to T), zeros past them.
template <typename T>
void causal_softmax(T* scores, const int64_t* starts, int64_t chunks, int KV, int G, int rows, int keys, int row0,
                    int threads) {
    const int64_t n = chunks * KV * G * rows;
    const int64_t stride = (keys + 15) / 16 * 16;
    conveyor::parallel_for(n, n * keys >= kSerialBelow, threads, [&](int64_t idx) {
        float* buf = conveyor::scratch(stride);
        const int64_t b = idx / (static_cast<int64_t>(G) * rows * KV);
        const int64_t seen = starts[b] + row0 + idx % rows + 1;
        const int limit = seen < keys ? static_cast<int>(seen) : keys;
        T* row = scores + idx * keys;
        float m = -INFINITY;
        for (int k = 0; k < limit; ++k) {
            buf[k] = load(row[k]);
            m = buf[k] > m ? buf[k] : m;
        }
        float sum = 0.f;
        for (int k = 0; k < limit; ++k) {
            buf[k] = std::exp(buf[k] - m);
            sum += buf[k];
        }
        const float inv = 1.f / sum;
        for (int k = 0; k < limit; ++k) store(row + k, buf[k] * inv);
        for (int k = limit; k < keys; ++k) store(row + k, 0.f);
    }, 16);
}

}  // namespace

CONVEYOR_SET_POOL

extern "C" {

void conveyor_causal_softmax(void* scores, const int64_t* starts, int bf16, int64_t chunks, int KV, int G, int rows,
                             int keys, int row0, int threads) {
    if (bf16)
        causal_softmax(static_cast<uint16_t*>(scores), starts, chunks, KV, G, rows, keys, row0, threads);
    else
        causal_softmax(static_cast<float*>(scores), starts, chunks, KV, G, rows, keys, row0, threads);
}

void conveyor_rms_norm(const void* x, const void* w, void* out, int bf16, int64_t n, int c, float eps, int threads) {
    if (bf16)
        rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), n, c,
                 eps, threads);
    else
        rms_norm(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<float*>(out), n, c, eps,
                 threads);
}

void conveyor_silu_mul(const void* gu, void* out, int bf16, int64_t n, int inter, int threads) {
    if (bf16)
        silu_mul(static_cast<const uint16_t*>(gu), static_cast<uint16_t*>(out), n, inter, threads);
    else
        silu_mul(static_cast<const float*>(gu), static_cast<float*>(out), n, inter, threads);
}

// Returns 1 (nothing done) for a head_dim over 512 or odd.
int conveyor_rope_and_cache(void* qkv, const void* cos, const void* sin, const int64_t* pos, const int64_t* slots,
                            void* kc, void* vc, int bf16, int64_t n, int H, int KV, int D, int64_t cache_slots,
                            int threads) {
    if (D > 512 || D % 2) return 1;
    if (bf16)
        rope_and_cache(static_cast<uint16_t*>(qkv), static_cast<const uint16_t*>(cos),
                       static_cast<const uint16_t*>(sin), pos, slots, static_cast<uint16_t*>(kc),
                       static_cast<uint16_t*>(vc), n, H, KV, D, cache_slots, threads);
    else
        rope_and_cache(static_cast<float*>(qkv), static_cast<const float*>(cos), static_cast<const float*>(sin), pos,
                       slots, static_cast<float*>(kc), static_cast<float*>(vc), n, H, KV, D, cache_slots, threads);
    return 0;
}

}
