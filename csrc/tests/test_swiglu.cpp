// ctest: SwiGLU / GeGLU CPU cores vs a scalar double reference, fp32/bf16/fp16, sizes around the OpenMP chunk,
// out of place and in place (d gate written over gate, d up over up).
#include <cmath>
#include <cstdio>
#include <vector>

#include "../swiglu/swiglu_cpu.h"
#include "test_common.h"

namespace {

using shardkit::GluAct;

// act(g) = g * s, s = sigmoid(a(g)); returns s and writes a'(g).
double sig_and_darg(GluAct act, double g, double* darg) {
  const double k = 2.0 * std::sqrt(2.0 / M_PI);
  const double a = act == GluAct::kSilu ? g : k * (g + 0.044715 * g * g * g);
  *darg = act == GluAct::kSilu ? 1.0 : k * (1.0 + 3.0 * 0.044715 * g * g);
  return 1.0 / (1.0 + std::exp(-a));
}

template <GluAct A, typename T>
bool run(int64_t n) {
  const auto g = sktest::to_storage<T>(sktest::randn(n, 11, 3.f));
  const auto u = sktest::to_storage<T>(sktest::randn(n, 12));
  const auto dy = sktest::to_storage<T>(sktest::randn(n, 13));
  const auto gd = sktest::to_double(g), ud = sktest::to_double(u), dyd = sktest::to_double(dy);
  std::vector<double> y_ref(n), dg_ref(n), du_ref(n);
  for (int64_t i = 0; i < n; ++i) {
    double darg = 0.0;
    const double sig = sig_and_darg(A, gd[i], &darg);
    y_ref[i] = gd[i] * sig * ud[i];
    dg_ref[i] = dyd[i] * ud[i] * (sig + gd[i] * sig * (1.0 - sig) * darg);
    du_ref[i] = dyd[i] * gd[i] * sig;
  }
  std::vector<T> y(n), dg(n), du(n);
  shardkit::glu_fwd_cpu<A, T>(g.data(), u.data(), y.data(), n);
  shardkit::glu_bwd_cpu<A, T>(dy.data(), g.data(), u.data(), dg.data(), du.data(), n);
  std::vector<T> g_inplace = g, u_inplace = u;
  shardkit::glu_bwd_cpu<A, T>(dy.data(), g_inplace.data(), u_inplace.data(), g_inplace.data(), u_inplace.data(), n);
  return sktest::check("y", y, y_ref, 1e-6) && sktest::check("dg", dg, dg_ref, 1e-6) &&
         sktest::check("du", du, du_ref, 1e-6) && sktest::check("dg in place", g_inplace, dg_ref, 1e-6) &&
         sktest::check("du in place", u_inplace, du_ref, 1e-6);
}

template <GluAct A>
bool run_all(int64_t n) {
  return run<A, float>(n) && run<A, shardkit::bf16>(n) && run<A, shardkit::fp16>(n);
}

}  // namespace

int main() {
  bool ok = true;
  for (int64_t n : {1, 123, 4095, 4096, 4097, 5 * 123 * 123}) {
    ok &= run_all<GluAct::kSilu>(n) && run_all<GluAct::kGeluTanh>(n);
  }
  std::printf(ok ? "test_swiglu: ok\n" : "test_swiglu: FAILED\n");
  return ok ? 0 : 1;
}
