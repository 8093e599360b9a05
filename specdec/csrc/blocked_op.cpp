// specdec's kernels as torch operators, so that a compiled step calls them from inductor's C++ wrapper through the
// dispatcher (a few microseconds) instead of through Python and ctypes: specdec::blocked_linear (the blocked kernel,
// blocked_linear.c; specdec/compiled.py, ``traced_linear``) and specdec::decode_attention (attention.c; specdec/
// compiled.py, ``specdec_attention``). Built at first use with the machine's C++ compiler against the installed
// torch's headers (specdec/kernels.py, ``blocked_op``), linked with the two C files built -march=native.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

extern "C" void specdec_blocked_linear(const float *x, const float *w, const float *bias, float *y, int64_t M,
                                       int64_t N, int64_t K);
extern "C" void specdec_blocked_linear_bf16(const float *x, const uint32_t *w, const float *bias, float *y, int64_t M,
                                            int64_t N, int64_t K);
extern "C" int specdec_lanes(void);
extern "C" void specdec_attention(const float *q, const float *k, const float *v, const float *mask, float *out,
                                  float *scores, int64_t *runs, int64_t R, int64_t H, int64_t Hkv, int64_t n, int64_t S, int64_t D,
                                  int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head, float scale);
extern "C" int specdec_attention_dims(int64_t D);
extern "C" int specdec_attention_max_acc(void);

// x [M, K] @ W.T (+ bias) -> [M, N], W laid out by kernels.block_weight: packed float32 [ceil(N / lanes), K, lanes],
// or bfloat16 [ceil(N / lanes / 2), K, lanes, 2] (pairs of blocks, kernels.pair_weight)
static at::Tensor blocked_linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                                 int64_t out_features) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "specdec::blocked_linear: x must be a 2-D float32 CPU tensor");
    const bool half = packed.scalar_type() == at::kBFloat16;
    TORCH_CHECK(packed.dim() == (half ? 4 : 3) && (half || packed.scalar_type() == at::kFloat) && packed.is_contiguous() &&
                    packed.size(1) == x.size(1) && packed.size(2) == specdec_lanes() && (!half || packed.size(3) == 2) &&
                    packed.size(0) * packed.size(2) * (half ? 2 : 1) >= out_features,
                "specdec::blocked_linear: the weight is not laid out for this kernel and input");
    at::Tensor rows = x.contiguous();
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = bias->contiguous();
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features, "specdec::blocked_linear: bad bias");
    }
    at::Tensor y = at::empty({rows.size(0), out_features}, rows.options());
    const float *bias_data = b.defined() ? b.data_ptr<float>() : nullptr;
    if (rows.size(0) > 0 && half)
        specdec_blocked_linear_bf16(rows.data_ptr<float>(), static_cast<const uint32_t *>(packed.data_ptr()), bias_data,
                                    y.data_ptr<float>(), rows.size(0), out_features, rows.size(1));
    else if (rows.size(0) > 0)
        specdec_blocked_linear(rows.data_ptr<float>(), packed.data_ptr<float>(), bias_data, y.data_ptr<float>(),
                               rows.size(0), out_features, rows.size(1));
    return y;
}

// softmax(q k^T * scale + mask) v for q [R, H, n, D] against k, v [R, Hkv, S, D] (the cache's first S slots: each slot's
// D floats contiguous), mask [R, n, S] additive (a slot at float32's lowest for every query of its row is not read)
// -> [R, n, H, D], the layout transformers' attention functions return
static at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &mask,
                                   double scale) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3,
                "specdec::decode_attention: q, k, v must be 4-D and the mask 3-D");
    for (const at::Tensor *t : {&q, &k, &v, &mask})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(),
                    "specdec::decode_attention: float32 CPU tensors only");
    const int64_t R = q.size(0), H = q.size(1), n = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
    TORCH_CHECK(k.size(0) == R && v.size(0) == R && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
                    v.size(3) == D && Hkv > 0 && H % Hkv == 0,
                "specdec::decode_attention: q, k and v do not match");
    TORCH_CHECK(specdec_attention_dims(D) && (H / Hkv) * n * D <= specdec_attention_max_acc(),
                "specdec::decode_attention: head dimension or query count not supported");
    TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.stride(3) == 1 && v.stride(2) == D,
                "specdec::decode_attention: each slot's keys and values must be contiguous");
    TORCH_CHECK(mask.size(0) == R && mask.size(1) == n && mask.size(2) == S, "specdec::decode_attention: bad mask");
    at::Tensor query = q.contiguous(), masks = mask.contiguous();
    at::Tensor out = at::empty({R, n, H, D}, q.options());
    at::Tensor scores = at::empty({(H / Hkv) * n * S + 1}, q.options());
    at::Tensor runs = at::empty({2 * (S + 1)}, q.options().dtype(at::kLong));  // a row's live runs of slots
    if (R > 0 && S > 0)
        specdec_attention(query.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), masks.data_ptr<float>(),
                          out.data_ptr<float>(), scores.data_ptr<float>(), runs.data_ptr<int64_t>(), R, H, Hkv, n, S, D, k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), static_cast<float>(scale));
    return out;
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
    m.def("blocked_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
    m.impl("blocked_linear", &blocked_linear);
    m.impl("decode_attention", &decode_attention);
}
