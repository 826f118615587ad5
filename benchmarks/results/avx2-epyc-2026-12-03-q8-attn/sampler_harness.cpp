#include SRC
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
    int64_t n = atoi(argv[1]), vocab = 49152, block = atoi(argv[2]); int threads = atoi(argv[3]);
    std::vector<float> x(n * vocab); std::mt19937 rng(1);
    for (auto& v : x) v = std::normal_distribution<float>(0, 3)(rng);
    std::vector<float> temp(n, 0.8f), peak(n); int64_t nb = (vocab + block - 1) / block; std::vector<float> sums(n * nb);
    double best = 1e9;
    for (int it = 0; it < 30; ++it) {
        auto t0 = std::chrono::steady_clock::now();
        pagemill_sampler_block_sums(0, x.data(), vocab, nullptr, n, vocab, temp.data(), peak.data(), 1, nullptr, nullptr, sums.data(), nb, block, threads);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("rows %ld block %ld threads %d: %.2f ms, %.2f ns/logit  (%g)\n", n, block, threads, best * 1e3, best * 1e9 / (n * vocab), sums[0]);
}
