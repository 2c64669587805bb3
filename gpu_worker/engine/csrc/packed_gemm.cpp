// y = x @ W.T (+ bias) (+ residual) on weights packed once into panels of 32 output columns, bfloat16 (AVX512-BF16
// dot products, float32 sums) or float32 (AVX512F FMA), on a pool of threads that claim chunks of the output one at
// a time: a thread the OS takes away holds up the call by at most the chunk it holds, where a static split (one
// half each) holds it up until that thread runs again. A row's result is the same whatever the rows beside it: its
// sums run over K in one order in every tile. Built and loaded by gpu_worker/engine/cpu_kernels.py (C ABI, ctypes).
#include <immintrin.h>
#include <pthread.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------- pool
struct Pool;
Pool& pool();

struct Pool {
    std::atomic<uint64_t> state{0};  // job seq << 32 | next chunk
    std::atomic<uint32_t> done{0};  // chunks of the current job computed
    std::atomic<bool> waiting{false};  // the caller sleeps until `done` reaches the job's chunks
    std::atomic<int> sleepers{0};
    std::atomic<uint32_t> wake{0};
    std::atomic<bool> stop{false};
    void (*fn)(const void*, int) = nullptr;
    const void* arg = nullptr;
    int n = 0;
    uint32_t seq = 0;
    long spin = 20000;  // pauses a worker waits for the next job before it sleeps: ~0.5 ms, a layer's few calls apart
    std::vector<std::thread> workers;
    std::mutex busy;  // one job at a time: a second caller meanwhile (another thread, a nested call) runs its own
    bool forked = false;  // set in a child process (pthread_atfork): the workers stayed in the parent

    static long futex(std::atomic<uint32_t>* a, int op, uint32_t v) {
        return syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), op, v, nullptr, nullptr, 0);
    }

    // claims and runs chunks of job `s` until none is left, or job s is no longer the current one
    void work(uint32_t s) {
        for (;;) {
            uint64_t cur = state.load(std::memory_order_acquire);
            if (static_cast<uint32_t>(cur >> 32) != s) return;
            const uint32_t idx = static_cast<uint32_t>(cur);
            if (static_cast<int>(idx) >= n) return;
            if (!state.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) continue;
            fn(arg, static_cast<int>(idx));
            done.fetch_add(1, std::memory_order_seq_cst);
            if (waiting.load(std::memory_order_seq_cst)) futex(&done, FUTEX_WAKE_PRIVATE, 1);
        }
    }

    void loop() {
        uint32_t seen = 0;
        for (;;) {
            uint32_t s = static_cast<uint32_t>(state.load(std::memory_order_acquire) >> 32);
            long i = 0;
            while (s == seen && i < spin) {
                _mm_pause();
                ++i;
                s = static_cast<uint32_t>(state.load(std::memory_order_acquire) >> 32);
            }
            if (stop.load()) return;
            if (s == seen) {
                const uint32_t w = wake.load();
                sleepers.fetch_add(1);
                s = static_cast<uint32_t>(state.load() >> 32);
                if (s == seen && !stop.load()) futex(&wake, FUTEX_WAIT_PRIVATE, w);
                sleepers.fetch_sub(1);
                continue;
            }
            seen = s;
            work(s);
        }
    }

    void run(void (*f)(const void*, int), const void* a, int chunks) {
        std::unique_lock<std::mutex> mine(busy, std::try_to_lock);
        // (a process forked from this one has none of its threads: it runs its calls alone)
        if (workers.empty() || chunks <= 1 || !mine.owns_lock() || forked) {
            for (int c = 0; c < chunks; ++c) f(a, c);
            return;
        }
        fn = f, arg = a, n = chunks;
        done.store(0, std::memory_order_relaxed);
        ++seq;
        state.store(static_cast<uint64_t>(seq) << 32);
        if (sleepers.load()) {
            wake.fetch_add(1);
            futex(&wake, FUTEX_WAKE_PRIVATE, 1 << 30);
        }
        work(seq);
        // the chunks other threads still hold: spin as a worker waits for work, then sleep until the last is done
        const uint32_t all = static_cast<uint32_t>(chunks);
        for (long i = 0; done.load(std::memory_order_acquire) < all && i < spin; ++i) _mm_pause();
        if (done.load(std::memory_order_acquire) < all) {
            waiting.store(true, std::memory_order_seq_cst);
            for (uint32_t d; (d = done.load(std::memory_order_seq_cst)) < all;) futex(&done, FUTEX_WAIT_PRIVATE, d);
            waiting.store(false, std::memory_order_relaxed);
        }
    }

    void resize(int threads) {
        std::lock_guard<std::mutex> held(busy);
        stop.store(true);
        wake.fetch_add(1);
        futex(&wake, FUTEX_WAKE_PRIVATE, 1 << 30);
        for (auto& t : workers) t.join();
        workers.clear();
        stop.store(false);
        static std::once_flag once;
        std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { pool().forked = true; }); });
        for (int i = 1; i < threads; ++i) {
            workers.emplace_back([this] { loop(); });
            pthread_setname_np(workers.back().native_handle(), "conveyor-pool");  // (the loader binds them by name)
        }
    }
};

Pool& pool() {
    static Pool* p = new Pool();  // never destroyed: workers may outlive static destruction order
    return *p;
}

// ---------------------------------------------------------------- kernels
constexpr int NR = 32;  // output columns per panel: two vectors of 16

// the lanes of a vector of 16 columns that hold output columns, `left` of them from its first on
inline __mmask16 lanes(int left) {
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 bf16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

struct Args {
    const void* x;
    int64_t ldx;
    const void* w;  // packed: panels of K x 32 (bfloat16: (K + 1) / 2 pairs x 32)
    const void* bias;  // N values or null
    const void* res;  // residual [M, ldy] or null
    void* y;
    int64_t ldy;
    int M, N, K;
    int panels_per_chunk, row_blocks, rows_per_block;
};

// rows [m0, m0 + MR) x panel p: bfloat16
template <int MR>
void tile_bf16(const Args& a, int m0, int p) {
    const int K2 = a.K / 2, pairs = (a.K + 1) / 2;
    const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.ldx;
    const __m512bh* w = reinterpret_cast<const __m512bh*>(static_cast<const uint16_t*>(a.w) + int64_t(p) * pairs * 2 * NR);
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int kp = 0; kp < K2; ++kp) {
        const __m512bh w0 = w[2 * kp], w1 = w[2 * kp + 1];
        for (int m = 0; m < MR; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + m * a.ldx + 2 * kp, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            c0[m] = _mm512_dpbf16_ps(c0[m], xb, w0);
            c1[m] = _mm512_dpbf16_ps(c1[m], xb, w1);
        }
    }
    if (a.K % 2) {  // the last input alone, its pair's other half zero (in x and in the packed weight)
        const __m512bh w0 = w[2 * K2], w1 = w[2 * K2 + 1];
        for (int m = 0; m < MR; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[m * a.ldx + a.K - 1]));
            c0[m] = _mm512_dpbf16_ps(c0[m], xb, w0);
            c1[m] = _mm512_dpbf16_ps(c1[m], xb, w1);
        }
    }
    const int n0 = p * NR;
    const __mmask16 k0 = lanes(a.N - n0), k1 = lanes(a.N - n0 - 16);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (a.bias) {
        const uint16_t* b = static_cast<const uint16_t*>(a.bias) + n0;
        b0 = bf16_to_f32(_mm256_maskz_loadu_epi16(k0, b));
        b1 = bf16_to_f32(_mm256_maskz_loadu_epi16(k1, b + 16));
    }
    for (int m = 0; m < MR; ++m) {
        __m512 v0 = c0[m], v1 = c1[m];
        if (a.bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        uint16_t* y = static_cast<uint16_t*>(a.y) + (m0 + m) * a.ldy + n0;
        if (a.res) {
            const uint16_t* r = static_cast<const uint16_t*>(a.res) + (m0 + m) * a.ldy + n0;
            v0 = _mm512_add_ps(v0, bf16_to_f32(_mm256_maskz_loadu_epi16(k0, r)));
            v1 = _mm512_add_ps(v1, bf16_to_f32(_mm256_maskz_loadu_epi16(k1, r + 16)));
        }
        _mm256_mask_storeu_epi16(y, k0, (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_mask_storeu_epi16(y + 16, k1, (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

template <int MR>
void tile_f32(const Args& a, int m0, int p) {
    const float* x = static_cast<const float*>(a.x) + m0 * a.ldx;
    const float* w = static_cast<const float*>(a.w) + int64_t(p) * a.K * NR;
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int k = 0; k < a.K; ++k) {
        const __m512 w0 = _mm512_load_ps(w + k * NR), w1 = _mm512_load_ps(w + k * NR + 16);
        for (int m = 0; m < MR; ++m) {
            const __m512 xb = _mm512_set1_ps(x[m * a.ldx + k]);
            c0[m] = _mm512_fmadd_ps(xb, w0, c0[m]);
            c1[m] = _mm512_fmadd_ps(xb, w1, c1[m]);
        }
    }
    const int n0 = p * NR;
    const __mmask16 k0 = lanes(a.N - n0), k1 = lanes(a.N - n0 - 16);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (a.bias) {
        b0 = _mm512_maskz_loadu_ps(k0, static_cast<const float*>(a.bias) + n0);
        b1 = _mm512_maskz_loadu_ps(k1, static_cast<const float*>(a.bias) + n0 + 16);
    }
    for (int m = 0; m < MR; ++m) {
        __m512 v0 = c0[m], v1 = c1[m];
        if (a.bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        float* y = static_cast<float*>(a.y) + (m0 + m) * a.ldy + n0;
        if (a.res) {
            const float* r = static_cast<const float*>(a.res) + (m0 + m) * a.ldy + n0;
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(k0, r));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(k1, r + 16));
        }
        _mm512_mask_storeu_ps(y, k0, v0);
        _mm512_mask_storeu_ps(y + 16, k1, v1);
    }
}

constexpr int MR_MAX = 12;
// rows a chunk computes at most: a panel read from memory once for them all, then from cache for each tile of MR_MAX
constexpr int ROWS_MAX = 192;

template <bool BF16>
void tile(const Args& a, int m, int rows, int p) {
    switch (rows) {
#define T(R) case R: BF16 ? tile_bf16<R>(a, m, p) : tile_f32<R>(a, m, p); break;
        T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11) T(12)
#undef T
        default: break;
    }
}

// rows [m0, m1) of panel p, in tiles of at most MR_MAX rows as even as can be (64 rows: 11 x 4 + 10 x 2, not
// 12 x 5 + 4): a short tile does as many loads as a full one for fewer products
template <bool BF16>
void rows(const Args& a, int m0, int m1, int p) {
    const int n = m1 - m0, tiles = (n + MR_MAX - 1) / MR_MAX;
    if (tiles == 0) return;
    const int base = n / tiles, longer = n % tiles;
    for (int t = 0, m = m0; t < tiles; ++t) {
        const int r = base + (t < longer ? 1 : 0);
        tile<BF16>(a, m, r, p);
        m += r;
    }
}

template <bool BF16>
void chunk(const void* raw, int c) {
    const Args& a = *static_cast<const Args*>(raw);
    const int rb = c % a.row_blocks, pc = c / a.row_blocks;
    const int m0 = rb * a.rows_per_block, m1 = m0 + a.rows_per_block < a.M ? m0 + a.rows_per_block : a.M;
    const int panels = (a.N + NR - 1) / NR;
    const int p0 = pc * a.panels_per_chunk, p1 = p0 + a.panels_per_chunk < panels ? p0 + a.panels_per_chunk : panels;
    for (int p = p0; p < p1; ++p) rows<BF16>(a, m0, m1, p);
}

}  // namespace

extern "C" {

// runs fn(arg, i) for i in [0, n) on the pool and this thread (csrc/parallel.h's PoolRun, for the other kernels)
void conveyor_pool_run(void (*fn)(const void*, int), const void* arg, int n) { pool().run(fn, arg, n); }

int conveyor_gemm_threads(int threads) {
    pool().resize(threads < 1 ? 1 : threads);
    return 0;
}

void conveyor_gemm_spin(long spin) { pool().spin = spin; }

// w: [N, K] row-major (bf16 = 1: bfloat16, else float32) -> out: ceil(N / 32) panels of K x 32 (bfloat16:
// (K + 1) / 2 pairs x 32 x 2), zeros past N (and past K in bfloat16's last pair): panels x 32 x K rounded up to even
void conveyor_gemm_pack(const void* w, int N, int K, int bf16, void* out) {
    const int panels = (N + NR - 1) / NR;
    if (bf16) {
        const int pairs = (K + 1) / 2;
        const uint16_t* s = static_cast<const uint16_t*>(w);
        uint16_t* d = static_cast<uint16_t*>(out);
        for (int p = 0; p < panels; ++p)
            for (int kp = 0; kp < pairs; ++kp)
                for (int j = 0; j < NR; ++j)
                    for (int t = 0; t < 2; ++t) {
                        const int n = p * NR + j, k = 2 * kp + t;
                        d[((int64_t(p) * pairs + kp) * NR + j) * 2 + t] = n < N && k < K ? s[int64_t(n) * K + k] : 0;
                    }
    } else {
        const float* s = static_cast<const float*>(w);
        float* d = static_cast<float*>(out);
        for (int p = 0; p < panels; ++p)
            for (int k = 0; k < K; ++k)
                for (int j = 0; j < NR; ++j) {
                    const int n = p * NR + j;
                    d[(int64_t(p) * K + k) * NR + j] = n < N ? s[int64_t(n) * K + k] : 0.f;
                }
    }
}

// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W.T + bias + res (res: [M, ldy] or null)
void conveyor_gemm(const void* x, int64_t ldx, const void* wp, const void* bias, const void* res, void* y,
                   int64_t ldy, int M, int N, int K, int bf16) {
    if (M <= 0) return;
    Args a{x, ldx, wp, bias, res, y, ldy, M, N, K, 0, 0, 0};
    const int panels = (N + NR - 1) / NR;
    // blocks of rows of equal size, each at most ROWS_MAX
    a.row_blocks = (M + ROWS_MAX - 1) / ROWS_MAX;
    a.rows_per_block = (M + a.row_blocks - 1) / a.row_blocks;
    // ~ 2 x 10^6 multiply-adds a chunk
    long per_panel = long(a.rows_per_block) * K * NR;
    int ppc = static_cast<int>(2000000 / (per_panel > 0 ? per_panel : 1));
    a.panels_per_chunk = ppc < 1 ? 1 : ppc > panels ? panels : ppc;
    const int chunks = a.row_blocks * ((panels + a.panels_per_chunk - 1) / a.panels_per_chunk);
    pool().run(bf16 ? chunk<true> : chunk<false>, &a, chunks);
}
}
