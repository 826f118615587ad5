// g++ -O3 -march=native -fopenmp -ffp-contract=off -std=c++17 -DSRC="\"path/to/gemv_q4_cpu.cpp\"" gemv_q4_harness.cpp -o h && ./h N K COPIES THREADS [PLANES] [ROWS]
// pagemill_gemv_q4 on COPIES random weights of N x K (fp16 scales), x in fp32: best of 200 sweeps.
#include SRC
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
    int64_t n = atoi(argv[1]), k = atoi(argv[2]); int copies = atoi(argv[3]); int threads = atoi(argv[4]);
    int planes = argc > 5 ? atoi(argv[5]) : 2; int rows = argc > 6 ? atoi(argv[6]) : 1;
    const int64_t tiles = (n + 15) / 16, nb = k / 32, B = 320;
    const int64_t wbytes = tiles * nb * B;
    std::vector<uint8_t> w(wbytes * copies);
    std::mt19937 rng(1);
    for (auto& b : w) b = rng();
    // valid fp16 scales
    for (int64_t c = 0; c < copies; ++c) for (int64_t t = 0; t < tiles * nb; ++t) {
        uint16_t* s = reinterpret_cast<uint16_t*>(w.data() + c * wbytes + t * B);
        for (int i = 0; i < 32; ++i) s[i] = 0x2000 + (rng() & 0x3ff) + ((i >= 16) ? 0x8000 : 0);
    }
    std::vector<float> x(k * rows), y(n * rows);
    for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    double best = 1e9;
    for (int it = 0; it < 200; ++it) {
        auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < copies; ++c)
            pagemill_gemv_q4(0, x.data(), k, w.data() + c * wbytes, 2, y.data(), n, rows, n, k, threads, planes);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, dt);
    }
    double hb = double(tiles) * nb * 2 * copies;
    printf("n=%ld k=%ld copies=%d thr=%d planes=%d rows=%d: %.1f us, %.2f GB/s, %.2f ns/half-block/thread  chk %g\n",
           n, k, copies, threads, planes, rows, best * 1e6, wbytes * copies / best / 1e9, best * 1e9 / hb * threads, y[0] + y[n - 1]);
}
