// g++ -O3 -march=native -fopenmp -std=c++17 -DSRC="\"paged_decode_cpu.cpp\"" dec_harness.cpp -o hd && ./hd BATCH CTX POOL_BLOCKS THREADS ITERS
#include SRC
#include <chrono>
#include <cstdio>
#include <random>
#include <numeric>
#include <algorithm>
#include <sys/mman.h>
#include <cstdlib>
int main(int argc, char** argv) {
    int batch = atoi(argv[1]), ctx = atoi(argv[2]); int pool = atoi(argv[3]); int threads = atoi(argv[4]); int iters = atoi(argv[5]);
    const int H = 9, KVH = 3, D = 64, BS = 16;
    int nbper = (ctx + BS - 1) / BS;
    int need = batch * nbper; if (pool < need) pool = need;
    size_t nel = (size_t)pool * BS * KVH * D, nby = (nel * 4 + (2u << 20) - 1) / (2u << 20) * (2u << 20);
    float* kp = (float*)aligned_alloc(2u << 20, nby); float* vp = (float*)aligned_alloc(2u << 20, nby);
    if (getenv("HUGE")) { madvise(kp, nby, MADV_HUGEPAGE); madvise(vp, nby, MADV_HUGEPAGE); }
    struct View { float* p; size_t n; float* begin() { return p; } float* end() { return p + n; } float* data() { return p; } size_t size() const { return n; } };
    View k{kp, nel}, v{vp, nel};
    std::mt19937 rng(1);
    for (auto& x : k) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    for (auto& x : v) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    std::vector<int32_t> ids(pool); std::iota(ids.begin(), ids.end(), 0); std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> table(batch * nbper), lens(batch, ctx);
    for (int i = 0; i < batch * nbper; ++i) table[i] = ids[i % pool];
    std::vector<float> q(batch * H * D), out(batch * H * D);
    for (auto& x : q) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    float one = 1.f;
    double best = 1e9;
    for (int it = 0; it < iters; ++it) {
        auto t0 = std::chrono::steady_clock::now();
        pagemill_paged_decode(0, q.data(), k.data(), v.data(), out.data(), table.data(), nbper, lens.data(), nullptr, batch, H, KVH, D, BS, H * D, D, H * D, D, 0.125f, 0, 0.f, threads, nullptr, &one, &one, 0, nullptr, 0);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
    }
    double bytes = double(batch) * ctx * KVH * D * 4 * 2;
    printf("batch %d ctx %d pool %d thr %d: %.1f us, %.2f GB/s, %.0f ns/pair  chk %g\n", batch, ctx, pool, threads, best * 1e6, bytes / best / 1e9, best * 1e9 / (batch * KVH), out[0] + out[out.size() - 1]);
}
