// One row of x (bf16, two activation planes) through pagemill_gemv_q4 against N x K
// Q4_1-like tiles, called ITERS times in a row: the same weights every call, so they stay
// in the caches up to a few MB and what is timed is the kernel's arithmetic plus its
// per-call cost (the quantize step and one OpenMP region), without torch around it.
//
//   g++ -O3 -march=native -fopenmp -shared -fPIC \
//       packages/kernels/src/pagemill/kernels/csrc/gemv_q4_cpu.cpp -o libg.so
//   g++ -O2 gemv_call_harness.cpp -L. -lg -Wl,-rpath,. -fopenmp -o h
//   ./h N K ITERS THREADS     # e.g. ./h 3072 576 5000 2
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
extern "C" int pagemill_gemv_q4(int dtype, const void* x, int64_t x_stride, const void* w, int scale_bytes,
                     void* y, int64_t y_stride, int64_t m_rows, int64_t n, int64_t k, int threads, int planes);
int main(int argc, char** argv) {
  int64_t n = atoi(argv[1]), k = atoi(argv[2]); int iters = atoi(argv[3]), th = atoi(argv[4]);
  int64_t nb = k / 32, tiles = (n + 15) / 16;
  std::vector<uint8_t> w(tiles * nb * (64 + 256));
  for (size_t i = 0; i < w.size(); i++) w[i] = (i * 37) & 0x3b;  // small fp16 scales, any nibbles
  std::vector<uint16_t> x(k, 0x3f80), y(n);
  std::vector<double> ts;
  for (int r = 0; r < 9; r++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; i++) pagemill_gemv_q4(1, x.data(), k, w.data(), 2, y.data(), n, 1, n, k, th, 2);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(ts.begin(), ts.end());
  printf("n %ld k %ld threads %d: %.2f us per call (%.1f KB of weights)\n", n, k, th, ts[4] * 1e6, w.size() / 1024.0);
}
