// The one schema block of the `torchfn` operator library.
//
// Every custom op of torchfn is declared here, once; kernels are registered per device in
// csrc/cpu/*.cpp (TORCH_LIBRARY_IMPL(torchfn, CPU, m)) and csrc/cuda/*.cu
// (TORCH_LIBRARY_IMPL(torchfn, CUDA, m)). Fake (meta) kernels, autograd and vmap rules are
// registered from Python (torchfn/ops/), after this library is loaded.
//
// Conventions: outputs are fresh contiguous tensors (inputs are made contiguous by the
// kernels); `*_backward` ops are plain kernels, their derivatives are written in Python.
//
// A new op adds its schema to TORCH_LIBRARY below and one line to the Autograd guard block.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

TORCH_LIBRARY(torchfn, m) {
  // op 2: activations (csrc/cpu/activations.cpp, csrc/cuda/activations.cu)
  m.def("sigmoid(Tensor x) -> Tensor");
  m.def("sigmoid_backward(Tensor grad_out, Tensor y) -> Tensor");
  m.def("leaky_relu(Tensor x, float negative_slope) -> Tensor");
  m.def("leaky_relu_backward(Tensor grad_out, Tensor x, float negative_slope) -> Tensor");
  // op 1: softmax cross-entropy (csrc/cpu/cross_entropy.cpp, csrc/cuda/cross_entropy.cu)
  m.def("softmax_cross_entropy(Tensor logits, Tensor target, float label_smoothing, "
        "int ignore_index) -> (Tensor loss, Tensor stats)");
  m.def("softmax_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, "
        "Tensor stats, float label_smoothing, int ignore_index) -> Tensor");
  m.def("softmax_cross_entropy_double_backward(Tensor grad_grad_logits, Tensor grad_loss, "
        "Tensor logits, Tensor target, Tensor stats, float label_smoothing, int ignore_index) "
        "-> (Tensor grad_grad_loss, Tensor grad_logits)");
  // op 4: fused optimizer updates over stacked parameters (N, ...) with per-member lr and
  // weight decay, one leaf or a list of leaves per call (csrc/stacked_optim.h,
  // csrc/cpu/stacked_optim.cpp, csrc/cuda/stacked_optim.cu)
  m.def("stacked_adam_update(Tensor grad, Tensor mu, Tensor nu, Tensor? param, Tensor count, "
        "Tensor lr, Tensor? weight_decay, float beta1, float beta2, float eps, float eps_root, "
        "bool decoupled, bool maximize) -> (Tensor, Tensor, Tensor)");
  m.def("stacked_sgd_update(Tensor grad, Tensor? momentum_buffer, Tensor? param, Tensor count, "
        "Tensor lr, Tensor? weight_decay, float momentum, float dampening, bool nesterov, "
        "bool maximize) -> (Tensor, Tensor)");
  m.def("stacked_adam_update_multi(Tensor[] grad, Tensor[] mu, Tensor[] nu, Tensor[] param, "
        "Tensor count, Tensor lr, Tensor? weight_decay, float beta1, float beta2, float eps, "
        "float eps_root, bool decoupled, bool maximize) -> (Tensor[], Tensor[], Tensor[])");
  m.def("stacked_sgd_update_multi(Tensor[] grad, Tensor[] momentum_buffer, Tensor[] param, "
        "Tensor count, Tensor lr, Tensor? weight_decay, float momentum, float dampening, "
        "bool nesterov, bool maximize) -> (Tensor[], Tensor[])");
  // op 3: per-sample gradient norms of a linear layer and the clipped gradient sum
  // (csrc/ghost_norms.h, csrc/cpu/ghost_norms.cpp, csrc/cuda/ghost_norms.cu)
  m.def("linear_grad_norms_sq(Tensor a, Tensor g, bool bias=False, str method=\"auto\") "
        "-> (Tensor norms, Tensor aux)");
  m.def("linear_grad_norms_sq_backward(Tensor grad, Tensor a, Tensor g, Tensor? aux=None, "
        "bool bias=False, str method=\"auto\") -> (Tensor grad_a, Tensor grad_g)");
  m.def("clipped_linear_grad_sum(Tensor a, Tensor g, Tensor coef) -> Tensor");
}

// The Autograd guard: one boxed Autograd-key kernel, shared by all ops, that makes the raw
// library ops refuse differentiation.
//
// The derivatives of torchfn ops live in Python (torch.autograd.Function subclasses in
// torchfn/ops/), because only those compose with torch.func transforms. A raw op reached with
// grad mode on and an input that requires grad therefore means the Function was bypassed --
// e.g. torch.compile inlined the Function's forward under torch.func.grad and dropped its
// backward, which would otherwise give silently ZERO gradients. Raise instead. Inside the
// Function's forward grad mode is off, so the call passes straight to the device kernel.
namespace torchfn {
namespace {

[[noreturn]] void refuse(const c10::OperatorHandle& op, size_t i, const at::Tensor& t) {
  const auto& schema = op.schema();
  TORCH_CHECK(false, schema.name(), ": argument '", schema.arguments()[i].name(),
              "' requires grad (dtype ", t.scalar_type(), ", device ", t.device(),
              "), but the raw library op has no derivative of its own: call the public ",
              "torchfn.ops function instead, whose autograd.Function carries the derivative. ",
              "(Seen when torch.compile inlines that Function under torch.func.grad and drops ",
              "its backward, which would give zero gradients; torchfn.ops routes to the ",
              "reference twin while compiling.)");
}

void refuse_grad_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    const size_t n_args = op.schema().arguments().size();
    const auto args = torch::jit::last(*stack, n_args);
    for (size_t i = 0; i < n_args; ++i) {
      const c10::IValue& v = args[i];
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (t.defined() && t.requires_grad()) refuse(op, i, t);
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) {
          if (t.defined() && t.requires_grad()) refuse(op, i, t);
        }
      }
    }
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfn, Autograd, m) {
  m.impl("sigmoid", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("sigmoid_backward", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("leaky_relu", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("leaky_relu_backward", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("softmax_cross_entropy",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("softmax_cross_entropy_backward",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("softmax_cross_entropy_double_backward",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("stacked_adam_update", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("stacked_sgd_update", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("stacked_adam_update_multi",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("stacked_sgd_update_multi",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("linear_grad_norms_sq", torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("linear_grad_norms_sq_backward",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
  m.impl("clipped_linear_grad_sum",
         torch::CppFunction::makeFromBoxedFunction<&refuse_grad_boxed>());
}

}  // namespace torchfn
