// g++ -O3 -march=native -fopenmp -std=c++17 -DSRC="\"path/to/gemv_q8_cpu.cpp\"" gemv_q8_harness.cpp -o h && ./h N K COPIES THREADS [PLANES] [ROWS]
// pagemill_gemv_q8 on COPIES random Q8_0 weights of N x K, x in fp32: best of SWEEPS sweeps.
#include SRC
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
    int64_t n = atoi(argv[1]), k = atoi(argv[2]); int copies = atoi(argv[3]); int threads = atoi(argv[4]);
    int planes = argc > 5 ? atoi(argv[5]) : 2; int rows = argc > 6 ? atoi(argv[6]) : 1;
    int sweeps = argc > 7 ? atoi(argv[7]) : 50;
    const int64_t tiles = (n + 15) / 16, nb = k / 32, B = 544;
    const int64_t wbytes = tiles * nb * B;
    std::vector<uint8_t> w(wbytes * copies);
    std::mt19937 rng(1);
    for (auto& b : w) b = rng();
    for (int64_t c = 0; c < copies; ++c) for (int64_t t = 0; t < tiles * nb; ++t) {
        uint16_t* s = reinterpret_cast<uint16_t*>(w.data() + c * wbytes + t * B);
        for (int i = 0; i < 16; ++i) s[i] = 0x2000 + (rng() & 0x3ff);
    }
    std::vector<float> x(k * rows), y(n * rows);
    for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    double best = 1e9;
    for (int it = 0; it < sweeps; ++it) {
        auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < copies; ++c)
            pagemill_gemv_q8(0, x.data(), k, w.data() + c * wbytes, y.data(), n, rows, n, k, threads, planes);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
    }
    double chk = 0; for (auto v : y) chk += v;
    printf("n=%ld k=%ld copies=%d thr=%d planes=%d rows=%d: %.1f us/call, %.2f GB/s, %.1f GMAC/s  chk %.6g\n",
           n, k, copies, threads, planes, rows, best * 1e6 / copies, wbytes * copies / best / 1e9,
           double(n) * k * rows * copies / best / 1e9, chk);
}
