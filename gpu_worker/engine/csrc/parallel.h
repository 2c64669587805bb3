// How a kernel's loop runs on several threads: on the engine's pool of threads (csrc/packed_gemm.cpp) where the loader
// installed it (`conveyor_set_pool`, gpu_worker/engine/cpu_kernels.py), else on OpenMP's team. The pool's threads
// claim items one at a time and nothing waits for a thread that has claimed none, so a thread the OS lends to
// another process holds the loop up by at most the item it holds; OpenMP's team ends each loop at a barrier.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace conveyor {

// runs fn(arg, i) for every i in [0, n), on the pool's threads and the caller's, and returns when all have run
using PoolRun = void (*)(void (*fn)(const void*, int), const void* arg, int n);

inline PoolRun& pool_run() {
    static PoolRun run = nullptr;  // one per library: each is installed by the loader
    return run;
}

template <class F>
void call_item(const void* body, int i) {
    (*static_cast<const F*>(body))(static_cast<int64_t>(i));
}

// body(i) for i in [0, n), in parallel when `parallel`: on the pool if installed, else on `threads` OpenMP threads
// (dynamic: `grain` items a claim)
template <class F>
void parallel_for(int64_t n, bool parallel, int threads, F&& body, int grain = 1) {
    if (!parallel || n <= 1) {
        for (int64_t i = 0; i < n; ++i) body(i);
        return;
    }
    if (PoolRun run = pool_run()) {
        auto claim = [&](int64_t c) {
            const int64_t end = (c + 1) * grain < n ? (c + 1) * grain : n;
            for (int64_t i = c * grain; i < end; ++i) body(i);
        };
        run(call_item<decltype(claim)>, &claim, static_cast<int>((n + grain - 1) / grain));
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, grain)
    for (int64_t i = 0; i < n; ++i) body(i);
}

// this thread's scratch of at least n floats, 64-byte aligned (vectorised loops then split a row the same way
// wherever it sits), kept for the thread's next item
inline float* scratch(int64_t n) {
    struct Buf {
        float* p = nullptr;
        int64_t cap = 0;
        ~Buf() { std::free(p); }
    };
    thread_local Buf buf;
    if (buf.cap < n) {
        std::free(buf.p);
        buf.cap = (n + 15) / 16 * 16;
        buf.p = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * buf.cap));
    }
    return buf.p;
}

}  // namespace conveyor

#define CONVEYOR_SET_POOL \
    extern "C" void conveyor_set_pool(conveyor::PoolRun run) { conveyor::pool_run() = run; }
