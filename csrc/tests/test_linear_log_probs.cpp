// ctest: the chunked log-probabilities row passes (forward statistics and the in-place backward) against a
// double-precision scalar reference, in fp32 and bf16, with softcap, temperature, the entropy term, labels that are
// not among the columns and skipped rows (zero upstream gradients), on an odd vocabulary. Exit code 0 on success.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../linear_log_probs/linear_log_probs_cpu.h"
#include "test_common.h"

namespace {

struct RefRow {
  double lse, target, m;
  std::vector<double> grad;
};

RefRow reference_row(const std::vector<double>& z, int64_t label, double gl, double ge, double cap, double inv_t) {
  const int64_t vocab = static_cast<int64_t>(z.size());
  std::vector<double> y(vocab), s(vocab);
  double mx = -INFINITY;
  for (int64_t j = 0; j < vocab; ++j) {
    y[j] = cap > 0 ? cap * std::tanh(z[j] / cap) : z[j];
    s[j] = y[j] * inv_t;
    mx = std::fmax(mx, s[j]);
  }
  double se = 0.0;
  for (int64_t j = 0; j < vocab; ++j) se += std::exp(s[j] - mx);
  RefRow out{mx + std::log(se), 0.0, 0.0, std::vector<double>(vocab)};
  const bool here = label >= 0 && label < vocab;
  if (here) out.target = s[label];
  for (int64_t j = 0; j < vocab; ++j) out.m += std::exp(s[j] - out.lse) * s[j];
  for (int64_t j = 0; j < vocab; ++j) {
    const double p = std::exp(s[j] - out.lse);
    double g = (j == label ? gl : 0.0) - gl * p - ge * p * (s[j] - out.m);
    g *= inv_t * (cap > 0 ? 1.0 - (y[j] / cap) * (y[j] / cap) : 1.0);
    out.grad[j] = g;
  }
  return out;
}

template <typename T>
int run(int64_t rows, int64_t vocab, float cap, float temp, bool entropy) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
  const int64_t ld = vocab + 5;  // a row stride wider than the row, as for a slice of a larger buffer
  const std::vector<T> logits0 = sktest::to_storage<T>(sktest::randn(static_cast<size_t>(rows * ld), 3, 3.f));
  std::vector<int64_t> labels(rows);
  std::vector<float> gl = sktest::randn(rows, 4), ge = sktest::randn(rows, 5);
  for (int64_t r = 0; r < rows; ++r) {
    labels[r] = r % 7 == 2 ? -1 : (r % 7 == 5 ? vocab + 3 : pick(rng));  // two kinds of "not a column"
    if (r % 5 == 4) gl[r] = ge[r] = 0.f;                                   // a skipped row
  }
  const shardkit::LlpRowParams p{cap, 1.f / temp};
  std::vector<T> work = logits0;
  std::vector<float> lse(rows), target(rows), m(rows);
  shardkit::llp_rows_forward_cpu(work.data(), rows, vocab, ld, labels.data(), p, lse.data(), target.data(),
                                 entropy ? m.data() : nullptr);
  work = logits0;
  shardkit::llp_rows_backward_cpu(work.data(), rows, vocab, ld, labels.data(), gl.data(),
                                  entropy ? ge.data() : nullptr, lse.data(), entropy ? m.data() : nullptr, p);
  const double tol = sktest::rtol<T>();
  double worst_stat = 0.0, worst_grad = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> z(vocab);
    for (int64_t j = 0; j < vocab; ++j) z[j] = static_cast<double>(shardkit::to_float(logits0[r * ld + j]));
    const RefRow ref = reference_row(z, labels[r], gl[r], entropy ? ge[r] : 0.0, cap, 1.0 / temp);
    worst_stat = std::fmax(worst_stat, std::fabs(lse[r] - ref.lse) / (1.0 + std::fabs(ref.lse)));
    worst_stat = std::fmax(worst_stat, std::fabs(target[r] - ref.target) / (1.0 + std::fabs(ref.target)));
    if (entropy) worst_stat = std::fmax(worst_stat, std::fabs(m[r] - ref.m) / (1.0 + std::fabs(ref.m)));
    for (int64_t j = 0; j < vocab; ++j) {
      const double g = static_cast<double>(shardkit::to_float(work[r * ld + j]));
      worst_grad = std::fmax(worst_grad, std::fabs(g - ref.grad[j]) / (1.0 + std::fabs(ref.grad[j])));
    }
  }
  // fp32: lse carries ~1e-7 of |lse| ~ 10-20 into every p; 16-bit: the statistics are fp32 math on exact widened
  // inputs, the gradient is rounded once into the storage type
  const bool ok = worst_stat < 2e-5 && worst_grad < (sizeof(T) == 4 ? 1e-5 : tol);
  std::printf("%s rows=%-3lld V=%-5lld cap=%-4.1f T=%.2f entropy=%d stat_err=%.3g grad_err=%.3g %s\n",
              sizeof(T) == 4 ? "fp32" : "bf16", static_cast<long long>(rows), static_cast<long long>(vocab), cap,
              temp, entropy ? 1 : 0, worst_stat, worst_grad, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main() {
  int failures = 0;
  for (int64_t vocab : {3, 257, 4099}) {
    failures += run<float>(29, vocab, 0.f, 1.f, false);
    failures += run<float>(29, vocab, 0.f, 0.7f, true);
    failures += run<float>(29, vocab, 5.f, 1.9f, true);
    failures += run<shardkit::bf16>(29, vocab, 30.f, 1.f, true);
  }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
}
