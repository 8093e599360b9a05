// The blocked kernel (blocked_linear.c) as a torch operator, specdec::blocked_linear, so that a compiled step calls
// it from inductor's C++ wrapper through the dispatcher (a few microseconds) instead of through Python and ctypes
// (specdec/kernels.py, ``blocked_op``; specdec/compiled.py, ``traced_linear``). Built at first use with the
// machine's C++ compiler against the installed torch's headers, linked with blocked_linear.c built -march=native.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

extern "C" void specdec_blocked_linear(const float *x, const float *w, const float *bias, float *y, int64_t M,
                                       int64_t N, int64_t K);
extern "C" int specdec_lanes(void);

// x [M, K] @ W.T (+ bias) -> [M, N], W laid out by kernels.block_weight: packed [ceil(N / lanes), K, lanes]
static at::Tensor blocked_linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                                 int64_t out_features) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "specdec::blocked_linear: x must be a 2-D float32 CPU tensor");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                    packed.size(1) == x.size(1) && packed.size(2) == specdec_lanes() &&
                    packed.size(0) * packed.size(2) >= out_features,
                "specdec::blocked_linear: the weight is not laid out for this kernel and input");
    at::Tensor rows = x.contiguous();
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = bias->contiguous();
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features, "specdec::blocked_linear: bad bias");
    }
    at::Tensor y = at::empty({rows.size(0), out_features}, rows.options());
    if (rows.size(0) > 0)
        specdec_blocked_linear(rows.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                               y.data_ptr<float>(), rows.size(0), out_features, rows.size(1));
    return y;
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
    m.def("blocked_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("blocked_linear", &blocked_linear); }
