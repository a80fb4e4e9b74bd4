// FLANN baseline for `scanforest bench tools --flann-baseline BINARY`: FLANN's randomized
// KD-forest (KDTreeIndex: T trees, split on a dimension drawn among the 5 of highest variance,
// one shared priority queue, `checks` leaf points per query) on the same rows and queries.
// scanforest does not depend on FLANN; this is only the yardstick. Build (Debian 12, FLANN 1.9):
//   apt-get install libflann-dev
//   g++ -O3 -march=native -fopenmp flann_knn_bench.cpp -o flann_knn_bench -llz4
// Usage: flann_knn_bench X.f32 Q.f32 N M D K TREES THREADS OUT_PREFIX CHECKS[,CHECKS...] [REPEAT]
//   X.f32, Q.f32: raw little-endian float32 rows (N x D, M x D); CHECKS: points examined per
//   query (FLANN's `checks`; N x TREES or more searches exactly). Writes OUT_PREFIX.<checks>.i64
//   (M x K int64 row ids, -1 where none) and prints one JSON line per CHECKS value (the median
//   of REPEAT searches, default 3).
#include <flann/flann.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static bool read_rows(const char* path, std::vector<float>& buf, size_t count) {
  FILE* f = std::fopen(path, "rb");
  if (!f) { std::fprintf(stderr, "cannot open %s\n", path); return false; }
  buf.resize(count);
  size_t got = std::fread(buf.data(), sizeof(float), count, f);
  std::fclose(f);
  if (got != count) { std::fprintf(stderr, "%s: %zu of %zu floats\n", path, got, count); return false; }
  return true;
}

int main(int argc, char** argv) {
  if (argc < 11) {
    std::fprintf(stderr, "usage: flann_knn_bench X.f32 Q.f32 N M D K TREES THREADS OUT_PREFIX CHECKS[,...] [REPEAT]\n");
    return 2;
  }
  size_t n = std::strtoull(argv[3], nullptr, 10), m = std::strtoull(argv[4], nullptr, 10);
  size_t d = std::strtoull(argv[5], nullptr, 10);
  int k = std::atoi(argv[6]), trees = std::atoi(argv[7]), threads = std::atoi(argv[8]);
  std::string prefix = argv[9];
  std::vector<int> checks;
  for (std::string s = argv[10]; !s.empty();) {
    size_t c = s.find(',');
    checks.push_back(std::atoi(s.substr(0, c).c_str()));
    if (checks.back() < 1) { std::fprintf(stderr, "CHECKS must be positive, got %s\n", s.c_str()); return 2; }
    s = c == std::string::npos ? "" : s.substr(c + 1);
  }
  int repeat = argc > 11 ? std::max(1, std::atoi(argv[11])) : 3;
  std::vector<float> xs, qs;
  if (!read_rows(argv[1], xs, n * d) || !read_rows(argv[2], qs, m * d)) return 1;
  flann::Matrix<float> X(xs.data(), n, d), Q(qs.data(), m, d);

  auto t0 = std::chrono::steady_clock::now();
  flann::Index<flann::L2<float>> index(X, flann::KDTreeIndexParams(trees));
  index.buildIndex();
  double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::vector<size_t> ids(m * k);
  std::vector<float> dist(m * k);
  flann::Matrix<size_t> I(ids.data(), m, k);
  flann::Matrix<float> D(dist.data(), m, k);
  for (int c : checks) {
    flann::SearchParams sp(c);
    sp.cores = threads;
    std::vector<double> times;
    for (int r = 0; r < repeat; ++r) {
      std::fill(ids.begin(), ids.end(), size_t(-1));
      auto t1 = std::chrono::steady_clock::now();
      index.knnSearch(Q, I, D, k, sp);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
    }
    std::sort(times.begin(), times.end());
    double search_s = times[times.size() / 2];
    std::vector<long long> out(m * k);
    for (size_t i = 0; i < m * k; ++i) out[i] = ids[i] < n ? (long long)ids[i] : -1;
    std::string path = prefix + "." + std::to_string(c) + ".i64";
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(out.data(), sizeof(long long), out.size(), f) != out.size()) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
    std::fclose(f);
    std::printf("{\"trees\": %d, \"checks\": %d, \"threads\": %d, \"build_s\": %.6f, \"search_s\": %.6f, "
                "\"total_s\": %.6f, \"queries_per_s\": %.1f, \"ids\": \"%s\"}\n",
                trees, c, threads, build_s, search_s, search_s, m / search_s, path.c_str());
    std::fflush(stdout);
  }
  return 0;
}
