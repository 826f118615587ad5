// g++ -O3 -march=native -fopenmp -std=c++17 -DSRC="\"gemv_q4_cpu.cpp\"" q4h.cpp -o h && ./h THREADS
#include SRC
#include <chrono>
#include <cstdio>
#include <random>
#include <omp.h>
struct M { int64_t n, k; uint8_t* w; int64_t bytes; };
int main(int argc, char** argv) {
    int threads = atoi(argv[1]); int sweeps = argc > 2 ? atoi(argv[2]) : 30;
    int layers = 30;
    std::vector<M> ms;
    int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    std::mt19937 rng(1);
    int64_t total = 0;
    for (int l = 0; l < layers; ++l) for (auto& s : shapes) {
        int64_t tiles = (s[0] + 15) / 16, nb = s[1] / 32, B = 64 + 256;
        int64_t bytes = tiles * nb * B;
        uint8_t* w = (uint8_t*)aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (int64_t i = 0; i < bytes; ++i) w[i] = rng();
        for (int64_t t = 0; t < tiles * nb; ++t) { uint16_t* sc = (uint16_t*)(w + t * B); for (int i = 0; i < 32; ++i) sc[i] = 0x2000 + (rng() & 0x3ff); }
        ms.push_back({s[0], s[1], w, bytes}); total += bytes;
    }
    std::vector<float> x(3072), y(3072);
    for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    double best = 1e9, bestr = 1e9;
    volatile int64_t sink = 0;
    for (int it = 0; it < sweeps; ++it) {
        auto t0 = std::chrono::steady_clock::now();
        for (auto& m : ms) pagemill_gemv_q4(0, x.data(), m.k, m.w, 2, y.data(), m.n, 1, m.n, m.k, threads, 2);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
        // The same bytes read by a plain parallel sum, per matrix.
        t0 = std::chrono::steady_clock::now();
        for (auto& m : ms) {
            int64_t nv = m.bytes / 32; const __m256i* p = (const __m256i*)m.w; int64_t acc = 0;
#pragma omp parallel num_threads(threads) reduction(+:acc)
            {
                __m256i a = _mm256_setzero_si256();
#pragma omp for schedule(static) nowait
                for (int64_t i = 0; i < nv; ++i) a = _mm256_add_epi64(a, _mm256_load_si256(p + i));
                acc += _mm256_extract_epi64(a, 0) + _mm256_extract_epi64(a, 1);
            }
            sink += acc;
        }
        dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        bestr = std::min(bestr, dt);
    }
    printf("thr=%d  %.1f MB: gemv %.3f ms (%.1f GB/s)   plain read %.3f ms (%.1f GB/s)\n", threads, total / 1e6,
           best * 1e3, total / best / 1e9, bestr * 1e3, total / bestr / 1e9);
}
