// Test infrastructure, not a CUDA implementation: just enough of the CUDA device environment for the host C++
// compiler to build backends/cupy/kernels/attention.cu unchanged and run it on the CPU (tests/cupy_emulator).
//
// Every CUDA thread of a block is a fiber (ucontext) with its own stack; the block's fibers run on one OS thread,
// round-robin in thread order, each until it reaches a barrier. __syncthreads parks the fiber until every live
// thread of the block has arrived, so barriers really synchronise the threads and a missing one is a real race
// (deterministically exposed: warp after warp, each runs ahead of the others up to its next barrier, its warp-level
// exchanges released as all its lanes reach them, in an order that alternates between ascending and descending
// warp and lane index from one barrier to the next). Threads that do not pass
// the same number of barriers (a barrier in divergent code) are reported, never left hanging. Warp shuffles exchange through a
// per-warp slot array between two warp barriers. wmma operations are warp-collective: lane 0 of the warp loads,
// multiplies (float32 products of the exactly converted half values, float32 accumulation) and stores the whole
// 16x16 tile, so other warps see the data only after a barrier, as on the GPU; the other lanes' fragments are
// unspecified (kernels must not read fragment elements, whose lane mapping the emulator does not model). Blocks run one after another; dynamic shared memory is
// filled with NaN bytes before each block and guarded by a canary.
//
// The PTX-level device functions of attention.cu (compiled there as inline PTX unless ATTNKIT_EMULATED) have twins
// here that reproduce the PTX ISA's per-lane fragment layouts exactly, so a kernel that reads a fragment element
// from the wrong lane computes a wrong result here too: mma_m16n8k16 (each lane publishes its A, B registers, then
// computes its own four C elements from the lanes that hold each operand element), ldmatrix_x4(_trans) (each lane
// publishes its row address, then reads its two elements of each 8x8 matrix from the lane that addressed that row),
// cp.async (cp_async_16 queues the copy in the thread's open group, cp_async_commit closes the group, and the
// copies land only at a cp_async_wait that waits for their group: a read before the wait sees the old contents), and
// atomic_add_pair (sm_90's 8-byte vector atomic, as two atomicAdds, its alignment checked).

#pragma once

#include <math.h>

#include <algorithm>
#include <array>
#include <ucontext.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define ATTNKIT_EMULATED 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

using std::max;
using std::min;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline dim3 threadIdx;  // set by the scheduler before it resumes a thread
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace emu {

enum class State { runnable, block_barrier, warp_barrier, done };

struct Fiber {
    ucontext_t context;
    State state = State::runnable;
};

constexpr std::size_t STACK_BYTES = 256 * 1024;
inline std::vector<Fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline std::vector<std::array<std::uint64_t, 32>> warp_slots;
inline std::vector<std::array<std::array<std::uint32_t, 6>, 32>> mma_slots;  // per warp and lane: A[4], B[2]

// cp.async copies of one thread not yet landed: the open group, then the committed groups, oldest first.
struct AsyncCopy {
    void* destination;
    const void* source;
};
struct AsyncGroups {
    std::vector<AsyncCopy> open;
    std::vector<std::vector<AsyncCopy>> committed;
};
inline std::vector<AsyncGroups> async_groups;
inline ucontext_t scheduler;
inline unsigned current = 0;
inline const std::function<void()>* kernel_body = nullptr;
inline std::atomic<int> failed{0};
inline char failure[512] = "";

inline void fail(const char* message) {
    if (failed.exchange(1) == 0) std::snprintf(failure, sizeof failure, "%s", message);
}

inline unsigned lane() { return current % 32; }

// Park the running thread in `state` and return to the scheduler; resumes when the scheduler releases it.
inline void park(State state) {
    fibers[current].state = state;
    swapcontext(&fibers[current].context, &scheduler);
}

}  // namespace emu

inline void __syncthreads() { emu::park(emu::State::block_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::park(emu::State::warp_barrier); }

template <class T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    auto& slots = emu::warp_slots[emu::current / 32];
    std::memcpy(&slots[emu::lane()], &value, sizeof(T));
    __syncwarp();
    T result;
    std::memcpy(&result, &slots[emu::lane() ^ static_cast<unsigned>(lane_mask)], sizeof(T));
    __syncwarp();
    return result;
}

template <class T>
inline T __shfl_sync(unsigned, T value, int source, int = 32) {
    auto& slots = emu::warp_slots[emu::current / 32];
    std::memcpy(&slots[emu::lane()], &value, sizeof(T));
    __syncwarp();
    T result;
    std::memcpy(&result, &slots[static_cast<unsigned>(source) % 32], sizeof(T));
    __syncwarp();
    return result;
}

// Read-modify-write in one step. A block's fibers switch only at barriers and blocks run one after another, so no other
// thread can come between the read and the write; the atomic_ref keeps it so for any scheduler.
template <class T>
inline T atomicAdd(T* address, T value) {
    return std::atomic_ref<T>(*address).fetch_add(value);
}

inline float __int_as_float(int bits) {
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
}
inline float __int_as_float(unsigned bits) { return __int_as_float(static_cast<int>(bits)); }
// The high 32 bits of the 64-bit product of two unsigned 32-bit words.
inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>((static_cast<std::uint64_t>(a) * b) >> 32);
}
inline int __float_as_int(float value) {
    int bits;
    std::memcpy(&bits, &value, 4);
    return bits;
}

// ------------------------------------------------------------------------------------------ half types

struct __half {
    std::uint16_t bits;
};
struct __nv_bfloat16 {
    std::uint16_t bits;
};

inline __half __float2half(float value) {  // round to nearest even (the _Float16 conversion)
    _Float16 h = static_cast<_Float16>(value);
    __half out;
    std::memcpy(&out.bits, &h, 2);
    return out;
}
inline float __half2float(__half value) {
    _Float16 h;
    std::memcpy(&h, &value.bits, 2);
    return static_cast<float>(h);
}
inline __nv_bfloat16 __float2bfloat16(float value) {  // round to nearest even; NaN stays NaN
    std::uint32_t bits;
    std::memcpy(&bits, &value, 4);
    __nv_bfloat16 out;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        out.bits = static_cast<std::uint16_t>((bits >> 16) | 0x40u);
    } else {
        bits += 0x7fffu + ((bits >> 16) & 1u);
        out.bits = static_cast<std::uint16_t>(bits >> 16);
    }
    return out;
}
inline float __bfloat162float(__nv_bfloat16 value) {
    std::uint32_t bits = static_cast<std::uint32_t>(value.bits) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

struct __half2 {
    __half x, y;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline __half2 __floats2half2_rn(float low, float high) { return {__float2half(low), __float2half(high)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float low, float high) {
    return {__float2bfloat16(low), __float2bfloat16(high)};
}

namespace emu {
inline float widen(float x) { return x; }
inline float widen(__half x) { return __half2float(x); }
inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
}  // namespace emu

// ------------------------------------------------------------------------------------------ wmma

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = rows * cols;
    float x[rows * cols];  // the whole tile, row-major, in every lane
};

template <class T>
inline void check_operand(const T* pointer, unsigned ldm) {
    if (reinterpret_cast<std::uintptr_t>(pointer) % 32 != 0) emu::fail("wmma: pointer not 256-bit aligned");
    if ((ldm * sizeof(T)) % 16 != 0) emu::fail("wmma: ldm is not a multiple of 16 bytes");
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* pointer, unsigned ldm) {
    check_operand(pointer, ldm);
    if (emu::lane() != 0) return;
    using F = fragment<Use, M, N, K, T, Layout>;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] =
                emu::widen(std::is_same_v<Layout, col_major> ? pointer[c * ldm + r] : pointer[r * ldm + c]);
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* pointer, unsigned ldm,
                             layout_t layout) {
    check_operand(pointer, ldm);
    if (emu::lane() != 0) return;
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) f.x[r * N + c] = layout == mem_col_major ? pointer[c * ldm + r] : pointer[r * ldm + c];
}

template <int M, int N, int K>
inline void store_matrix_sync(float* pointer, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                              layout_t layout) {
    check_operand(pointer, ldm);
    if (emu::lane() != 0) return;
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) (layout == mem_col_major ? pointer[c * ldm + r] : pointer[r * ldm + c]) = f.x[r * N + c];
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float value) {
    for (float& x : f.x) x = value;
}

template <int M, int N, int K, class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
                     const fragment<matrix_b, M, N, K, T, LB>& b, const fragment<accumulator, M, N, K, float>& c) {
    if (emu::lane() != 0) return;
    float result[M * N];
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
            float acc = c.x[m * N + n];
            for (int k = 0; k < K; ++k) acc = fmaf(a.x[m * K + k], b.x[k * N + n], acc);
            result[m * N + n] = acc;
        }
    std::memcpy(d.x, result, sizeof result);
}

}  // namespace wmma
}  // namespace nvcuda

// ------------------------------------------------------------------------------------------ PTX twins

namespace emu {

inline std::uint16_t half_bits(std::uint32_t pair, int which) { return static_cast<std::uint16_t>(pair >> (16 * which)); }
inline float half_value(std::uint16_t bits, __half) { return __half2float(__half{bits}); }
inline float half_value(std::uint16_t bits, __nv_bfloat16) { return __bfloat162float(__nv_bfloat16{bits}); }

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 address the rows of matrix i; lane l receives
// in d[i] the elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix i, or with .trans (2(l%4), l/4) and
// (2(l%4)+1, l/4), the first in the low half.
inline void ldmatrix(std::uint32_t (&d)[4], const void* row, bool transposed) {
    if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) fail("ldmatrix: a row address is not 16-byte aligned");
    auto& slots = warp_slots[current / 32];
    std::memcpy(&slots[lane()], &row, sizeof row);
    __syncwarp();
    const unsigned group = lane() / 4, pair = 2 * (lane() % 4);
    for (int i = 0; i < 4; ++i) {
        auto element = [&](unsigned r, unsigned c) {
            const void* address;
            std::memcpy(&address, &slots[8 * i + r], sizeof address);
            return static_cast<const std::uint16_t*>(address)[c];
        };
        const std::uint16_t low = transposed ? element(pair, group) : element(group, pair);
        const std::uint16_t high = transposed ? element(pair + 1, group) : element(group, pair + 1);
        d[i] = static_cast<std::uint32_t>(low) | static_cast<std::uint32_t>(high) << 16;
    }
    __syncwarp();
}

}  // namespace emu

inline void ldmatrix_x4(unsigned (&d)[4], const void* row) { emu::ldmatrix(d, row, false); }
inline void ldmatrix_x4_trans(unsigned (&d)[4], const void* row) { emu::ldmatrix(d, row, true); }

// mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32, acc = A·B + acc, with groupID g = lane/4 and t = lane%4:
// A (16x16) a[0]: (g, 2t..2t+1), a[1]: (g+8, 2t..), a[2]: (g, 2t+8..), a[3]: (g+8, 2t+8..);
// B (16x8)  b[0]: (k 2t..2t+1, n g), b[1]: (k 2t+8.., n g);  C (16x8) c0,c1: (g, 2t..2t+1), c2,c3: (g+8, 2t..).
// Products of the exactly widened inputs, accumulated in float32 in k order.
template <class T>
inline void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    auto& slots = emu::mma_slots[emu::current / 32];
    auto& mine = slots[emu::lane()];
    std::copy(a, a + 4, mine.begin());
    std::copy(b, b + 2, mine.begin() + 4);
    __syncwarp();
    auto a_at = [&](int r, int k) {  // the lane and register that hold A[r][k]
        const auto& owner = slots[(r % 8) * 4 + (k % 8) / 2];
        return emu::half_value(emu::half_bits(owner[r / 8 + 2 * (k / 8)], k % 2), T{});
    };
    auto b_at = [&](int k, int n) {
        const auto& owner = slots[n * 4 + (k % 8) / 2];
        return emu::half_value(emu::half_bits(owner[4 + k / 8], k % 2), T{});
    };
    const int g = emu::lane() / 4, t = emu::lane() % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i / 2), n = 2 * t + i % 2;
        float sum = acc[i];
        for (int k = 0; k < 16; ++k) sum = fmaf(a_at(r, k), b_at(k, n), sum);
        acc[i] = sum;
    }
    __syncwarp();
}

// cp.async.cg.shared.global (16 bytes, or with source size 0 16 zero bytes, the source unread), commit_group,
// wait_group N.
inline void cp_async_16(void* shared_destination, const void* global_source, bool copy) {
    if (reinterpret_cast<std::uintptr_t>(shared_destination) % 16 ||
        (copy && reinterpret_cast<std::uintptr_t>(global_source) % 16))
        emu::fail("cp.async: an address is not 16-byte aligned");
    emu::async_groups[emu::current].open.push_back({shared_destination, copy ? global_source : nullptr});
}
inline void cp_async_commit() {
    auto& groups = emu::async_groups[emu::current];
    groups.committed.push_back(std::move(groups.open));
    groups.open.clear();
}
template <int PENDING>
inline void cp_async_wait() {
    auto& committed = emu::async_groups[emu::current].committed;
    while (committed.size() > PENDING) {
        for (const emu::AsyncCopy& copy : committed.front()) {
            if (copy.source != nullptr) {
                std::memcpy(copy.destination, copy.source, 16);
            } else {
                std::memset(copy.destination, 0, 16);
            }
        }
        committed.erase(committed.begin());
    }
}

// atomic_add_pair: on sm_90 one 8-byte vector atomic (float2 atomicAdd), whose address must be 8-byte aligned.
inline void atomic_add_pair(float* address, float low, float high) {
    if (reinterpret_cast<std::uintptr_t>(address) % 8 != 0) emu::fail("atomic_add_pair: address not 8-byte aligned");
    atomicAdd(address, low);
    atomicAdd(address + 1, high);
}

// ex2.approx.ftz.f32 (relative error 2^-22 on the GPU), here the host's exp2f.
inline float exp2_approx(float x) { return exp2f(x); }

// ------------------------------------------------------------------------------------------ launching

namespace emu {

constexpr std::size_t CANARY_BYTES = 256;

// kernel(*params[0], *params[1], ...): the argument array of cuLaunchKernel, unpacked by the kernel's own types.
template <class... A, std::size_t... I>
inline void call_packed(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}
template <class... A>
inline void call_packed(void (*kernel)(A...), void** params) {
    call_packed(kernel, params, std::index_sequence_for<A...>{});
}

inline void fiber_entry() {
    (*kernel_body)();
    fibers[current].state = State::done;  // uc_link returns to the scheduler
}

// One block: every thread from the start of the kernel to its end, released barrier by barrier. Returns false on
// barrier divergence: threads parked at different kinds of barrier, or some exited while others wait at one
// (every thread of a block must pass the same number of __syncthreads).
inline bool run_block(unsigned threads, const dim3& block) {
    for (unsigned t = 0; t < threads; ++t) {
        Fiber& fiber = fibers[t];
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = stacks[t].data();
        fiber.context.uc_stack.ss_size = stacks[t].size();
        fiber.context.uc_link = &scheduler;
        makecontext(&fiber.context, fiber_entry, 0);
        fiber.state = State::runnable;
    }
    bool reverse = false;
    const unsigned warps = threads / 32;
    for (;;) {
        // Warp by warp, each up to its next block barrier (its warp barriers released as it reaches them), so one
        // warp's shared-memory writes and reads all happen before the next warp runs: a missing __syncthreads
        // between warps that exchange data through shared memory is a real race here.
        for (unsigned i = 0; i < warps; ++i) {
            const unsigned w = reverse ? warps - 1 - i : i;
            for (;;) {
                for (unsigned j = 0; j < 32; ++j) {  // round-robin, each until it parks or ends
                    const unsigned t = 32 * w + (reverse ? 31 - j : j);
                    if (fibers[t].state != State::runnable) continue;
                    current = t;
                    threadIdx = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
                    swapcontext(&scheduler, &fibers[t].context);
                }
                bool whole_warp = true;
                for (unsigned t = 32 * w; t < 32 * w + 32; ++t) whole_warp = whole_warp && fibers[t].state == State::warp_barrier;
                if (!whole_warp) break;
                for (unsigned t = 32 * w; t < 32 * w + 32; ++t) fibers[t].state = State::runnable;
            }
        }
        bool live = false, exited = false, all_at_block_barrier = true;
        for (unsigned t = 0; t < threads; ++t) {
            live = live || fibers[t].state != State::done;
            exited = exited || fibers[t].state == State::done;
            all_at_block_barrier = all_at_block_barrier && (fibers[t].state == State::done || fibers[t].state == State::block_barrier);
        }
        if (!live) return true;
        if (!all_at_block_barrier || exited) return false;
        for (unsigned t = 0; t < threads; ++t)
            if (fibers[t].state == State::block_barrier) fibers[t].state = State::runnable;
        reverse = !reverse;  // alternate the order, so neither producer nor consumer always runs first
    }
}

// Runs grid[0]*grid[1]*grid[2] blocks one after another, each with block[0]*block[1]*block[2] fibers.
// Returns 0, or 1 with the reason in emu::failure.
inline int launch(const unsigned* grid, const unsigned* block, std::size_t shared_bytes, unsigned char* shared,
                  std::size_t capacity, const std::function<void()>& body) {
    failed = 0;
    failure[0] = 0;
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads % 32 != 0 || threads > 1024) {
        fail("blockDim must be a multiple of the warp size (32), at most 1024 threads");
        return 1;
    }
    if (shared_bytes + CANARY_BYTES > capacity) {
        fail("dynamic shared memory request exceeds the emulator's capacity");
        return 1;
    }
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};
    fibers.assign(threads, Fiber{});
    while (stacks.size() < threads) stacks.emplace_back(STACK_BYTES);
    warp_slots.assign(threads / 32, {});
    mma_slots.assign(threads / 32, {});
    kernel_body = &body;
    for (unsigned z = 0; z < grid[2]; ++z)
        for (unsigned y = 0; y < grid[1]; ++y)
            for (unsigned x = 0; x < grid[0]; ++x) {
                std::memset(shared, 0xff, shared_bytes);  // garbage (NaN bytes), and a canary past the end
                std::memset(shared + shared_bytes, 0xa5, CANARY_BYTES);
                blockIdx = {x, y, z};
                async_groups.assign(threads, {});
                if (!run_block(threads, blockDim)) {
                    fail("barrier divergence: the threads of a block do not pass the same barriers (a barrier in divergent code)");
                    return 1;
                }
                for (std::size_t i = 0; i < CANARY_BYTES; ++i)
                    if (shared[shared_bytes + i] != 0xa5) {
                        fail("a kernel wrote past the end of its dynamic shared memory");
                        return 1;
                    }
                if (failed) return 1;
            }
    return 0;
}

}  // namespace emu
