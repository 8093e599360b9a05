// specdec's kernels as torch operators, so that a compiled step calls them from inductor's C++ wrapper through the
// dispatcher (a few microseconds) instead of through Python and ctypes: specdec::blocked_linear (the blocked kernel,
// blocked_linear.c; specdec/compiled.py, ``traced_linear``) and specdec::decode_attention (attention.c; specdec/
// compiled.py, ``specdec_attention``). Built at first use with the machine's C++ compiler against the installed
// torch's headers (specdec/kernels.py, ``blocked_op``), linked with the two C files built -march=native.
//
// The helpers: more threads (one for each core the process may use beyond torch's threads: kernels.helpers_wanted), at
// the scheduler's idle priority (SCHED_IDLE: each runs only on a core nothing else wants), share a product's output
// columns with the thread that asked for it (the owner). The columns are cut into shares, large first and single
// pairs of blocks last; owner and helpers take them in turn from one counter, and each
// share's columns are summed by the same code in the same order whichever thread takes it, so the floats are the
// one-thread product's. Nothing waits for a helper: it computes a share into a buffer of its own and marks it done
// (a compare-and-swap to a state naming that helper, whose buffer it lies in), never writing the output; the owner, once it has taken
// every share it could, copies the helpers' done shares in and takes back (steals) any share a helper still holds,
// computing it itself. So a helper
// descheduled by other work (another process, the server's clients) costs the owner nothing, never a scheduler's time
// slice, unlike OpenMP's threads at the end of every parallel region (specdec/threads.py). The helper keeps its own
// references to the tensors of the work it is on, so work the owner has finished and freed is never read freed.
// specdec::helpers(n) starts or parks them (kernels.helper_mode).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

extern "C" void specdec_blocked_linear(const float *x, const float *w, const float *bias, float *y, int64_t M,
                                       int64_t N, int64_t K);
extern "C" void specdec_blocked_linear_bf16(const float *x, const uint32_t *w, const float *bias, float *y, int64_t M,
                                            int64_t N, int64_t K);
extern "C" int specdec_lanes(void);
extern "C" int specdec_q_lanes(void);
extern "C" void specdec_q8_range(const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
                                 int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1, int64_t ys);
extern "C" void specdec_q4_range(const float *x, const uint32_t *w, const float *scales, const float *zeros,
                                 const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G,
                                 int64_t stride, int64_t b0, int64_t b1, int64_t ys);
extern "C" void specdec_blocked_range(const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N,
                                      int64_t K, int64_t b0, int64_t b1, int64_t ys, int half);
extern "C" void specdec_attention(const float *q, const float *k, const float *v, const float *mask, float *out,
                                  float *scores, int64_t *runs, int64_t R, int64_t H, int64_t Hkv, int64_t n, int64_t S, int64_t D,
                                  int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head, float scale);
extern "C" int specdec_attention_dims(int64_t D);
extern "C" int specdec_attention_max_acc(void);

namespace {

constexpr int kMaxShares = 64;
constexpr int kMaxHelpers = 63;  // (a share's state holds a helper's index in 6 bits)  // helper threads at most (one a core beyond the owner's)
constexpr int64_t kMinSharedBytes = 128 << 10;  // a product of a smaller weight is not shared (too short for the hand-off)
constexpr auto kSpin = std::chrono::microseconds(2000);  // the helper waits this long for the next work before sleeping
// a share's state: the work's sequence number, the helper that holds it or made it READY (6 bits) and one of these
// (3 bits): a state of other work never matches
enum : uint64_t { FREE = 0, OWNER = 1, HELPER = 2, READY = 3, STOLEN = 4 };
constexpr uint64_t state(uint64_t seq, uint64_t what, uint64_t helper = 0) { return seq << 9 | helper << 3 | what; }
constexpr uint64_t seq_of(uint64_t state) { return state >> 9; }
constexpr uint64_t what_of(uint64_t state) { return state & 7; }
constexpr int helper_of(uint64_t state) { return static_cast<int>(state >> 3 & 63); }

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// One piece of shared work: a linear product (its output columns cut into shares) or an attention (its rows). The
// owner's, and the helper's own copy, which holds its own references to the tensors.
struct Work {
    enum Kind { LINEAR, ATTENTION };
    uint64_t seq = 0;
    Kind kind = LINEAR;
    at::Tensor in, weight, bias, out;          // linear: x, the packed weight, bias, y
    at::Tensor key, value, mask;               // attention: in = q, out = out
    int64_t M = 0, N = 0, K = 0, lanes = 8;    // linear: rows, out and in features
    int half = 0;
    int bits = 0;                              // linear: 8 or 4 for the quantized kernels (quantized_linear.c)
    at::Tensor scales, zeros;                  // their scales and zero points
    int64_t group = 0;                         // int4's group size
    int64_t R = 0, H = 0, Hkv = 0, n = 0, S = 0, D = 0, strides[4] = {};  // attention's shapes; k, v row and head strides
    float scale = 1.0f;
    int shares = 0;
    int64_t bounds[kMaxShares + 1] = {};  // share i: blocks (linear) or rows (attention) bounds[i] .. bounds[i + 1]

    // where share i lies in the output: its first float, its rows' count, width and stride there
    int64_t offset(int i) const { return kind == LINEAR ? bounds[i] * lanes : bounds[i] * n * H * D; }
    int64_t rows(int i) const { return kind == LINEAR ? M : 1; }
    int64_t width(int i) const {
        return kind == LINEAR ? std::min(bounds[i + 1] * lanes, N) - bounds[i] * lanes
                              : (bounds[i + 1] - bounds[i]) * n * H * D;
    }
    int64_t stride() const { return kind == LINEAR ? N : 0; }
    // where the helper computes share i in a buffer of its own as large as the output: its rows side by side
    int64_t apart(int i) const { return rows(i) * offset(i); }
    // share i, computed by the helper at ``helped + apart(i)``, into the output
    void copy(int i, const float *helped, float *to) const {
        for (int64_t m = 0, w = width(i); m < rows(i); ++m)
            std::memcpy(to + offset(i) + m * stride(), helped + apart(i) + m * w, w * sizeof(float));
    }

    // share i into ``to``, whose rows are ``ys`` floats apart (linear); ``scratch`` the attention's scores and runs
    void compute(int i, float *to, int64_t ys, std::vector<float> &scores, std::vector<int64_t> &runs) const {
        if (kind == LINEAR && bits == 8) {
            specdec_q8_range(in.const_data_ptr<float>(), static_cast<const int8_t *>(weight.const_data_ptr()),
                             scales.const_data_ptr<float>(), bias.defined() ? bias.const_data_ptr<float>() : nullptr,
                             to, M, N, K, bounds[i], bounds[i + 1], ys);
            return;
        }
        if (kind == LINEAR && bits == 4) {
            specdec_q4_range(in.const_data_ptr<float>(), static_cast<const uint32_t *>(weight.const_data_ptr()),
                             scales.const_data_ptr<float>(), zeros.defined() ? zeros.const_data_ptr<float>() : nullptr,
                             bias.defined() ? bias.const_data_ptr<float>() : nullptr, to, M, N, K, group,
                             scales.size(1), bounds[i], bounds[i + 1], ys);
            return;
        }
        if (kind == LINEAR) {
            specdec_blocked_range(in.const_data_ptr<float>(), weight.const_data_ptr(),
                                  bias.defined() ? bias.const_data_ptr<float>() : nullptr, to, M, N, K, bounds[i],
                                  bounds[i + 1], ys, half);
            return;
        }
        const int64_t r = bounds[i], rs = bounds[i + 1] - r;
        scores.resize(static_cast<size_t>((H / Hkv) * n * S + 1));
        runs.resize(static_cast<size_t>(2 * (S + 1)));
        specdec_attention(in.const_data_ptr<float>() + r * H * n * D, key.const_data_ptr<float>() + r * strides[0],
                          value.const_data_ptr<float>() + r * strides[2], mask.const_data_ptr<float>() + r * n * S, to,
                          scores.data(), runs.data(), rs, H, Hkv, n, S, D, strides[0], strides[1], strides[2],
                          strides[3], scale);
    }

    // the shares: a linear's columns in units of two blocks (a pass's, or a bfloat16 pair's), an attention's rows;
    // decreasing, 1 / (2 parties) of what is left each (owner and helpers take turns: a quarter for one helper), single
    // units at the end, at most kMaxShares. Which thread sums a column, or how they are cut, never changes its floats
    void cut(int parties = 2) {
        const int64_t blocks = (N + lanes - 1) / lanes, units = kind == LINEAR ? (blocks + 1) / 2 : R;
        int64_t at = 0, count = 0;
        bounds[0] = 0;
        while (at < units) {
            const int64_t left = units - at, room = kMaxShares - count;
            at += std::min(left, std::max<int64_t>({1, left / (2 * parties), (left + room - 1) / room}));
            bounds[++count] = kind == LINEAR ? std::min(2 * at, blocks) : at;
        }
        shares = static_cast<int>(count);
    }
};

class Helper {
  public:
    static Helper &get() {
        static Helper *helper = new Helper();  // never destroyed: the thread may outlive static destructors
        return *helper;
    }

    // n helpers work (0: none); threads are started as needed and the others park
    void enable(int n) {
        n = std::clamp(n, 0, kMaxHelpers);
        {
            std::lock_guard<std::mutex> guard(start_);
            count_.store(n);
            for (; started_ < n; ++started_) {
                const int index = started_;
                std::thread([this, index] { loop(index); }).detach();
            }
        }
        if (n) wake();
    }
    int enabled() const { return count_.load(std::memory_order_relaxed); }

    // the work done, with the helpers (its output written); false (nothing done) where it is not to be shared: the
    // helpers are off, or another thread is sharing work now
    bool share(Work &&work) {
        const int helpers = count_.load(std::memory_order_relaxed);
        if (helpers == 0) return false;
        bool free = false;
        if (!busy_.compare_exchange_strong(free, true, std::memory_order_acquire)) return false;
        std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);  // the helper holds it while copying work_: a
        for (int tries = 0; tries < 64 && !lock.try_lock(); ++tries) relax();  // moment, unless it was preempted there
        if (!lock.owns_lock()) {
            busy_.store(false, std::memory_order_release);
            return false;
        }
        const uint64_t seq = seq_.load(std::memory_order_relaxed) + 1;
        work.seq = seq;
        work.cut(helpers + 1);
        for (int i = 0; i < work.shares; ++i) state_[i].store(state(seq, FREE), std::memory_order_relaxed);
        next_.store(0, std::memory_order_relaxed);
        work_ = work;  // the helper's to copy, under the mutex
        lock.unlock();
        seq_.store(seq);  // publishes the states and the work (seq_cst: paired with the helpers' sleepers_)
        if (sleepers_.load() > 0) wake();
        float *out = work.out.data_ptr<float>();
        for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < work.shares;) {
            uint64_t expected = state(seq, FREE);
            if (state_[i].compare_exchange_strong(expected, state(seq, OWNER), std::memory_order_acq_rel))
                work.compute(i, out + work.offset(i), work.stride(), scores_, runs_);
        }
        for (int i = 0; i < work.shares; ++i) {  // what is not done yet: a share skipped, one the helper holds or did
            for (;;) {
                uint64_t now = state_[i].load(std::memory_order_acquire);
                const uint64_t what = what_of(now);
                if (what == FREE || what == HELPER) {
                    if (!state_[i].compare_exchange_strong(now, state(seq, what == FREE ? OWNER : STOLEN),
                                                           std::memory_order_acq_rel))
                        continue;  // the helper finished it meanwhile
                    if (what == HELPER) stolen_.fetch_add(1, std::memory_order_relaxed);
                    work.compute(i, out + work.offset(i), work.stride(), scores_, runs_);
                } else if (what == READY) {  // the helper's buffer, set before its release, seen by this acquire
                    work.copy(i, buffers_[helper_of(now)].load(std::memory_order_relaxed), out);
                }
                break;  // OWNER, STOLEN: done
            }
        }
        {
            std::unique_lock<std::mutex> clear(mutex_, std::try_to_lock);  // drop work_'s references unless the helper
            if (clear.owns_lock()) work_ = Work{seq};                       // is copying them (then the next work's do)
        }
        shared_.fetch_add(1, std::memory_order_relaxed);
        busy_.store(false, std::memory_order_release);
        return true;
    }

    // works shared, shares the helper computed, shares the owner took back from it, whether it holds one (``hold``)
    std::vector<int64_t> counts() const {
        return {shared_.load(), helped_.load(), stolen_.load(), holding_.load() ? 1 : 0};
    }
    void hold(bool on) { hold_.store(on); }

  private:
    void loop(int index) {
        struct sched_param idle = {};
        sched_setscheduler(0, SCHED_IDLE, &idle);  // this thread only; where refused, it runs at the normal priority
        std::vector<float> scratch, scores;
        std::vector<int64_t> runs;
        for (uint64_t seen = 0;;) {
            wait_after(index, seen);
            Work work;
            {
                std::lock_guard<std::mutex> guard(mutex_);
                work = work_;
            }
            seen = work.seq;  // at least the sequence number seen published (work_ is written before it)
            help(index, work, scratch, scores, runs);
        }  // work's references are dropped here
    }

    // whether helper ``index`` is to work on what is published after ``seen``
    bool wanted(int index, uint64_t seen) const { return index < count_.load() && seq_.load() > seen; }

    // returns once work after ``seen`` is published while helper ``index`` is on: spins kSpin, then sleeps until woken
    void wait_after(int index, uint64_t seen) {
        for (const auto until = std::chrono::steady_clock::now() + kSpin; std::chrono::steady_clock::now() < until;) {
            if (wanted(index, seen)) return;
            for (int spin = 0; spin < 64; ++spin) relax();
        }
        sleepers_.fetch_add(1);
        for (;;) {
            const uint32_t woken = wake_.load();
            if (wanted(index, seen)) break;
            wake_.wait(woken);  // returns once wake_ moved, whenever that was after the load
        }
        sleepers_.fetch_sub(1);
    }

    void wake() {
        wake_.fetch_add(1);
        wake_.notify_all();
    }

    // the shares of the work the helper can take, each computed into its buffer and left there for the owner to copy
    // (READY), unless the owner took it back meanwhile: the helper never writes the output, so the owner never waits
    // for it, not even for a copy
    void help(int index, const Work &work, std::vector<float> &scratch, std::vector<float> &scores,
              std::vector<int64_t> &runs) {
        if (work.shares == 0) return;
        const size_t need = static_cast<size_t>(work.out.numel());
        if (scratch.size() < need) scratch.resize(need);  // no owner reads it now: none of this work is READY yet
        buffers_[index].store(scratch.data(), std::memory_order_relaxed);  // published by each READY's release
        for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < work.shares;) {
            uint64_t expected = state(work.seq, FREE);
            if (!state_[i].compare_exchange_strong(expected, state(work.seq, HELPER, index),
                                                   std::memory_order_acq_rel)) {
                if (seq_of(expected) != work.seq) return;  // the owner has moved on to other work
                continue;
            }
            if (hold_.load()) {  // tests: a helper stopped with a share in hand, as a descheduled one is
                holding_.store(true);
                while (hold_.load()) relax();
                holding_.store(false);
            }
            work.compute(i, scratch.data() + work.apart(i), work.width(i), scores, runs);
            uint64_t held = state(work.seq, HELPER, index);
            if (state_[i].compare_exchange_strong(held, state(work.seq, READY, index), std::memory_order_acq_rel))
                helped_.fetch_add(1, std::memory_order_relaxed);  // else stolen: the owner computed it
        }
    }

    std::atomic<int> count_{0}, sleepers_{0};  // helpers to work; helpers asleep
    int started_ = 0;                           // helper threads started (under start_)
    std::mutex start_;
    std::atomic<bool> busy_{false}, hold_{false}, holding_{false};
    std::atomic<uint64_t> seq_{0};
    std::atomic<uint32_t> wake_{0};  // moved to wake a sleeping helper
    std::atomic<uint64_t> state_[kMaxShares] = {};
    // each helper's buffer for the work it is on, where its READY shares lie: set by that helper alone, before any
    // share of that work is READY, and not again before the owner has published other work (so read unchanged)
    std::atomic<float *> buffers_[kMaxHelpers] = {};
    std::atomic<int> next_{0};
    std::atomic<int64_t> helped_{0}, shared_{0}, stolen_{0};  // (counts)
    std::mutex mutex_;  // guards work_; the owner only tries it
    Work work_;
    std::vector<float> scores_;  // the owner's scratch for an attention's shares (one owner at a time: busy_)
    std::vector<int64_t> runs_;
};

}  // namespace

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
    if (rows.size(0) > 0 && packed.nbytes() >= static_cast<size_t>(kMinSharedBytes)) {
        Work work;
        work.kind = Work::LINEAR;
        work.in = rows, work.weight = packed, work.bias = b, work.out = y;
        work.M = rows.size(0), work.N = out_features, work.K = rows.size(1), work.lanes = specdec_lanes();
        work.half = half;
        if (Helper::get().share(std::move(work))) return y;
    }
    if (rows.size(0) > 0 && half)
        specdec_blocked_linear_bf16(rows.data_ptr<float>(), static_cast<const uint32_t *>(packed.data_ptr()), bias_data,
                                    y.data_ptr<float>(), rows.size(0), out_features, rows.size(1));
    else if (rows.size(0) > 0)
        specdec_blocked_linear(rows.data_ptr<float>(), packed.data_ptr<float>(), bias_data, y.data_ptr<float>(),
                               rows.size(0), out_features, rows.size(1));
    return y;
}

// x [M, K] @ W.T (+ bias) -> [M, N] for a torchao weight-only weight re-laid by specdec/qlinear.py: int8 [ceil(N / 16),
// K, 16] with scales [16 ceil(N / 16)] (zeros undefined), or int4 eight a 32-bit word, int32 [ceil(N / 16), K / 8, 16],
// with scales and 2^23 + zero points + 8 [K / group, 16 ceil(N / 16)] (none where the zero points are all zero)
// (quantized_linear.c); shared with the helper as
// blocked_linear's products are
static at::Tensor quantized_linear(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &scales,
                                   const std::optional<at::Tensor> &zeros, const std::optional<at::Tensor> &bias,
                                   int64_t out_features, int64_t group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "specdec::quantized_linear: x must be a 2-D float32 CPU tensor");
    const bool four = packed.scalar_type() == at::kInt, zeroed = zeros.has_value() && zeros->defined();
    const int64_t lanes = specdec_q_lanes(), K = x.size(1), blocks = (out_features + lanes - 1) / lanes;
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == blocks && packed.size(2) == lanes &&
                    packed.scalar_type() == (four ? at::kInt : at::kChar) && packed.size(1) == (four ? K / 8 : K) &&
                    scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                    scales.size(-1) == blocks * lanes,
                "specdec::quantized_linear: the weight is not laid out for this kernel and input");
    TORCH_CHECK(!four || (group > 0 && group % 8 == 0 && K % group == 0 && scales.dim() == 2 &&
                          scales.size(0) == K / group &&
                          (!zeroed || (zeros->sizes() == scales.sizes() && zeros->is_contiguous() &&
                                       zeros->scalar_type() == at::kFloat))),
                "specdec::quantized_linear: bad int4 groups, scales or zero points");
    at::Tensor rows = x.contiguous();
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = bias->contiguous();
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features, "specdec::quantized_linear: bad bias");
    }
    at::Tensor y = at::empty({rows.size(0), out_features}, rows.options());
    if (rows.size(0) == 0) return y;
    Work work;
    work.kind = Work::LINEAR;
    work.in = rows, work.weight = packed, work.bias = b, work.out = y, work.scales = scales;
    if (four && zeroed) work.zeros = *zeros;
    work.M = rows.size(0), work.N = out_features, work.K = K, work.lanes = lanes;
    work.bits = four ? 4 : 8, work.group = group;
    if (packed.nbytes() >= static_cast<size_t>(kMinSharedBytes) && Helper::get().share(Work(work))) return y;
    std::vector<float> scores;
    std::vector<int64_t> runs;
    work.cut();
    for (int i = 0; i < work.shares; ++i) work.compute(i, y.data_ptr<float>() + work.offset(i), work.stride(), scores, runs);
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
    if (R > 1 && S > 0) {
        Work work;
        work.kind = Work::ATTENTION;
        work.in = query, work.key = k, work.value = v, work.mask = masks, work.out = out;
        work.R = R, work.H = H, work.Hkv = Hkv, work.n = n, work.S = S, work.D = D;
        work.strides[0] = k.stride(0), work.strides[1] = k.stride(1), work.strides[2] = v.stride(0);
        work.strides[3] = v.stride(1), work.scale = static_cast<float>(scale);
        if (Helper::get().share(std::move(work))) return out;  // the owner's scratch is the helper's (scores_, runs_)
    }
    at::Tensor scores = at::empty({(H / Hkv) * n * S + 1}, q.options());
    at::Tensor runs = at::empty({2 * (S + 1)}, q.options().dtype(at::kLong));  // a row's live runs of slots
    if (R > 0 && S > 0)
        specdec_attention(query.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), masks.data_ptr<float>(),
                          out.data_ptr<float>(), scores.data_ptr<float>(), runs.data_ptr<int64_t>(), R, H, Hkv, n, S, D, k.stride(0), k.stride(1),
                          v.stride(0), v.stride(1), static_cast<float>(scale));
    return out;
}

// helpers(n): n helpers work (0: none; threads started as needed); returns how many worked before. helper(on): one
// or none, whether any worked. helper_counts, since the process started: [works shared, shares the helpers computed,
// shares taken back from them, 1 while one holds a share (helper_hold)]. helper_hold(true), for the tests: a helper
// stops with the next share it takes in hand until helper_hold(false), as a helper descheduled by other work would
static int64_t helpers(int64_t n) {
    const int was = Helper::get().enabled();
    Helper::get().enable(static_cast<int>(n));
    return was;
}

static bool helper(bool on) { return helpers(on ? 1 : 0) > 0; }

static std::vector<int64_t> helper_counts() { return Helper::get().counts(); }

static void helper_hold(bool on) { Helper::get().hold(on); }

// the width of the blocked kernel's weight blocks (output columns): 16 with AVX-512, else 8 (kernels.block_weight)
static int64_t lanes() { return specdec_lanes(); }

TORCH_LIBRARY_FRAGMENT(specdec, m) {
    m.def("helper(bool on) -> bool");
    m.def("helpers(int n) -> int");
    m.def("helper_counts() -> int[]");
    m.def("helper_hold(bool on) -> ()");
    m.def("lanes() -> int");
    m.def("blocked_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    m.def("quantized_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? bias, int out_features, "
          "int group) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
    m.impl("blocked_linear", &blocked_linear);
    m.impl("decode_attention", &decode_attention);
    m.impl("quantized_linear", &quantized_linear);
}

TORCH_LIBRARY_IMPL(specdec, CompositeExplicitAutograd, m) {
    m.impl("helper", &helper);
    m.impl("helpers", &helpers);
    m.impl("helper_counts", &helper_counts);
    m.impl("helper_hold", &helper_hold);
    m.impl("lanes", &lanes);
}
