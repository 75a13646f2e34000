#include "capture/kernel_settings.h"

#include <ATen/Context.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/ScalarType.h>

#include <array>

namespace nimble_train::capture {
namespace {

// float32's precision for a CUDA operator as torch resolves it: the operator's own value, else
// its backend's, else the generic one; none set anywhere is IEEE.
at::Float32Precision fp32_precision(at::Float32Op op) {
  const auto& context = at::globalContext();
  using at::Float32Backend, at::Float32Op;
  for (const auto& [backend, level] : {std::pair{Float32Backend::CUDA, op},
                                       std::pair{Float32Backend::CUDA, Float32Op::ALL},
                                       std::pair{Float32Backend::GENERIC, Float32Op::ALL}}) {
    const at::Float32Precision precision = context.float32Precision(backend, level);
    if (precision != at::Float32Precision::NONE) return precision;
  }
  return at::Float32Precision::IEEE;
}

std::string precision_name(uint64_t v) {
  switch (static_cast<at::Float32Precision>(v)) {
    case at::Float32Precision::IEEE: return "'ieee'";
    case at::Float32Precision::TF32: return "'tf32'";
    case at::Float32Precision::BF16: return "'bf16'";
    default: return "'none'";
  }
}

std::string flag_name(uint64_t v) { return v ? "True" : "False"; }

// (allow_reduced_precision, allow_splitk), as torch.backends.cuda.matmul reads it back.
std::string reduction_name(uint64_t v) {
  switch (static_cast<at::CuBLASReductionOption>(v)) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK: return "(True, True)";
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK: return "(False, True)";
    default: return "(False, False)";
  }
}

std::string dtype_name(uint64_t v) {
  switch (static_cast<c10::ScalarType>(v)) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    default: return c10::toString(static_cast<c10::ScalarType>(v));
  }
}

struct Field {
  const char* name;
  int bits;
  std::string (*format)(uint64_t);
};

// In the order kernel_settings() packs them, lowest bits first.
constexpr std::array<Field, 14> kFields{{
    {"torch.backends.cuda.matmul.fp32_precision (or torch.set_float32_matmul_precision(), "
     "torch.backends.cuda.matmul.allow_tf32)", 3, precision_name},
    {"torch.backends.cudnn.conv.fp32_precision (or torch.backends.cudnn.allow_tf32)", 3,
     precision_name},
    {"torch.backends.cudnn.rnn.fp32_precision (or torch.backends.cudnn.allow_tf32)", 3,
     precision_name},
    {"torch.set_default_dtype()", 8, dtype_name},
    {"torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction", 2, reduction_name},
    {"torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction", 2, reduction_name},
    {"torch.backends.cuda.matmul.allow_fp16_accumulation", 1, flag_name},
    {"torch.backends.cudnn.enabled", 1, flag_name},
    {"torch.backends.cudnn.deterministic", 1, flag_name},
    {"torch.use_deterministic_algorithms()", 1, flag_name},
    {"torch.backends.cuda.enable_flash_sdp()", 1, flag_name},
    {"torch.backends.cuda.enable_mem_efficient_sdp()", 1, flag_name},
    {"torch.backends.cuda.enable_math_sdp()", 1, flag_name},
    {"torch.backends.cuda.enable_cudnn_sdp()", 1, flag_name},
}};

}  // namespace

uint64_t kernel_settings() {
  const auto& context = at::globalContext();
  const std::array<uint64_t, kFields.size()> values{
      static_cast<uint64_t>(fp32_precision(at::Float32Op::MATMUL)),
      static_cast<uint64_t>(fp32_precision(at::Float32Op::CONV)),
      static_cast<uint64_t>(fp32_precision(at::Float32Op::RNN)),
      static_cast<uint64_t>(c10::get_default_dtype_as_scalartype()),
      static_cast<uint64_t>(context.allowFP16ReductionCuBLAS()),
      static_cast<uint64_t>(context.allowBF16ReductionCuBLAS()),
      context.allowFP16AccumulationCuBLAS(),
      context.userEnabledCuDNN(),
      context.deterministicCuDNN(),
      context.deterministicAlgorithms(),
      context.userEnabledFlashSDP(),
      context.userEnabledMemEfficientSDP(),
      context.userEnabledMathSDP(),
      context.userEnabledCuDNNSDP(),
  };
  uint64_t packed = 0;
  int shift = 0;
  for (size_t i = 0; i < kFields.size(); ++i) {
    packed |= (values[i] & ((uint64_t{1} << kFields[i].bits) - 1)) << shift;
    shift += kFields[i].bits;
  }
  return packed;
}

std::vector<std::string> kernel_setting_changes(uint64_t captured, uint64_t now) {
  std::vector<std::string> changes;
  int shift = 0;
  for (const Field& field : kFields) {
    const uint64_t mask = (uint64_t{1} << field.bits) - 1;
    const uint64_t was = (captured >> shift) & mask, is = (now >> shift) & mask;
    if (was != is) {
      changes.push_back(std::string(field.name) + " is " + field.format(is) + ", was " +
                        field.format(was));
    }
    shift += field.bits;
  }
  return changes;
}

}  // namespace nimble_train::capture
