// y = x @ W.T (+ bias) (+ residual) on weights packed once into panels of 32 output columns, bfloat16 (AVX512-BF16
// dot products, float32 sums) or float32 (AVX512F FMA), on a pool of threads that claim chunks of the output one at
// a time: a thread the OS takes away holds up no call (the caller computes the chunk it held, see the pool), where a
// static split (one half each) holds it up until that thread runs again. A row's result is the same whatever the
// rows beside it and whichever thread computes it: its sums run over K in one order in every tile. Built and loaded by gpu_worker/engine/cpu_kernels.py (C ABI, ctypes).
#include <immintrin.h>
#include <pthread.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------- pool
// A job's chunks are claimed one at a time from a counter (`state`: job seq << 32 | next chunk). A job is either a
// kernel's loop (`run`: the caller waits for every chunk claimed) or a GEMM (`run_stealable`): there a worker
// computes its chunk into its own scratch and writes the output only once it has committed the chunk (its slot:
// claimed -> committing); a chunk whose worker the OS took away before it committed is computed again by the caller,
// who takes its slot (claimed -> the caller's), so that a preempted thread holds the call up by at most the copy of a
// chunk it had already finished. A worker that comes back to a chunk taken from it drops what it computed and counts
// itself done (`late`): it never writes after the call returned, and the caller keeps the call's inputs alive until
// every such worker is done reading them (`conveyor_gemm`'s answer, PackedGemmKernel in cpu_kernels.py).
struct Pool;
Pool& pool();

enum Slot : uint64_t { FREE = 0, WORKER = 1, COMMITTING = 2, COMMITTED = 3, CALLER = 4 };

// a growing buffer of a thread's own
struct Buffer {
    void* p = nullptr;
    size_t cap = 0;
    ~Buffer() { std::free(p); }
    void* reserve(size_t bytes) {
        if (bytes > cap) {
            std::free(p);
            cap = (bytes + 63) / 64 * 64;
            p = std::aligned_alloc(64, cap);
            if (!p) cap = 0;
        }
        return p;
    }
};

struct Stealable {
    void (*compute)(const void* args, int chunk, void* scratch) = nullptr;  // a worker's: into its scratch
    void (*commit)(const void* args, int chunk, const void* scratch) = nullptr;  // scratch -> the output
    void (*direct)(const void* args, int chunk) = nullptr;  // the caller's: straight into the output
    size_t (*scratch_bytes)(const void* args) = nullptr;
    size_t args_bytes = 0;
};

struct Pool {
    static constexpr uint32_t CLOSED = 0xFFFFFFFFu;  // next chunk while a job is set up: none to claim
    static constexpr int SLOTS = 4096;  // chunks of a stealable job at most
    std::atomic<uint64_t> state{0};  // job seq << 32 | next chunk; a stealable job's seq is odd
    std::atomic<uint32_t> done{0};  // chunks of the current job computed
    std::atomic<bool> waiting{false};  // the caller sleeps until `done` reaches the job's chunks
    std::atomic<int> sleepers{0};
    std::atomic<uint32_t> wake{0};
    std::atomic<bool> stop{false};
    std::atomic<void (*)(const void*, int)> fn{nullptr};
    std::atomic<const void*> arg{nullptr};
    std::atomic<int> n{0};
    std::atomic<uint64_t> slots[SLOTS];  // a stealable job's chunks: seq << 8 | Slot
    std::atomic<uint64_t> job_words[16];  // a stealable job's arguments, word by word
    Stealable how;  // set once (conveyor_gemm's); read by workers only for a stealable job
    // chunks the caller took from a worker computing them, workers since done with such a chunk, a test's stall
    std::atomic<uint64_t> stolen{0}, late{0}, stall_ns{0};
    uint32_t seq = 0;
    long spin = 0;  // pauses a worker waits for the next job before it sleeps (cpu_kernels.pool_spin sets it)
    std::vector<std::thread> workers;
    std::mutex busy;  // one job at a time: a second caller meanwhile (another thread, a nested call) runs its own
    bool forked = false;  // set in a child process (pthread_atfork): the workers stayed in the parent

    static long futex(std::atomic<uint32_t>* a, int op, uint32_t v) {
        return syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), op, v, nullptr, nullptr, 0);
    }
    static uint64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now().time_since_epoch()).count();
    }

    // the next chunk of job s, or -1 when none is left or s is no longer the current job
    int claim(uint32_t s) {
        for (;;) {
            uint64_t cur = state.load(std::memory_order_acquire);
            if (static_cast<uint32_t>(cur >> 32) != s) return -1;
            const uint32_t idx = static_cast<uint32_t>(cur);
            const int chunks = n.load(std::memory_order_relaxed);
            std::atomic_thread_fence(std::memory_order_acquire);  // `chunks` is job s's if the exchange succeeds
            if (idx == CLOSED || static_cast<int>(idx) >= chunks) return -1;
            if (state.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) return static_cast<int>(idx);
        }
    }

    void finished_one() {
        done.fetch_add(1, std::memory_order_seq_cst);
        if (waiting.load(std::memory_order_seq_cst)) futex(&done, FUTEX_WAKE_PRIVATE, 1);
    }

    // a worker's chunks of job s until none is left
    void work(uint32_t s) {
        for (int idx; (idx = claim(s)) >= 0;) {
            if (s & 1) {
                steal_safe_chunk(s, idx);
            } else {  // (a kernel's loop: its caller waits for this chunk, so the job's fields stay s's)
                fn.load(std::memory_order_relaxed)(arg.load(std::memory_order_relaxed), idx);
                finished_one();
            }
        }
    }

    // a worker's chunk idx of stealable job s: the arguments copied, the slot claimed (else the caller has it), the
    // chunk computed into this thread's scratch, then committed unless the caller took it meanwhile
    void steal_safe_chunk(uint32_t s, int idx) {
        uint64_t words[16];
        for (int i = 0; i < 16; ++i) words[i] = job_words[i].load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);  // the words are job s's if the slot is still free
        const uint64_t tag = static_cast<uint64_t>(s) << 8;
        uint64_t expect = tag | FREE;
        if (!slots[idx].compare_exchange_strong(expect, tag | WORKER, std::memory_order_acq_rel)) return;
        if (stall_ns.load(std::memory_order_relaxed))
            if (uint64_t ns = stall_ns.exchange(0)) std::this_thread::sleep_for(std::chrono::nanoseconds(ns));
        thread_local Buffer scratch;
        void* mine = scratch.reserve(how.scratch_bytes(words));
        if (mine) how.compute(words, idx, mine);
        expect = tag | WORKER;
        if (!mine && slots[idx].compare_exchange_strong(expect, tag | FREE, std::memory_order_acq_rel)) return;
        if (!mine || !slots[idx].compare_exchange_strong(expect, tag | COMMITTING, std::memory_order_acq_rel)) {
            late.fetch_add(1, std::memory_order_release);  // taken from this thread: done reading the inputs
            return;
        }
        how.commit(words, idx, mine);
        slots[idx].store(tag | COMMITTED, std::memory_order_release);
        finished_one();
    }

    // the seq of the job open now, or `seen` while the next is being set up
    uint32_t opened(uint32_t seen) const {
        const uint64_t cur = state.load(std::memory_order_acquire);
        return static_cast<uint32_t>(cur) == CLOSED ? seen : static_cast<uint32_t>(cur >> 32);
    }

    void loop() {
        uint32_t seen = 0;
        for (;;) {
            uint32_t s = opened(seen);
            long i = 0;
            while (s == seen && i < spin) {
                _mm_pause();
                ++i;
                s = opened(seen);
            }
            if (stop.load()) return;
            if (s == seen) {
                const uint32_t w = wake.load();
                sleepers.fetch_add(1);
                s = opened(seen);
                if (s == seen && !stop.load()) futex(&wake, FUTEX_WAIT_PRIVATE, w);
                sleepers.fetch_sub(1);
                continue;
            }
            seen = s;
            work(s);
        }
    }

    // a new job (seq odd when stealable): closed while its fields are written, then opened
    void open(bool stealable, int chunks, const uint64_t* words, void (*f)(const void*, int), const void* a) {
        seq += stealable == static_cast<bool>(seq & 1) ? 2 : 1;
        state.store(static_cast<uint64_t>(seq) << 32 | CLOSED, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        n.store(chunks, std::memory_order_relaxed);
        fn.store(f, std::memory_order_relaxed);
        arg.store(a, std::memory_order_relaxed);
        if (stealable) {
            for (int i = 0; i < 16; ++i) job_words[i].store(words[i], std::memory_order_relaxed);
            for (int i = 0; i < chunks; ++i) slots[i].store(static_cast<uint64_t>(seq) << 8, std::memory_order_relaxed);
        }
        done.store(0, std::memory_order_relaxed);
        state.store(static_cast<uint64_t>(seq) << 32, std::memory_order_seq_cst);
        if (sleepers.load()) {
            wake.fetch_add(1);
            futex(&wake, FUTEX_WAKE_PRIVATE, 1 << 30);
        }
    }

    int threads() const { return forked ? 1 : static_cast<int>(workers.size()) + 1; }  // the caller's with workers'

    bool alone(int chunks, std::unique_lock<std::mutex>& mine) const {
        // (a process forked from this one has none of its threads: it runs its calls alone)
        return workers.empty() || chunks <= 1 || !mine.owns_lock() || forked;
    }

    void run(void (*f)(const void*, int), const void* a, int chunks) {
        std::unique_lock<std::mutex> mine(busy, std::try_to_lock);
        if (alone(chunks, mine)) {
            for (int c = 0; c < chunks; ++c) f(a, c);
            return;
        }
        open(false, chunks, nullptr, f, a);
        for (int idx; (idx = claim(seq)) >= 0;) {
            f(a, idx);
            done.fetch_add(1, std::memory_order_seq_cst);
        }
        // the chunks other threads still hold: spin as a worker waits for work, then sleep until the last is done
        const uint32_t all = static_cast<uint32_t>(chunks);
        for (long i = 0; done.load(std::memory_order_acquire) < all && i < spin; ++i) _mm_pause();
        if (done.load(std::memory_order_acquire) < all) {
            waiting.store(true, std::memory_order_seq_cst);
            for (uint32_t d; (d = done.load(std::memory_order_seq_cst)) < all;) futex(&done, FUTEX_WAIT_PRIVATE, d);
            waiting.store(false, std::memory_order_relaxed);
        }
    }

    // with `busy` held, on workers (not `alone`), at most SLOTS chunks; the chunks taken from workers computing them
    int run_stealable(const void* args, int chunks) {
        uint64_t words[16] = {};
        std::memcpy(words, args, how.args_bytes);
        open(true, chunks, words, nullptr, nullptr);
        const uint64_t tag = static_cast<uint64_t>(seq) << 8;
        uint64_t took = 0, spent = 0;  // the caller's chunks, and the time they took
        int from_workers = 0;
        auto take = [&](int idx) {  // the chunk's slot, if no worker holds it yet (or holds it uncommitted)
            uint64_t v = slots[idx].load(std::memory_order_acquire);
            while ((v & 0xFF) == FREE || (v & 0xFF) == WORKER)
                if (slots[idx].compare_exchange_weak(v, tag | CALLER, std::memory_order_acq_rel)) {
                    from_workers += (v & 0xFF) == WORKER;
                    const uint64_t t0 = now_ns();
                    how.direct(args, idx);
                    spent += now_ns() - t0, ++took;
                    done.fetch_add(1, std::memory_order_seq_cst);
                    return;
                }
        };
        for (int idx; (idx = claim(seq)) >= 0;) take(idx);
        // the chunks workers hold: as long as two of the caller's own took, then computed again here unless their
        // worker is committing them
        const uint32_t all = static_cast<uint32_t>(chunks);
        const uint64_t patience = took ? 2 * spent / took : 50000, since = now_ns();
        while (done.load(std::memory_order_acquire) < all) {
            if (now_ns() - since > patience)
                for (int idx = 0; idx < chunks; ++idx) take(idx);
            _mm_pause();
        }
        stolen.fetch_add(from_workers, std::memory_order_relaxed);
        return from_workers;
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
    const void* res;  // residual [M, ldr] or null
    int64_t ldr;
    void* y;  // row m, column n at y + (m - y_row0) * ldy + n - y_col0 (a worker's scratch holds its chunk's alone)
    int64_t ldy;
    int64_t y_row0, y_col0;
    int M, N, K, bf16;
    int panels_per_chunk, row_blocks, rows_per_block;
};
static_assert(sizeof(Args) <= 16 * sizeof(uint64_t), "a job's arguments travel in Pool::job_words");

// rows [m0, m0 + MR) x panel p: bfloat16
template <int MR, bool PF>
void tile_bf16(const Args& a, int m0, int p, const char* pf) {
    const int K2 = a.K / 2, pairs = (a.K + 1) / 2;
    const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.ldx;
    const __m512bh* w = reinterpret_cast<const __m512bh*>(static_cast<const uint16_t*>(a.w) + int64_t(p) * pairs * 2 * NR);
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int kp = 0; kp < K2; ++kp) {
        if (PF) _mm_prefetch(pf + kp * 128, _MM_HINT_T0), _mm_prefetch(pf + kp * 128 + 64, _MM_HINT_T0);
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
        uint16_t* y = static_cast<uint16_t*>(a.y) + (m0 + m - a.y_row0) * a.ldy + n0 - a.y_col0;
        if (a.res) {
            const uint16_t* r = static_cast<const uint16_t*>(a.res) + (m0 + m) * a.ldr + n0;
            v0 = _mm512_add_ps(v0, bf16_to_f32(_mm256_maskz_loadu_epi16(k0, r)));
            v1 = _mm512_add_ps(v1, bf16_to_f32(_mm256_maskz_loadu_epi16(k1, r + 16)));
        }
        _mm256_mask_storeu_epi16(y, k0, (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_mask_storeu_epi16(y + 16, k1, (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

template <int MR, bool PF>
void tile_f32(const Args& a, int m0, int p, const char* pf) {
    const float* x = static_cast<const float*>(a.x) + m0 * a.ldx;
    const float* w = static_cast<const float*>(a.w) + int64_t(p) * a.K * NR;
    __m512 c0[MR], c1[MR];
    for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
    for (int k = 0; k < a.K; ++k) {
        if (PF) _mm_prefetch(pf + k * 128, _MM_HINT_T0), _mm_prefetch(pf + k * 128 + 64, _MM_HINT_T0);
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
        float* y = static_cast<float*>(a.y) + (m0 + m - a.y_row0) * a.ldy + n0 - a.y_col0;
        if (a.res) {
            const float* r = static_cast<const float*>(a.res) + (m0 + m) * a.ldr + n0;
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
void tile(const Args& a, int m, int rows, int p, const char* pf) {
    switch (rows) {
#define T(R) case R: if (pf) BF16 ? tile_bf16<R, true>(a, m, p, pf) : tile_f32<R, true>(a, m, p, pf); \
                     else BF16 ? tile_bf16<R, false>(a, m, p, pf) : tile_f32<R, false>(a, m, p, pf); break;
        T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11) T(12)
#undef T
        default: break;
    }
}

// rows [m0, m1) of panel p, in tiles of at most MR_MAX rows as even as can be (64 rows: 11 x 4 + 10 x 2, not
// 12 x 5 + 4): a short tile does as many loads as a full one for fewer products. The first tile asks for panel
// `next_p` (128 bytes a step of its loop over K) while it computes: a step's weights come from memory once, a few
// rows of products per byte, and the hardware's prefetcher alone left half of the bandwidth unused (30 layers of
// the default model at 32 rows, each layer's weights cold: float32 24.2 -> 20.1 ms, bfloat16 12.6 -> 9.7; the
// next panel spread over all the tiles, two panels ahead, or asked into L2 only were each slower)
template <bool BF16>
void rows(const Args& a, int m0, int m1, int p, int next_p) {
    const int n = m1 - m0, tiles = (n + MR_MAX - 1) / MR_MAX;
    if (tiles == 0) return;
    const int base = n / tiles, longer = n % tiles;
    const int64_t panel_bytes = BF16 ? int64_t((a.K + 1) / 2) * 2 * NR * 2 : int64_t(a.K) * NR * 4;
    const char* next = next_p >= 0 ? static_cast<const char*>(a.w) + next_p * panel_bytes : nullptr;
    for (int t = 0, m = m0; t < tiles; ++t) {
        const int r = base + (t < longer ? 1 : 0);
        tile<BF16>(a, m, r, p, t == 0 ? next : nullptr);
        m += r;
    }
}

struct Bounds {
    int m0, m1, p0, p1;
};

int panels_of(const Args& a) { return (a.N + NR - 1) / NR; }

// a call's chunks: its row blocks times its columns' chunks of panels_per_chunk panels
int chunks_of(const Args& a) {
    return a.row_blocks * ((panels_of(a) + a.panels_per_chunk - 1) / a.panels_per_chunk);
}

Bounds bounds(const Args& a, int c) {
    const int rb = c % a.row_blocks, pc = c / a.row_blocks;
    const int m0 = rb * a.rows_per_block, m1 = m0 + a.rows_per_block < a.M ? m0 + a.rows_per_block : a.M;
    const int panels = panels_of(a);
    const int p0 = pc * a.panels_per_chunk, p1 = p0 + a.panels_per_chunk < panels ? p0 + a.panels_per_chunk : panels;
    return {m0, m1, p0, p1};
}

void chunk(const void* raw, int c) {
    const Args& a = *static_cast<const Args*>(raw);
    const Bounds b = bounds(a, c);
    // after its own panels, a thread most likely claims the chunk as many chunks on as there are threads
    const int ahead = c + pool().threads();
    const int after = ahead < chunks_of(a) ? bounds(a, ahead).p0 : -1;
    for (int p = b.p0; p < b.p1; ++p) {
        const int next = p + 1 < b.p1 ? p + 1 : after;
        a.bf16 ? rows<true>(a, b.m0, b.m1, p, next) : rows<false>(a, b.m0, b.m1, p, next);
    }
}

// a worker's chunk c into its scratch: rows m0.. and columns from panel p0 on, panels_per_chunk panels wide
void chunk_to_scratch(const void* raw, int c, void* scratch) {
    Args a = *static_cast<const Args*>(raw);
    const Bounds b = bounds(a, c);
    a.y = scratch, a.ldy = int64_t(a.panels_per_chunk) * NR, a.y_row0 = b.m0, a.y_col0 = int64_t(b.p0) * NR;
    chunk(&a, c);
}

void commit_scratch(const void* raw, int c, const void* scratch) {
    const Args& a = *static_cast<const Args*>(raw);
    const Bounds b = bounds(a, c);
    const size_t elem = a.bf16 ? 2 : 4, width = size_t(a.panels_per_chunk) * NR;
    const int n0 = b.p0 * NR, n1 = b.p1 * NR < a.N ? b.p1 * NR : a.N;
    for (int m = b.m0; m < b.m1; ++m)
        std::memcpy(static_cast<char*>(a.y) + (m * a.ldy + n0) * elem,
                    static_cast<const char*>(scratch) + (m - b.m0) * width * elem, (n1 - n0) * elem);
}

size_t scratch_bytes(const void* raw) {
    const Args& a = *static_cast<const Args*>(raw);
    return size_t(a.rows_per_block) * a.panels_per_chunk * NR * (a.bf16 ? 2 : 4);
}

}  // namespace

extern "C" {

// runs fn(arg, i) for i in [0, n) on the pool and this thread (csrc/parallel.h's PoolRun, for the other kernels)
void conveyor_pool_run(void (*fn)(const void*, int), const void* arg, int n) { pool().run(fn, arg, n); }

int conveyor_gemm_threads(int threads) {
    Pool& p = pool();
    p.how = {chunk_to_scratch, commit_scratch, chunk, scratch_bytes, sizeof(Args)};
    p.resize(threads < 1 ? 1 : threads);
    return 0;
}

// chunks taken from workers computing them, and how many of those workers have since stopped reading the inputs
uint64_t conveyor_pool_stolen() { return pool().stolen.load(std::memory_order_relaxed); }
uint64_t conveyor_pool_late() { return pool().late.load(std::memory_order_acquire); }

// the next chunk a worker claims in a GEMM call waits this long first, once (tests)
void conveyor_pool_stall_next(uint64_t ns) { pool().stall_ns.store(ns); }

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

// y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W.T + bias + res (res: [M, ldy] or null). Answers the
// chunks taken from workers the OS took away mid-chunk: those may still read x, W, bias and res after this returns,
// until conveyor_pool_late() reaches conveyor_pool_stolen()
int conveyor_gemm(const void* x, int64_t ldx, const void* wp, const void* bias, const void* res, void* y,
                  int64_t ldy, int M, int N, int K, int bf16) {
    if (M <= 0) return 0;
    Args a{x, ldx, wp, bias, res, ldy, y, ldy, 0, 0, M, N, K, bf16, 0, 0, 0};
    const int panels = (N + NR - 1) / NR;
    // blocks of rows of equal size, each at most ROWS_MAX
    a.row_blocks = (M + ROWS_MAX - 1) / ROWS_MAX;
    a.rows_per_block = (M + a.row_blocks - 1) / a.row_blocks;
    // ~ 2 x 10^6 multiply-adds a chunk, and no fewer chunks than threads where each still gets 2^17 (at one row,
    // 512 KB of float32 weights): at a row or two a layer's matrix is under 2 x 10^6 and would be one chunk, its
    // weights streamed from memory by one thread; a smaller product is over before a second thread would help
    Pool& p = pool();
    long per_panel = long(a.rows_per_block) * K * NR;
    int ppc = static_cast<int>(2000000 / (per_panel > 0 ? per_panel : 1));
    const int threads = p.threads(), share = (panels + threads - 1) / threads;
    if (ppc > share && long(share) * per_panel >= (1L << 17)) ppc = share;
    a.panels_per_chunk = ppc < 1 ? 1 : ppc > panels ? panels : ppc;
    const int chunks = chunks_of(a);
    {
        std::unique_lock<std::mutex> mine(p.busy, std::try_to_lock);
        if (!p.alone(chunks, mine) && chunks <= Pool::SLOTS) return p.run_stealable(&a, chunks);
    }
    p.run(chunk, &a, chunks);
    return 0;
}
}
