// A compiled decode step's products on oneDNN-packed weights, found by number (engine/packing.py says why a
// compiled graph cannot take the opaque packed tensor itself). PackedLinear keeps its weight here under its
// number; the graph calls linear(x, number, bias, out_features).
//
// Why in C++: the same lookup as a Python custom operator cost 36 us a call of its own, 121 calls a SmolLM2 step:
// 4.4 ms of a 43-49 ms float32 decode step (torch.profiler, 1 thread).
//
// Built at run time by scalenlp.engine.packing (through scalenlp.native).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_map>

namespace {

std::mutex lock;
std::unordered_map<int64_t, at::Tensor> weights;  // number -> packed weight

void keep(int64_t number, const at::Tensor& packed) {
  std::lock_guard<std::mutex> guard(lock);
  weights[number] = packed;
}

void forget(int64_t number) {
  std::lock_guard<std::mutex> guard(lock);
  weights.erase(number);
}

// x (..., in) times the weight kept under `number`, plus bias: oneDNN's product, as models.onednn.packed_linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& number, const std::optional<at::Tensor>& bias,
                  int64_t out_features) {
  const int64_t n = number.item<int64_t>();
  at::Tensor packed;
  {
    std::lock_guard<std::mutex> guard(lock);
    const auto found = weights.find(n);
    TORCH_CHECK(found != weights.end(), "packed linear: no weight is kept under number ", n);
    packed = found->second;
  }
  static const auto product = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  product.callBoxed(&stack);
  auto out = stack[0].toTensor();
  TORCH_CHECK(out.size(-1) == out_features, "packed linear: the weight kept under number ", n, " has ", out.size(-1),
              " outputs, not ", out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY(scalenlp_packed, m) {
  m.def("keep(int number, Tensor packed) -> ()");
  m.def("forget(int number) -> ()");
  m.def("linear(Tensor x, Tensor number, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(scalenlp_packed, CatchAll, m) {
  m.impl("keep", keep);
  m.impl("forget", forget);
}

TORCH_LIBRARY_IMPL(scalenlp_packed, CPU, m) { m.impl("linear", linear); }
