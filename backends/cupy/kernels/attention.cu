// FlashAttention-2 forward and backward in CUDA C: the math only. The launch code (grids, strides, -D options,
// shared-memory sizes) is backends/cupy/launch.py; it compiles this one file with NVRTC (CuPy), nvcc (the static
// check) or the host C++ compiler (the CPU emulation harness in tests/cupy_emulator), always with the same -D
// options from launch.compile_options().
//
// Compile-time constants (-D): ELEMENT_TYPE (0 float32, 1 float16, 2 bfloat16), HEAD_DIM, HEAD_DIM_V, BLOCK_D,
// BLOCK_DV (head dims padded to a multiple of 16), BLOCK_M (query rows per tile), BLOCK_N (keys per tile),
// NUM_WARPS, SEGMENT_GRANULE (positions per segment range), REGISTER_FORWARD / REGISTER_DQ / REGISTER_DKDV (which
// body that kernel compiles), and the feature switches HAS_LOWER, HAS_UPPER, BOTTOM_RIGHT, HAS_MASK, HAS_BIAS,
// HAS_SOFTCAP, COSINE, HAS_Q_LENGTHS, HAS_KV_LENGTHS, HAS_SEGMENT_IDS, HAS_ALIBI, HAS_DLSE, HAS_DBIAS, GRAD_FLOAT32,
// PAGED, SPLIT_K, ATOMIC_DQ, HAS_MASK_PROGRAM, HAS_DROPOUT (0 or 1): a call without a feature compiles without its
// code.
//
// Visibility (docs/semantics.md §4) is one band on rel = j − i − off_b: LOWER ≤ rel ≤ UPPER, where the window's
// left side gives LOWER = −left and causal and the window's right side give UPPER = min(0, right); off_b is the
// per-batch bottom-right offset kv_len_b − q_len_b (0 for top-left). Rows i ≥ q_len_b and keys j ≥ kv_len_b are
// padding: never loaded, never visible. The band gives the loop bounds, so tiles it hides are never loaded.
//
// ALiBi (HAS_ALIBI, §16) adds −slope[b, h] · |i + off_b − j| to every score, after the softcap, beside the bias
// (score()): from the score's positions in the call and the same off_b, one float32 slope per (batch, query head).
// The backward recomputes the same scores; the slopes take no gradient.
//
// Segment ids (HAS_SEGMENT_IDS, §4.5) add q_id[i] == kv_id[j] >= 0. A position with a negative id is padding, never
// loaded (its row is read as 0). A tile's ids lie in [low, high], read from the granule ranges of
// attnkit.contract.kernels.segment_ranges; a (query tile, key tile) pair whose ranges do not overlap shares no id
// and is skipped inside the band's loop, before any of its operands is loaded.
//
// A mask program (HAS_MASK_PROGRAM, §17) adds mask_program(b, h, i, j) with h the query head: a __device__ function that
// backends/cupy/programs.py generates from the traced mask_mod and splices in at the marker below, reading its
// captured tensors (int32, contiguous, sizes as arguments) with every index clamped into the shape. Block sparsity
// comes from the program's tile classes (attnkit.contract.programs.tile_classes, one byte per (b, h, query tile, key
// tile) at this kernel's tiles): an EMPTY tile is skipped where segment ranges skip theirs, before any operand is
// loaded; a FULL one runs without evaluating the program; only a PARTIAL one evaluates it per element.
//
// Dropout (HAS_DROPOUT, §18) multiplies each normalised probability by M · 1/(1 − p), M the keep-mask of dropout_keep
// (Philox4x32-10 of the element's (b, query head, i, j), i and j raw positions plus the call's offsets); the row sums
// and lse are the undropped ones. The forward feeds P ⊙ M/(1 − p) to P V; the backward regenerates M from the seed
// (nothing of it is saved) for dV += (P ⊙ M/(1 − p))ᵀ dO and dS = P ⊙ (dP ⊙ M/(1 − p) − Δ). The seed, threshold,
// scale and offsets are kernel arguments: one compiled variant serves every seed and p.
//
// A paged KV cache (PAGED, §13) changes only where the forward finds a key: key j of batch row b is slot
// j % block_size of block block_table[b, j / block_size] (PagedRows), the cache's block stride in the batch stride's
// place; any block size works, smaller or larger than BLOCK_N, and table entries past kv_len_b are never read.
// Split-K (SPLIT_K, flash-decoding) runs one of `splits` ranges of a query tile's key tiles per block and writes that
// range's out and lse to float32 partials, which attnkit.contract.kernels.merge_splits combines.
//
// The forward, dQ and dK/dV kernels have two bodies each, chosen by the launcher (-DREGISTER_FORWARD, -DREGISTER_DQ,
// -DREGISTER_DKDV; launch.register_resident). The register-resident ones (float16/bfloat16, head dims in whole 16-byte
// chunks up to 128, no cosine, 16-byte aligned rows) keep scores, probabilities and accumulators in mma.sync
// fragments, 16 rows (dK/dV: 16 keys) per warp, and stream the other operand's tiles through two cp.async stages (see
// their loops). The shared-memory ones serve every other call: tiles live in dynamic shared memory, matrix
// products go through tile_mma (tensor cores by nvcuda::wmma, 16x16x16 with float32 accumulation, for float16/
// bfloat16; IEEE float32 FMA loops for float32), and the accumulators (O, dQ, dK, dV) are float32 tiles in shared
// memory, so those kernels hold few registers and never spill.

#ifndef ATTNKIT_EMULATED
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#endif

#if !defined(ELEMENT_TYPE) || !defined(HEAD_DIM) || !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(NUM_WARPS)
#error "compile with the -D options of attnkit.backends.cupy.launch.compile_options()"
#endif

#if ELEMENT_TYPE == 0
typedef float elem_t;
#define USE_TENSOR_CORES 0
#elif ELEMENT_TYPE == 1
typedef __half elem_t;
#define USE_TENSOR_CORES 1
#else
typedef __nv_bfloat16 elem_t;
#define USE_TENSOR_CORES 1
#endif

// dq, dk, dv in float32 (GRAD_FLOAT32, the cosine variant: the chain rule through the normalisation follows in
// float32) or in the input dtype.
#if GRAD_FLOAT32
typedef float grad_t;
#else
typedef elem_t grad_t;
#endif

// The forward's output: float32 partials under split-K (merged on the host side), else the input dtype.
#if SPLIT_K
typedef float out_t;
#else
typedef elem_t out_t;
#endif

// The kernel compiled with its register-resident body (REGISTER_FORWARD, REGISTER_DQ, REGISTER_DKDV: at most one per
// compiled variant, as each kernel's tile has the shape its own body needs); their PTX-level helpers compile with any.
#define REGISTER_RESIDENT (REGISTER_FORWARD || REGISTER_DQ || REGISTER_DKDV)

// Whether S is more than the scaled q·k (a softcap, bias or ALiBi term): the register-resident kernels then form each
// score with score() and fold log2(e) alone into the exponent; otherwise they fold the scale in with it.
#define SCORE_TERMS (HAS_SOFTCAP || HAS_BIAS || HAS_ALIBI)

#define NUM_THREADS (NUM_WARPS * 32)
// Threads sharing one row in the forward's softmax: a power of two within a warp.
#define THREADS_PER_ROW (NUM_THREADS / BLOCK_M)

static_assert(BLOCK_D % 16 == 0 && BLOCK_DV % 16 == 0 && BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "16-multiples");
static_assert(BLOCK_M % SEGMENT_GRANULE == 0 && BLOCK_N % SEGMENT_GRANULE == 0, "tiles of whole granules");
static_assert(NUM_THREADS % BLOCK_M == 0 && THREADS_PER_ROW <= 32, "whole rows per warp");
static_assert((THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0, "THREADS_PER_ROW is a power of two");

typedef long long index_t;

extern __shared__ __align__(128) unsigned char shared_memory[];

// ------------------------------------------------------------------------------------------------ plumbing

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void assign(float& dst, float x) { dst = x; }
__device__ __forceinline__ void assign(__half& dst, float x) { dst = __float2half(x); }
__device__ __forceinline__ void assign(__nv_bfloat16& dst, float x) { dst = __float2bfloat16(x); }
// x rounded to the element type (as an operand of a tensor-core product would be), in float32.
__device__ __forceinline__ float rounded(float x) {
    elem_t y;
    assign(y, x);
    return to_float(y);
}

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// Regions of dynamic shared memory, each 128-byte aligned, carved in the order launch.SHARED_REGIONS lists them.
struct SharedCursor {
    unsigned char* next;
    template <class T>
    __device__ __forceinline__ T* take(int count) {
        T* region = reinterpret_cast<T*>(next);
        next += (count * sizeof(T) + 127) / 128 * 128;
        return region;
    }
};

// Whether a position below its length is input: not padding by a negative segment id. ids: the batch element's
// segment ids (unread without HAS_SEGMENT_IDS).
__device__ __forceinline__ bool not_segment_padding(const index_t* ids, int position) {
    return !HAS_SEGMENT_IDS || ids[position] >= 0;
}

// Where key j of one batch element lies in a paged cache, from its head's base: slot j % block_size of block
// table[j / block_size] (the batch element's row of the block table), block_stride elements per block.
struct PagedRows {
    const int* table;
    int block_size;
    index_t block_stride, stride;
};

// The offset of row j from an operand's base: j · stride, or through the block table.
__device__ __forceinline__ index_t row_offset(index_t stride, int row) { return row * stride; }
__device__ __forceinline__ index_t row_offset(const PagedRows& rows, int row) {
    return rows.table[row / rows.block_size] * rows.block_stride + (row % rows.block_size) * rows.stride;
}

#if PAGED
typedef PagedRows KeyRows;
#else
typedef index_t KeyRows;
#endif

// How one batch element's keys lie from their head's base: through its row of the block table, the cache's block
// stride given as batch_stride (PAGED), or row_stride apart (the base then holds batch · batch_stride). Built where a
// tile is loaded, so the kernel keeps no copy of it in registers across the loop.
__device__ __forceinline__ KeyRows key_rows(const int* block_table, int batch, int max_blocks, int block_size,
                                            index_t batch_stride, index_t row_stride) {
#if PAGED
    return PagedRows{block_table + (index_t)batch * max_blocks, block_size, batch_stride, row_stride};
#else
    return row_stride;
#endif
}

// tile[r][c] = src[row_offset(rows, first + r) + c] for rows first + r < limit and columns c < width, else 0.
// Rows at or beyond the limit (padding beyond a length, or beyond the tensor) and rows whose segment id is
// negative (padding) are never read, nor their block-table entries.
template <int ROWS, int COLS, class Rows>
__device__ __forceinline__ void load_tile(elem_t* tile, const elem_t* src, Rows rows, int first, int limit, int width,
                                          const index_t* ids) {
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += NUM_THREADS) {
        const int r = idx / COLS, c = idx % COLS;
        float value = 0.0f;
        if (first + r < limit && c < width && not_segment_padding(ids, first + r))
            value = to_float(src[row_offset(rows, first + r) + c]);
        assign(tile[idx], value);
    }
}

template <int COUNT>
__device__ __forceinline__ void zero(float* tile) {
    for (int idx = threadIdx.x; idx < COUNT; idx += NUM_THREADS) tile[idx] = 0.0f;
}

template <bool B, class T, class F>
struct choose {
    typedef T type;
};
template <class T, class F>
struct choose<false, T, F> {
    typedef F type;
};

// C (M x N float32, row-major, ldc) = [C +] A · B, A being M x K and B K x N, both elem_t. A[m][k] is at
// A[m * lda + k], or at A[k * lda + m] when A_T; B[k][n] is at B[k * ldb + n], or at B[n * ldb + k] when B_T.
// Called by every thread of the block; the caller synchronises before reading C.
template <int M, int N, int K, bool A_T, bool B_T, bool ACCUMULATE>
__device__ __forceinline__ void tile_mma(float* C, int ldc, const elem_t* A, int lda, const elem_t* B, int ldb) {
#if USE_TENSOR_CORES
    using namespace nvcuda;
    typedef typename choose<A_T, wmma::col_major, wmma::row_major>::type layout_a;
    typedef typename choose<B_T, wmma::col_major, wmma::row_major>::type layout_b;
    const int warp = threadIdx.x / 32;
    for (int f = warp; f < (M / 16) * (N / 16); f += NUM_WARPS) {
        const int m0 = f / (N / 16) * 16, n0 = f % (N / 16) * 16;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
        if (ACCUMULATE) {
            wmma::load_matrix_sync(c, C + m0 * ldc + n0, ldc, wmma::mem_row_major);
        } else {
            wmma::fill_fragment(c, 0.0f);
        }
        for (int k0 = 0; k0 < K; k0 += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, elem_t, layout_a> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, elem_t, layout_b> b;
            wmma::load_matrix_sync(a, A_T ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
            wmma::load_matrix_sync(b, B_T ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb);
            wmma::mma_sync(c, a, b, c);
        }
        wmma::store_matrix_sync(C + m0 * ldc + n0, c, ldc, wmma::mem_row_major);
    }
#else
    for (int idx = threadIdx.x; idx < M * N; idx += NUM_THREADS) {
        const int m = idx / N, n = idx % N;
        float acc = ACCUMULATE ? C[m * ldc + n] : 0.0f;
#pragma unroll 2  // deeper unrolling spills a few bytes in some float32 variants (ptxas -v)
        for (int k = 0; k < K; ++k) {
            const float a = to_float(A_T ? A[k * lda + m] : A[m * lda + k]);
            const float b = to_float(B_T ? B[n * ldb + k] : B[k * ldb + n]);
            acc = fmaf(a, b, acc);
        }
        C[m * ldc + n] = acc;
    }
#endif
}

// inverse[r] = 1 / max(‖tile[r]‖₂, 1e-12) in float32 for the cosine variant (torch.nn.functional.normalize).
template <int ROWS, int COLS>
__device__ __forceinline__ void inverse_norms(float* inverse, const elem_t* tile) {
    for (int r = threadIdx.x; r < ROWS; r += NUM_THREADS) {
        float squares = 0.0f;
        for (int c = 0; c < COLS; ++c) {
            const float x = to_float(tile[r * COLS + c]);
            squares = fmaf(x, x, squares);
        }
        inverse[r] = 1.0f / fmaxf(sqrtf(squares), 1e-12f);
    }
}

__device__ __forceinline__ float row_max_reduce(float x) {
    for (int lanes = THREADS_PER_ROW / 2; lanes > 0; lanes /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lanes));
    return x;
}

__device__ __forceinline__ float row_sum_reduce(float x) {
    for (int lanes = THREADS_PER_ROW / 2; lanes > 0; lanes /= 2) x += __shfl_xor_sync(0xffffffffu, x, lanes);
    return x;
}

// ------------------------------------------------------------------------------------------------ PTX level

// The register-resident kernels (REGISTER_RESIDENT) work on mma.sync fragments. Each PTX-level operation is one small
// device function here; tests/cupy_emulator/cuda_emulation.h (ATTNKIT_EMULATED) has a twin of each that reproduces
// the PTX ISA's per-lane layouts, so the emulator runs this same source.
#ifndef ATTNKIT_EMULATED
__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// Four 8x8 matrices of 16-bit elements from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&d)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&d)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(shared_address(row)));
}

// acc (16x8 float32) += A (16x16, row) · B (16x8, col) for one warp, T = __half or __nv_bfloat16.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&acc)[4], const unsigned (&a)[4],
                                                            const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16 bytes global → shared, asynchronously (L2 only), or 16 zero bytes without reading the source when !copy; the
// copies of a thread form groups closed by commit, and wait<N> returns once at most N of its groups are in flight.
__device__ __forceinline__ void cp_async_16(void* shared_destination, const void* global_source, bool copy) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(shared_destination)),
                 "l"(global_source), "r"(copy ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// 2^x on the MUFU unit (relative error about 2^-22; −inf gives +0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// address[0] += low, address[1] += high, each atomically: one 8-byte vector reduction on sm_90 (address 8-byte
// aligned), two scalar ones before.
__device__ __forceinline__ void atomic_add_pair(float* address, float low, float high) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(address), make_float2(low, high));
#else
    atomicAdd(address, low);
    atomicAdd(address + 1, high);
#endif
}
#endif

#if REGISTER_RESIDENT
// Two floats rounded to the element type, packed as one 32-bit fragment register (the first in the low half).
__device__ __forceinline__ unsigned pack_pair(float low, float high) {
#if ELEMENT_TYPE == 1
    const __half2 pair = __floats2half2_rn(low, high);
#else
    const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
#endif
    unsigned bits;
    memcpy(&bits, &pair, sizeof bits);
    return bits;
}

// A tile of rows of COLS elements in shared memory, in 16-byte chunks whose column index is XORed with the low bits
// of the row: the 8 row addresses of one ldmatrix matrix then fall in 8 different bank groups (no conflicts).
template <int COLS>
__device__ __forceinline__ int swizzled(int row, int chunk) {
    constexpr int chunks = COLS / 8, mask = chunks % 8 == 0 ? 7 : chunks % 4 == 0 ? 3 : 1;
    return row * COLS + (chunk ^ (row & mask)) * 8;
}

// One lane's ldmatrix row addresses in a swizzled<COLS> tile, computed once outside the tile loops. The lane reads
// row `row` + 8i at chunk 2(f + c) + b (i and c compile-time, f = first_pair and b = chunk_bit fixed per lane or
// warp); with 2P = mask + 1 chunks per swizzle period, c = (c mod P) + (c − c mod P) and the second part only moves
// whole periods, which the XOR with row & mask leaves alone:
//     swizzled(row + 8i, 2(f + c) + b) = swizzled(row, 2(f + c mod P) + b) + 8i·COLS + 16(c − c mod P)
// so P offsets depend on the lane (offset[c mod P]) and the rest is a constant the instruction takes as its
// immediate: the loops do no swizzle arithmetic.
template <int COLS>
struct SwizzledRows {
    static constexpr int CHUNKS = COLS / 8, MASK = CHUNKS % 8 == 0 ? 7 : CHUNKS % 4 == 0 ? 3 : 1;
    static constexpr int PAIRS = (MASK + 1) / 2;
    static_assert(CHUNKS % 2 == 0, "whole chunk pairs");
    int offset[PAIRS];
    __device__ __forceinline__ SwizzledRows(int row, int chunk_bit, int first_pair = 0) {
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) offset[p] = swizzled<COLS>(row, 2 * (first_pair + p) + chunk_bit);
    }
    // swizzled(row + 8 · row_blocks, 2 · (first_pair + chunk_pair) + chunk_bit)
    __device__ __forceinline__ int at(int row_blocks, int chunk_pair) const {
        return offset[chunk_pair % PAIRS] + 8 * row_blocks * COLS + 16 * (chunk_pair - chunk_pair % PAIRS);
    }
};

// The swizzled tile[r] = src row first + r for rows below the limit (and not segment padding), by 16-byte cp.async
// copies; other rows, and chunks past the width, are filled with zeros by the same instruction (source size 0), so
// the loop has no branch. The caller commits the group. Each thread copies one chunk column (of a power-of-two count
// covering the row) of every ROW_STEP-th row: a strided operand's source advances by one 64-bit add per row, a
// paged cache finds each row through its block table, read only for rows below the limit.
template <int ROWS, int COLS, class Rows>
__device__ __forceinline__ void load_tile_async(elem_t* tile, const elem_t* src, Rows rows, int first, int limit,
                                                int width, const index_t* ids) {
    constexpr int chunks = COLS / 8, columns = chunks <= 2 ? 2 : chunks <= 4 ? 4 : chunks <= 8 ? 8 : 16;
    constexpr int ROW_STEP = NUM_THREADS / columns;
    static_assert(chunks <= 16 && NUM_THREADS % columns == 0, "rows of at most 16 chunks");
    const int chunk = threadIdx.x % columns, r0 = threadIdx.x / columns;
    if (chunk >= chunks) return;
    const elem_t* source = PAGED ? src : src + row_offset(rows, first + r0) + chunk * 8;
#pragma unroll
    for (int i = 0; i < (ROWS + ROW_STEP - 1) / ROW_STEP; ++i) {
        const int r = r0 + i * ROW_STEP;
        if (ROWS % ROW_STEP != 0 && r >= ROWS) break;
        const bool copy = first + r < limit && chunk * 8 < width && not_segment_padding(ids, first + r);
        const elem_t* row_source = PAGED ? (copy ? src + row_offset(rows, first + r) + chunk * 8 : src) : source;
        cp_async_16(tile + swizzled<COLS>(r, chunk), row_source, copy);
        if (!PAGED) source += ROW_STEP * row_offset(rows, 1);
    }
}

#endif

// ------------------------------------------------------------------------------------------------ mask programs

// Python's // and % from C's truncating / and % (rounding toward −inf, the remainder taking the divisor's sign),
// and C's own; a zero divisor, the program's error, gives 0 rather than a trap.
__device__ __forceinline__ int trunc_div(int a, int b) { return b == 0 ? 0 : a / b; }
__device__ __forceinline__ int trunc_rem(int a, int b) { return b == 0 ? 0 : a % b; }
__device__ __forceinline__ int floor_div(int a, int b) {
    const int quotient = trunc_div(a, b);
    return quotient - (trunc_rem(a, b) != 0 && (a < 0) != (b < 0));
}
__device__ __forceinline__ int floor_mod(int a, int b) {
    const int remainder = trunc_rem(a, b);
    return remainder != 0 && (remainder < 0) != (b < 0) ? remainder + b : remainder;
}

// Tile classes of attnkit.contract.programs (EMPTY: no pair visible under the program; FULL: every pair).
#define TILE_EMPTY 0
#define TILE_PARTIAL 1
#define TILE_FULL 2

#if HAS_MASK_PROGRAM
// MASK_PROGRAM: backends/cupy/programs.py splices the generated program here
#ifndef MASK_PROGRAM_SPLICED
#error "HAS_MASK_PROGRAM compiles a source with a program spliced in (backends/cupy/programs.splice)"
#endif
// The program's kernel arguments, last in every kernel's list: the tile classes (B|1, Hq|1, query tiles, key
// tiles) with their strides (0 on a size-1 axis; key tiles contiguous), then each captured tensor and its sizes.
#define PROGRAM_PARAMETERS                                                                                 \
    , const unsigned char* __restrict__ tile_classes, index_t classes_b, index_t classes_h, index_t classes_q \
        CAPTURED_PARAMETERS
#define PROGRAM_ARGUMENTS {tile_classes, classes_b, classes_h, classes_q, PROGRAM_CAPTURED}
struct Program {
    const unsigned char* classes;
    index_t classes_b, classes_h, classes_q;
    ProgramCaptured captured;
};
#else
#define PROGRAM_PARAMETERS
#define PROGRAM_ARGUMENTS {}
struct Program {};
#endif

// The class of the tile at (row_start, key_start) for one (batch, query head); FULL without a program.
__device__ __forceinline__ int program_tile_class(const Program& program, int batch, int head, int row_start,
                                                  int key_start) {
#if HAS_MASK_PROGRAM
    return program.classes[batch * program.classes_b + head * program.classes_h +
                           (row_start / BLOCK_M) * program.classes_q + key_start / BLOCK_N];
#else
    return TILE_FULL;
#endif
}

// ------------------------------------------------------------------------------------------------ dropout

// A call's dropout (HAS_DROPOUT): the seed's words, the threshold, the scale 1/(1 − p), and the offsets of this call's
// query heads, queries and keys in the unsharded call. The seed arrives as a pointer to its int64 (read unsigned), so
// a seed drawn on the device is never read back by the host.
#if HAS_DROPOUT
#define DROPOUT_PARAMETERS                                                                         \
    , const long long* __restrict__ dropout_seed, unsigned dropout_threshold, float dropout_scale, \
        int dropout_head_start, int dropout_query_start, int dropout_key_start
#define DROPOUT_ARGUMENTS                                                                               \
    dropout_of(dropout_seed, dropout_threshold, dropout_scale, dropout_head_start, dropout_query_start, \
               dropout_key_start)
#else
#define DROPOUT_PARAMETERS
#define DROPOUT_ARGUMENTS {}
#endif
struct Dropout {
    unsigned seed_low, seed_high, threshold;
    float scale;
    int head_start, query_start, key_start;
};

__device__ __forceinline__ Dropout dropout_of(const long long* seed, unsigned threshold, float scale, int head_start,
                                              int query_start, int key_start) {
    const unsigned long long bits = static_cast<unsigned long long>(*seed);
    return Dropout{static_cast<unsigned>(bits), static_cast<unsigned>(bits >> 32), threshold, scale, head_start,
                   query_start, key_start};
}

// Philox4x32-10 (Random123's philox4x32): ten rounds of
//   (hi0, lo0) = mulhilo(0xD2511F53, c0);  (hi1, lo1) = mulhilo(0xCD9E8D57, c2);  c = (hi1^c1^k0, lo1, hi0^c3^k1, lo0)
// with the key bumped by (0x9E3779B9, 0xBB67AE85) between rounds.
__device__ __forceinline__ void philox4x32(unsigned (&c)[4], unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        c[0] = hi1 ^ c[1] ^ k0;
        c[1] = lo1;
        c[2] = hi0 ^ c[3] ^ k1;
        c[3] = lo0;
    }
}

// The keep step, which the forward, dQ and dK/dV kernels all call: element (b, h, i, j) of the unsharded call (h the
// query head, i = query_start + row, j = key_start + col) is kept iff word j & 3 of Philox4x32-10(counter
// (j >> 2, i, h, b), key (seed_low, seed_high)) is at least the threshold (unsigned). The word is picked by selects,
// not by indexing, so the counter stays in registers.
__device__ __forceinline__ bool dropout_keep(const Dropout& dropout, int batch, int head, int row, int col) {
    const unsigned i = static_cast<unsigned>(dropout.query_start) + row;
    const unsigned j = static_cast<unsigned>(dropout.key_start) + col;
    unsigned c[4] = {j >> 2, i, static_cast<unsigned>(dropout.head_start) + head, static_cast<unsigned>(batch)};
    philox4x32(c, dropout.seed_low, dropout.seed_high);
    const unsigned word = j & 2 ? (j & 1 ? c[3] : c[2]) : (j & 1 ? c[1] : c[0]);
    return word >= dropout.threshold;
}

// What a normalised probability of (b, h, row, col) is multiplied by: 1/(1 − p) where kept, 0 where dropped; 1
// without HAS_DROPOUT, so that code compiles away.
__device__ __forceinline__ float dropout_factor(const Dropout& dropout, int batch, int head, int row, int col) {
#if HAS_DROPOUT
    return dropout_keep(dropout, batch, head, row, col) ? dropout.scale : 0.0f;
#else
    return 1.0f;
#endif
}

// ------------------------------------------------------------------------------------------------ geometry

struct Geometry {
    int q_len, kv_len, offset;      // q_len_b, kv_len_b, off_b
    const index_t *q_ids, *kv_ids;  // the batch element's segment ids (unread without HAS_SEGMENT_IDS)
};

__device__ __forceinline__ Geometry batch_geometry(const int* q_lengths, const int* kv_lengths,
                                                   const index_t* q_segment_ids, const index_t* kv_segment_ids,
                                                   int batch, int len_q, int len_k) {
    Geometry g;
    g.q_len = HAS_Q_LENGTHS ? q_lengths[batch] : len_q;
    g.kv_len = HAS_KV_LENGTHS ? kv_lengths[batch] : len_k;
    g.offset = BOTTOM_RIGHT ? g.kv_len - g.q_len : 0;
    g.q_ids = q_segment_ids + (index_t)batch * len_q;
    g.kv_ids = kv_segment_ids + (index_t)batch * len_k;
    return g;
}

// The least and greatest non-negative segment id of a tile's positions (low > high: all padding).
struct SegmentRange {
    index_t low, high;
};

// The range of positions start..start+BLOCK of one batch element, from its granule ranges (B, ceil(length /
// SEGMENT_GRANULE), 2); without segment ids, one range that meets itself. Every thread computes the same range, so a
// tile skipped by it is skipped by the whole block.
template <int BLOCK>
__device__ __forceinline__ SegmentRange segment_range(const index_t* ranges, int batch, int start, int length) {
    if (!HAS_SEGMENT_IDS) return SegmentRange{0, 0};
    const int granules = (length + SEGMENT_GRANULE - 1) / SEGMENT_GRANULE, first = start / SEGMENT_GRANULE;
    const index_t* base = ranges + (index_t)batch * granules * 2;
    SegmentRange range = {base[2 * first], base[2 * first + 1]};
    for (int g = first + 1; g < min(first + BLOCK / SEGMENT_GRANULE, granules); ++g) {
        range.low = min(range.low, base[2 * g]);
        range.high = max(range.high, base[2 * g + 1]);
    }
    return range;
}

// Whether two tiles may share a segment id: their ranges overlap.
__device__ __forceinline__ bool ranges_meet(SegmentRange a, SegmentRange b) {
    return a.low <= b.high && b.low <= a.high;
}

// The first tile of BLOCK positions at or after start (before end) whose segment range meets the other operand's tile
// range and that the mask program does not leave empty (empty(start): its class is EMPTY); start itself without
// segment ids and program.
template <int BLOCK, class Empty>
__device__ __forceinline__ int meeting_tile_from(int start, int end, SegmentRange other, const index_t* ranges,
                                                 int batch, int length, Empty empty) {
    while (start < end && (!ranges_meet(other, segment_range<BLOCK>(ranges, batch, start, length)) || empty(start)))
        start += BLOCK;
    return start;
}

// [first, end) of the keys rows row_start..row_start+BLOCK_M may see; first is tile-aligned.
__device__ __forceinline__ void key_span(int row_start, Geometry g, int lower, int upper, int& first, int& end) {
    const int last_row = min(row_start + BLOCK_M, g.q_len) - 1;
    first = 0;
    end = row_start < g.q_len ? g.kv_len : 0;
    if (HAS_LOWER) first = max(row_start + g.offset + lower, 0);
    if (HAS_UPPER) end = min(end, last_row + g.offset + upper + 1);
    first = first / BLOCK_N * BLOCK_N;
}

// The forward's block x is split · query tiles + query tile (split-major); without SPLIT_K, the query tile. Both are
// read from blockIdx where they are needed, so no register holds them across the key loop.
__device__ __forceinline__ int query_tile(int len_q) {
    return SPLIT_K ? blockIdx.x % ((len_q + BLOCK_M - 1) / BLOCK_M) : blockIdx.x;
}
__device__ __forceinline__ int key_split(int len_q) {
    return SPLIT_K ? blockIdx.x / ((len_q + BLOCK_M - 1) / BLOCK_M) : 0;
}

// Split-K: the split-th of `splits` runs of whole key tiles covering [first, end), first tile-aligned; empty
// (first >= end) for the ranges past a short span.
__device__ __forceinline__ void split_range(int split, int splits, int& first, int& end) {
    const int tiles_per_split = ((end - first + BLOCK_N - 1) / BLOCK_N + splits - 1) / splits;
    first += split * tiles_per_split * BLOCK_N;
    end = min(end, first + tiles_per_split * BLOCK_N);
}

// [first, end) of the query rows that may see keys key_start..key_start+BLOCK_N; first is tile-aligned.
__device__ __forceinline__ void query_span(int key_start, Geometry g, int lower, int upper, int& first, int& end) {
    const int last_key = min(key_start + BLOCK_N, g.kv_len) - 1;
    first = 0;
    end = key_start < g.kv_len ? g.q_len : 0;
    if (HAS_UPPER) first = max(key_start - g.offset - upper, 0);
    if (HAS_LOWER) end = min(end, last_key - g.offset - lower + 1);
    first = first / BLOCK_M * BLOCK_M;
}

// The register-resident kernels apply the mask only to the tiles that need it: the tiles the band cuts, the last
// partial one, every tile of a row (column) tile that runs past its length, every tile with a mask, segment ids or a
// program (whose FULL tiles then skip only its evaluation).
// The interior tiles [interior_first, interior_end) of the span [first, end) between them run unmasked.
// Key tiles of the query tile at row_start (the forward, dQ):
__device__ __forceinline__ void interior_key_tiles(int row_start, Geometry g, int lower, int upper, int first, int end,
                                                   int& interior_first, int& interior_end) {
    interior_first = interior_end = end;
    if (HAS_MASK || HAS_SEGMENT_IDS || HAS_MASK_PROGRAM || row_start + BLOCK_M > g.q_len) return;
    interior_first = first;
    if (HAS_LOWER)
        interior_first =
            max(first, (max(row_start + BLOCK_M - 1 + g.offset + lower, 0) + BLOCK_N - 1) / BLOCK_N * BLOCK_N);
    int limit = g.kv_len;
    if (HAS_UPPER) limit = min(limit, max(row_start + g.offset + upper + 1, 0));
    interior_first = min(interior_first, end);
    interior_end = max(interior_first, min(limit / BLOCK_N * BLOCK_N, end));
}

// Query tiles of the key tile at key_start (dK/dV): rows i ≥ key_start + BLOCK_N − 1 − off − upper see its last key
// within the band's upper side, rows i ≤ key_start − off − lower its first key within the lower side.
__device__ __forceinline__ void interior_query_tiles(int key_start, Geometry g, int lower, int upper, int first,
                                                     int end, int& interior_first, int& interior_end) {
    interior_first = interior_end = end;
    if (HAS_MASK || HAS_SEGMENT_IDS || HAS_MASK_PROGRAM || key_start + BLOCK_N > g.kv_len) return;
    interior_first = first;
    if (HAS_UPPER)
        interior_first =
            max(first, (max(key_start + BLOCK_N - 1 - g.offset - upper, 0) + BLOCK_M - 1) / BLOCK_M * BLOCK_M);
    int limit = g.q_len;
    if (HAS_LOWER) limit = min(limit, max(key_start - g.offset - lower + 1, 0));
    interior_first = min(interior_first, end);
    interior_end = max(interior_first, min(limit / BLOCK_M * BLOCK_M, end));
}

// The optional per-(batch, query head) terms: the mask and bias planes, broadcast by stride 0, ALiBi's slope with
// the batch element's offset off_b, and the mask program with the (batch, query head) it is evaluated at.
struct Planes {
    const unsigned char* mask;
    const float* bias;
    index_t mask_m, mask_n, bias_m, bias_n;
    float alibi_slope;
    int offset;
    Program program;
    int batch, head;
};

// Whether query row i sees key j. program_tile: the program's class of the tile holding (row, col); the program is
// evaluated only in a PARTIAL tile (an EMPTY one is never reached, a FULL one admits every pair).
__device__ __forceinline__ bool visible(int row, int col, Geometry g, int lower, int upper, const Planes& planes,
                                        int program_tile) {
    if (row >= g.q_len || col >= g.kv_len) return false;
    const int rel = col - row - g.offset;
    if (HAS_LOWER && rel < lower) return false;
    if (HAS_UPPER && rel > upper) return false;
    if (HAS_MASK && planes.mask[row * planes.mask_m + col * planes.mask_n] == 0) return false;
    if (HAS_SEGMENT_IDS && (g.q_ids[row] < 0 || g.q_ids[row] != g.kv_ids[col])) return false;
#if HAS_MASK_PROGRAM
    if (program_tile != TILE_FULL && !mask_program(planes.batch, planes.head, row, col, planes.program.captured))
        return false;
#endif
    return true;
}

struct Score {
    float s;       // the score S
    float tanh_u;  // tanh(U / c) for the softcap derivative
};

// U = scale · q̂·k̂ (dot = raw q·k, times both inverse norms for the cosine variant);
// S = c · tanh(U / c) if softcapped, else U;  S += bias;  S −= slope · |i + off_b − j| (ALiBi).
// qk_scale is scale / c when softcapped.
__device__ __forceinline__ Score score(float dot, float q_inverse, float k_inverse, float qk_scale, float softcap,
                                       int row, int col, const Planes& planes) {
    float u = dot;
    if (COSINE) u = u * q_inverse * k_inverse;
    u *= qk_scale;
    Score result = {u, u};
    if (HAS_SOFTCAP) {
        result.tanh_u = tanhf(u);
        result.s = softcap * result.tanh_u;
    }
    if (HAS_BIAS) result.s += planes.bias[row * planes.bias_m + col * planes.bias_n];
    // positions below 2^24 are exact in float32
    if (HAS_ALIBI) result.s -= planes.alibi_slope * fabsf(static_cast<float>(row + planes.offset - col));
    return result;
}

// Strides (batch, head, row, column) of the mask and the bias, 0 on broadcast axes; the batch stride of ALiBi's
// (B|1, Hq) slopes, 0 for one row.
struct PlaneStrides {
    index_t mask_b, mask_h, mask_m, mask_n, bias_b, bias_h, bias_m, bias_n, alibi_b;
};

__device__ __forceinline__ Planes planes_of(const unsigned char* mask, const float* bias, const float* alibi_slopes,
                                            const PlaneStrides& st, const Geometry& g, const Program& program,
                                            int batch, int head) {
    Planes planes;
    planes.program = program;
    planes.batch = batch;
    planes.head = head;
    planes.alibi_slope = HAS_ALIBI ? alibi_slopes[batch * st.alibi_b + head] : 0.0f;
    planes.offset = g.offset;
    planes.mask = mask + batch * st.mask_b + head * st.mask_h;
    planes.bias = bias + batch * st.bias_b + head * st.bias_h;
    planes.mask_m = st.mask_m;
    planes.mask_n = st.mask_n;
    planes.bias_m = st.bias_m;
    planes.bias_n = st.bias_n;
    return planes;
}

// ------------------------------------------------------------------------------------------------ kernels

// One query tile of one (batch, query head): out and lse, or under SPLIT_K one key range's partial out and lse
// (offset by split · o_s, lse_s). Grid (query tiles × splits, Hq, B), split-major.
// One block per SM is enough to fix ptxas's register budget (without it, 168 registers and a spill at D = 64).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
    attention_forward(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                      out_t* __restrict__ out, float* __restrict__ lse, const float* __restrict__ bias,
                      const unsigned char* __restrict__ mask, const int* __restrict__ q_lengths,
                      const int* __restrict__ kv_lengths, const index_t* __restrict__ q_segment_ids,
                      const index_t* __restrict__ kv_segment_ids, const index_t* __restrict__ q_segment_ranges,
                      const index_t* __restrict__ kv_segment_ranges, const float* __restrict__ alibi_slopes,
                      const int* __restrict__ block_table, index_t q_b, index_t q_h, index_t q_m, index_t k_b,
                      index_t k_h, index_t k_n, index_t v_b, index_t v_h, index_t v_n, index_t o_b, index_t o_h,
                      index_t o_m, index_t o_s, index_t lse_s, index_t bias_b, index_t bias_h, index_t bias_m,
                      index_t bias_n, index_t mask_b, index_t mask_h, index_t mask_m, index_t mask_n, index_t alibi_b,
                      int heads_q, int group, int len_q, int len_k, float qk_scale, float softcap, int lower, int upper,
                      int block_size, int max_blocks, int splits DROPOUT_PARAMETERS PROGRAM_PARAMETERS) {
    const int row_start = query_tile(len_q) * BLOCK_M, head = blockIdx.y, batch = blockIdx.z;
    const Program program = PROGRAM_ARGUMENTS;
    const Dropout dropout = DROPOUT_ARGUMENTS;
    const Geometry g = batch_geometry(q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, batch, len_q, len_k);
    const PlaneStrides strides = {mask_b, mask_h, mask_m, mask_n, bias_b, bias_h, bias_m, bias_n, alibi_b};
    const Planes planes = planes_of(mask, bias, alibi_slopes, strides, g, program, batch, head);
    // A paged cache's keys go through the block table (key_rows): no batch offset in the head's base.
    const elem_t* k_head = k + (PAGED ? 0 : batch * k_b) + (head / group) * k_h;
    const elem_t* v_head = v + (PAGED ? 0 : batch * v_b) + (head / group) * v_h;

#if REGISTER_FORWARD
    // Register-resident FlashAttention-2: warp w owns query rows 16w..16w+15 of the tile; its scores S, probabilities
    // P and output accumulator O live in mma.sync fragments (lane l: group row g = l/4, column pair 2·(l%4)), so each
    // lane holds rows g and g+8 of its warp's strip. K and V tiles stream through two shared-memory stages by cp.async.
    static_assert(BLOCK_M == 16 * NUM_WARPS && BLOCK_N % 16 == 0, "16 query rows per warp, key tiles of 16");
    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM_V % 8 == 0 && !COSINE, "whole 16-byte chunks, no cosine");
    constexpr int K_STEPS = BLOCK_D / 16, KEY_BLOCKS = BLOCK_N / 8, OUT_BLOCKS = BLOCK_DV / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    SharedCursor cursor = {shared_memory};
    elem_t* q_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_D);
    elem_t* k_stages = cursor.take<elem_t>(2 * BLOCK_N * BLOCK_D);  // stage s at k_stages + s · BLOCK_N · BLOCK_D
    elem_t* v_stages = cursor.take<elem_t>(2 * BLOCK_N * BLOCK_DV);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, lane_row = lane / 4, pair = 2 * (lane % 4);
    // The lane's ldmatrix rows (SwizzledRows; the layouts as in the dK/dV kernel): K as the B operand of S (`rows`),
    // V transposed as the B operand of P V (`columns`).
    const SwizzledRows<BLOCK_D> k_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2);
    const SwizzledRows<BLOCK_DV> v_columns(lane % 16, lane / 16);

    int first, end;
    key_span(row_start, g, lower, upper, first, end);
    if (SPLIT_K) split_range(key_split(len_q), splits, first, end);
    const SegmentRange q_range = segment_range<BLOCK_M>(q_segment_ranges, batch, row_start, len_q);
    // The key tile at or after key_start that shares a segment id with the query tile (every tile without ids).
    auto meeting_tile = [&](int key_start) {
        return meeting_tile_from<BLOCK_N>(key_start, end, q_range, kv_segment_ranges, batch, len_k, [&](int start) {
            return program_tile_class(program, batch, head, row_start, start) == TILE_EMPTY;
        });
    };
    auto load_keys = [&](int key_start, int stage) {
        const KeyRows k_rows = key_rows(block_table, batch, max_blocks, block_size, k_b, k_n);
        const KeyRows v_rows = key_rows(block_table, batch, max_blocks, block_size, v_b, v_n);
        load_tile_async<BLOCK_N, BLOCK_D>(k_stages + stage * BLOCK_N * BLOCK_D, k_head, k_rows, key_start, g.kv_len,
                                          HEAD_DIM, g.kv_ids);
        load_tile_async<BLOCK_N, BLOCK_DV>(v_stages + stage * BLOCK_N * BLOCK_DV, v_head, v_rows, key_start, g.kv_len,
                                           HEAD_DIM_V, g.kv_ids);
    };
    load_tile_async<BLOCK_M, BLOCK_D>(q_tile, q + batch * q_b + head * q_h, q_m, row_start, g.q_len, HEAD_DIM,
                                      g.q_ids);
    int key_start = meeting_tile(first), stage = 0;
    if (key_start < end) load_keys(key_start, stage);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // Q's A fragments, one per 16 columns: matrices (rows 0-7 | 8-15) × (columns 0-7 | 8-15) of the warp's strip.
    unsigned q_fragments[K_STEPS][4];
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk)
        ldmatrix_x4(q_fragments[kk], q_tile + swizzled<BLOCK_D>(16 * warp + lane % 16, 2 * kk + lane / 16));

    int interior_first, interior_end;
    interior_key_tiles(row_start, g, lower, upper, first, end, interior_first, interior_end);

    // Scores in base 2: logit t = q·k (the scale folded into the exponent's FMA), or with a softcap, bias or ALiBi
    // t = log2(e) · S with fold 1.
    const float fold = SCORE_TERMS ? 1.0f : qk_scale * LOG2E;
    float o[OUT_BLOCKS][4] = {}, row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.0f, 0.0f};
    // Online softmax over the key tiles, in base 2 (m, l per row; each lane sums its own columns, the quad at the end):
    //   S = Q Kᵀ (t per score);  m' = max(m, fold · rowmax t);  P = 2^(fold · t − m');  α = 2^(m − m')
    //   l' = α·l + rowsum P;  O' = α·O + P V  (P rounded to the input type, reused from registers as the A operand)
    // and at the end out = O / l, lse = ln 2 · m + ln l. A row with no visible key yet has m = −inf; its shift is
    // taken as 0 so that P and α are 2^(−inf) = 0, never NaN. With dropout, P V takes P ⊙ M/(1 − p); l sums P.
    // masked: a constant at each call, so the interior loop's inlined copy compiles without the masks.
    auto tile = [&](bool masked) {
        cp_async_wait<0>();
        __syncthreads();  // the tile has landed for every thread, and every warp is done with the other stage
        const int next = meeting_tile(key_start + BLOCK_N);
        const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
        if (next < end) load_keys(next, stage ^ 1);
        cp_async_commit();
        const elem_t* k_tile = k_stages + stage * BLOCK_N * BLOCK_D;
        const elem_t* v_tile = v_stages + stage * BLOCK_N * BLOCK_DV;

        float s[KEY_BLOCKS][4] = {};
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) {
#pragma unroll
            for (int j = 0; j < KEY_BLOCKS; j += 2) {  // B = Kᵀ: key rows 8j..8j+15, columns 16kk..16kk+15
                unsigned b[4];
                ldmatrix_x4(b, k_tile + k_rows.at(j, kk));
                mma_m16n8k16<elem_t>(s[j], q_fragments[kk], {b[0], b[1]});
                mma_m16n8k16<elem_t>(s[j + 1], q_fragments[kk], {b[2], b[3]});
            }
        }
        float tile_max[2] = {negative_infinity(), negative_infinity()};
#pragma unroll
        for (int j = 0; j < KEY_BLOCKS; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row_start + 16 * warp + lane_row + 8 * (i / 2), col = key_start + 8 * j + pair + i % 2;
                if (masked && !visible(row, col, g, lower, upper, planes, program_tile)) {
                    s[j][i] = negative_infinity();
                } else if (SCORE_TERMS) {
                    s[j][i] = score(s[j][i], 1.0f, 1.0f, qk_scale, softcap, row, col, planes).s * LOG2E;
                }
                tile_max[i / 2] = fmaxf(tile_max[i / 2], s[j][i]);
            }
        float shift[2], alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the quad of lanes sharing a row
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float new_max = fmaxf(row_max[h], fold * tile_max[h]);
            shift[h] = new_max == negative_infinity() ? 0.0f : new_max;
            alpha[h] = exp2_approx(row_max[h] - shift[h]);
            row_max[h] = new_max;
            row_sum[h] *= alpha[h];
        }
#pragma unroll
        for (int jv = 0; jv < OUT_BLOCKS; ++jv)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[jv][i] *= alpha[i / 2];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // keys 16kk..16kk+15: P's A fragment is S's C fragments 2kk, 2kk+1
            float p[2][4];
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    p[half][i] = exp2_approx(fmaf(s[2 * kk + half][i], fold, -shift[i / 2]));
                    row_sum[i / 2] += p[half][i];
                    p[half][i] *= dropout_factor(dropout, batch, head, row_start + 16 * warp + lane_row + 8 * (i / 2),
                                                 key_start + 16 * kk + 8 * half + pair + i % 2);
                }
            const unsigned a[4] = {pack_pair(p[0][0], p[0][1]),  // rows g, g+8 × keys 2t.. | 2t+8..
                                   pack_pair(p[0][2], p[0][3]), pack_pair(p[1][0], p[1][1]),
                                   pack_pair(p[1][2], p[1][3])};
#pragma unroll
            for (int jv = 0; jv < OUT_BLOCKS; jv += 2) {  // B = V: key rows 16kk.., columns 8jv..8jv+15, transposed
                unsigned b[4];
                ldmatrix_x4_trans(b, v_tile + v_columns.at(2 * kk, jv / 2));
                mma_m16n8k16<elem_t>(o[jv], a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(o[jv + 1], a, {b[2], b[3]});
            }
        }
        key_start = next;
        stage ^= 1;
    };
    while (key_start < interior_first) tile(true);
    while (key_start < interior_end) tile(false);
    while (key_start < end) tile(true);

    const int split = key_split(len_q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
        row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
        // Empty means no weight at all: a NaN score is skipped by the max yet makes the sum NaN (NaN out and lse).
        const bool empty = row_sum[h] == 0.0f;
        const int row = row_start + 16 * warp + lane_row + 8 * h;
        if (row >= len_q) continue;
        out_t* out_row = out + split * o_s + batch * o_b + head * o_h + row * o_m;
#pragma unroll
        for (int jv = 0; jv < OUT_BLOCKS; ++jv)
#pragma unroll
            for (int i = 2 * h; i < 2 * h + 2; ++i) {
                const int c = 8 * jv + pair + i % 2;
                if (c < HEAD_DIM_V) assign(out_row[c], empty ? 0.0f : o[jv][i] / row_sum[h]);
            }
        if (lane % 4 == 0)
            lse[split * lse_s + ((index_t)batch * heads_q + head) * len_q + row] =
                empty ? negative_infinity() : row_max[h] * 0.6931471805599453f + logf(row_sum[h]);
    }
#else
    SharedCursor cursor = {shared_memory};
    elem_t* q_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_D);
    elem_t* k_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_D);
    elem_t* v_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_DV);
    float* s_tile = cursor.take<float>(BLOCK_M * BLOCK_N);
    elem_t* p_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_N);
    float* o_acc = cursor.take<float>(BLOCK_M * BLOCK_DV);
    float* q_inverse = cursor.take<float>(BLOCK_M);
    float* k_inverse = cursor.take<float>(BLOCK_N);

    load_tile<BLOCK_M, BLOCK_D>(q_tile, q + batch * q_b + head * q_h, q_m, row_start, g.q_len, HEAD_DIM, g.q_ids);
    zero<BLOCK_M * BLOCK_DV>(o_acc);
    __syncthreads();
    if (COSINE) inverse_norms<BLOCK_M, BLOCK_D>(q_inverse, q_tile);

    int first, end;
    key_span(row_start, g, lower, upper, first, end);
    if (SPLIT_K) split_range(key_split(len_q), splits, first, end);
    const SegmentRange q_range = segment_range<BLOCK_M>(q_segment_ranges, batch, row_start, len_q);
    const int r = threadIdx.x / THREADS_PER_ROW, lane = threadIdx.x % THREADS_PER_ROW, row = row_start + r;
    float row_max = negative_infinity(), row_sum = 0.0f;
    // Online softmax over the key tiles (FlashAttention-2):
    //   m' = max(m, rowmax S);  α = exp(m − m');  P = exp(S − m');  l' = α·l + rowsum P;  acc' = α·acc + (P ⊙ D) V
    // (D = M/(1 − p) with dropout, else 1) and once at the end: out = acc / l, lse = m + log l. A row that has seen
    // no visible key keeps m = −inf; its shift is taken as 0 so that P and α are exp(−inf) = 0, never exp(−inf + inf)
    // = NaN.
    for (int key_start = first; key_start < end; key_start += BLOCK_N) {
        // A key tile sharing no segment id with the query tile, or empty under the program, is skipped.
        if (!ranges_meet(q_range, segment_range<BLOCK_N>(kv_segment_ranges, batch, key_start, len_k))) continue;
        const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
        if (program_tile == TILE_EMPTY) continue;
        const KeyRows k_rows = key_rows(block_table, batch, max_blocks, block_size, k_b, k_n);
        const KeyRows v_rows = key_rows(block_table, batch, max_blocks, block_size, v_b, v_n);
        load_tile<BLOCK_N, BLOCK_D>(k_tile, k_head, k_rows, key_start, g.kv_len, HEAD_DIM, g.kv_ids);
        load_tile<BLOCK_N, BLOCK_DV>(v_tile, v_head, v_rows, key_start, g.kv_len, HEAD_DIM_V, g.kv_ids);
        __syncthreads();
        if (COSINE) inverse_norms<BLOCK_N, BLOCK_D>(k_inverse, k_tile);
        tile_mma<BLOCK_M, BLOCK_N, BLOCK_D, false, true, false>(s_tile, BLOCK_N, q_tile, BLOCK_D, k_tile, BLOCK_D);
        __syncthreads();

        float tile_max = negative_infinity();
        for (int c = lane; c < BLOCK_N; c += THREADS_PER_ROW) {
            const int col = key_start + c;
            float s = negative_infinity();
            if (visible(row, col, g, lower, upper, planes, program_tile))
                s = score(s_tile[r * BLOCK_N + c], q_inverse[r], k_inverse[c], qk_scale, softcap, row, col, planes).s;
            s_tile[r * BLOCK_N + c] = s;
            tile_max = fmaxf(tile_max, s);
        }
        const float new_max = fmaxf(row_max, row_max_reduce(tile_max));
        const float shift = new_max == negative_infinity() ? 0.0f : new_max;
        const float alpha = expf(row_max - shift);
        float tile_sum = 0.0f;
        for (int c = lane; c < BLOCK_N; c += THREADS_PER_ROW) {
            const float p = expf(s_tile[r * BLOCK_N + c] - shift);
            assign(p_tile[r * BLOCK_N + c], p * dropout_factor(dropout, batch, head, row, key_start + c));
            tile_sum += p;
        }
        row_sum = row_sum * alpha + row_sum_reduce(tile_sum);
        row_max = new_max;
        for (int c = lane; c < BLOCK_DV; c += THREADS_PER_ROW) o_acc[r * BLOCK_DV + c] *= alpha;
        __syncthreads();
        tile_mma<BLOCK_M, BLOCK_DV, BLOCK_N, false, false, true>(o_acc, BLOCK_DV, p_tile, BLOCK_N, v_tile, BLOCK_DV);
        __syncthreads();
    }

    // Empty means no weight at all: a NaN score is skipped by the max (fmaxf) yet makes the sum NaN, and must
    // give NaN out and lse, never the empty row's 0 and −inf.
    const bool empty = row_sum == 0.0f;
    if (row < len_q) {
        const int split = key_split(len_q);
        out_t* out_row = out + split * o_s + batch * o_b + head * o_h + row * o_m;
        for (int c = lane; c < HEAD_DIM_V; c += THREADS_PER_ROW)
            assign(out_row[c], empty ? 0.0f : o_acc[r * BLOCK_DV + c] / row_sum);
        if (lane == 0)
            lse[split * lse_s + ((index_t)batch * heads_q + head) * len_q + row] =
                empty ? negative_infinity() : row_max + logf(row_sum);
    }
#endif
}

// Δ = rowsum(dO ⊙ O) − dlse for one row tile of one (batch, query head). Grid (row tiles, Hq, B).
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
    attention_backward_delta(const elem_t* __restrict__ out, const elem_t* __restrict__ dout,
                             const float* __restrict__ dlse, float* __restrict__ delta, index_t o_b, index_t o_h,
                             index_t o_m, index_t do_b, index_t do_h, index_t do_m, int heads_q, int len_q) {
    const int head = blockIdx.y, batch = blockIdx.z;
    for (int r = threadIdx.x; r < BLOCK_M; r += NUM_THREADS) {
        const int row = blockIdx.x * BLOCK_M + r;
        if (row >= len_q) continue;
        const elem_t* o_row = out + batch * o_b + head * o_h + row * o_m;
        const elem_t* do_row = dout + batch * do_b + head * do_h + row * do_m;
        float sum = 0.0f;
        for (int c = 0; c < HEAD_DIM_V; ++c) sum = fmaf(to_float(o_row[c]), to_float(do_row[c]), sum);
        const index_t index = ((index_t)batch * heads_q + head) * len_q + row;
        delta[index] = HAS_DLSE ? sum - dlse[index] : sum;
    }
}

// One row's lse (times lse_factor: log2(e) for base 2) and Δ; an empty row's lse (−inf) is taken as +inf so every P
// of it is exactly 0. Padding rows (past the length, or of a negative segment id) are empty, Δ = 0.
__device__ __forceinline__ void row_statistics(float& row_lse, float& row_delta, const float* lse, const float* delta,
                                               index_t row_base, int row, Geometry g, float lse_factor) {
    const bool real = row < g.q_len && not_segment_padding(g.q_ids, row);
    const float value = real ? lse[row_base + row] : negative_infinity();
    row_lse = value == negative_infinity() ? -negative_infinity() : value * lse_factor;
    row_delta = real ? delta[row_base + row] : 0.0f;
}

// row_statistics of the rows of a query tile.
__device__ __forceinline__ void load_row_statistics(float* lse_tile, float* delta_tile, const float* lse,
                                                    const float* delta, index_t row_base, int row_start, Geometry g,
                                                    float lse_factor = 1.0f) {
#pragma unroll  // a fixed count: no loop left inside the register dK/dV kernel's tile loop
    for (int i = 0; i < (BLOCK_M + NUM_THREADS - 1) / NUM_THREADS; ++i) {
        const int r = threadIdx.x + i * NUM_THREADS;
        if (r >= BLOCK_M) break;
        row_statistics(lse_tile[r], delta_tile[r], lse, delta, row_base, row_start + r, g, lse_factor);
    }
}

// dq for one query tile of one (batch, query head), over the key tiles it sees. Grid (query tiles, Hq, B).
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
    attention_backward_dq(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                          const elem_t* __restrict__ dout, const float* __restrict__ lse,
                          const float* __restrict__ delta, grad_t* __restrict__ dq, const float* __restrict__ bias,
                          const unsigned char* __restrict__ mask, const int* __restrict__ q_lengths,
                          const int* __restrict__ kv_lengths, const index_t* __restrict__ q_segment_ids,
                          const index_t* __restrict__ kv_segment_ids, const index_t* __restrict__ q_segment_ranges,
                          const index_t* __restrict__ kv_segment_ranges, const float* __restrict__ alibi_slopes,
                          index_t q_b, index_t q_h, index_t q_m, index_t k_b, index_t k_h, index_t k_n, index_t v_b,
                          index_t v_h, index_t v_n, index_t do_b, index_t do_h, index_t do_m, index_t dq_b,
                          index_t dq_h, index_t dq_m, index_t bias_b, index_t bias_h, index_t bias_m, index_t bias_n,
                          index_t mask_b, index_t mask_h, index_t mask_m, index_t mask_n, index_t alibi_b, int heads_q,
                          int group, int len_q, int len_k, float qk_scale, float softcap, float grad_scale, int lower,
                          int upper DROPOUT_PARAMETERS PROGRAM_PARAMETERS) {
    const int row_start = blockIdx.x * BLOCK_M, head = blockIdx.y, batch = blockIdx.z;
    const Program program = PROGRAM_ARGUMENTS;
    const Dropout dropout = DROPOUT_ARGUMENTS;
    const Geometry g = batch_geometry(q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, batch, len_q, len_k);
    const PlaneStrides strides = {mask_b, mask_h, mask_m, mask_n, bias_b, bias_h, bias_m, bias_n, alibi_b};
    const Planes planes = planes_of(mask, bias, alibi_slopes, strides, g, program, batch, head);
    const elem_t* k_head = k + batch * k_b + (head / group) * k_h;
    const elem_t* v_head = v + batch * v_b + (head / group) * v_h;
    const index_t row_base = ((index_t)batch * heads_q + head) * len_q;

#if REGISTER_DQ
    // Register-resident dQ, in the forward's layout: warp w owns query rows 16w..16w+15 of the tile; Q and dO are A
    // fragments held for the whole loop, S, P, dP, dS and the dQ accumulator live in mma.sync fragments (lane l: rows
    // g, g+8 with g = l/4, key column pair 2·(l%4) of each 8-key block), so dS is the A operand of dQ from registers.
    // K and V stream through two shared-memory stages by cp.async.
    static_assert(BLOCK_M == 16 * NUM_WARPS && BLOCK_N % 16 == 0, "16 query rows per warp, key tiles of 16");
    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM_V % 8 == 0 && !COSINE, "whole 16-byte chunks, no cosine");
    constexpr int KEY_BLOCKS = BLOCK_N / 8, D_BLOCKS = BLOCK_D / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    SharedCursor cursor = {shared_memory};
    elem_t* q_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_D);
    elem_t* do_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_DV);
    elem_t* k_stages = cursor.take<elem_t>(2 * BLOCK_N * BLOCK_D);  // stage s at k_stages + s · BLOCK_N · BLOCK_D
    elem_t* v_stages = cursor.take<elem_t>(2 * BLOCK_N * BLOCK_DV);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, lane_row = lane / 4, pair = 2 * (lane % 4);
    // The lane's ldmatrix rows (SwizzledRows; the layouts as in the dK/dV kernel): K and V as B operands of S and dP
    // (`rows`), K transposed as the B operand of dQ (`columns`).
    const SwizzledRows<BLOCK_D> k_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2), k_columns(lane % 16, lane / 16);
    const SwizzledRows<BLOCK_DV> v_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2);

    int first, end;
    key_span(row_start, g, lower, upper, first, end);
    const SegmentRange q_range = segment_range<BLOCK_M>(q_segment_ranges, batch, row_start, len_q);
    auto meeting_tile = [&](int key_start) {
        return meeting_tile_from<BLOCK_N>(key_start, end, q_range, kv_segment_ranges, batch, len_k, [&](int start) {
            return program_tile_class(program, batch, head, row_start, start) == TILE_EMPTY;
        });
    };
    auto load_keys = [&](int key_start, int stage) {
        load_tile_async<BLOCK_N, BLOCK_D>(k_stages + stage * BLOCK_N * BLOCK_D, k_head, k_n, key_start, g.kv_len,
                                          HEAD_DIM, g.kv_ids);
        load_tile_async<BLOCK_N, BLOCK_DV>(v_stages + stage * BLOCK_N * BLOCK_DV, v_head, v_n, key_start, g.kv_len,
                                           HEAD_DIM_V, g.kv_ids);
    };
    load_tile_async<BLOCK_M, BLOCK_D>(q_tile, q + batch * q_b + head * q_h, q_m, row_start, g.q_len, HEAD_DIM,
                                      g.q_ids);
    load_tile_async<BLOCK_M, BLOCK_DV>(do_tile, dout + batch * do_b + head * do_h, do_m, row_start, g.q_len,
                                       HEAD_DIM_V, g.q_ids);
    int key_start = meeting_tile(first), stage = 0;
    if (key_start < end) load_keys(key_start, stage);
    cp_async_commit();
    float row_lse[2], row_delta[2];  // base 2, for the lane's rows g and g+8
#pragma unroll
    for (int h = 0; h < 2; ++h)
        row_statistics(row_lse[h], row_delta[h], lse, delta, row_base, row_start + 16 * warp + lane_row + 8 * h, g,
                       LOG2E);
    cp_async_wait<0>();
    __syncthreads();
    unsigned q_fragments[BLOCK_D / 16][4], do_fragments[BLOCK_DV / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_D / 16; ++kk)
        ldmatrix_x4(q_fragments[kk], q_tile + swizzled<BLOCK_D>(16 * warp + lane % 16, 2 * kk + lane / 16));
#pragma unroll
    for (int kk = 0; kk < BLOCK_DV / 16; ++kk)
        ldmatrix_x4(do_fragments[kk], do_tile + swizzled<BLOCK_DV>(16 * warp + lane % 16, 2 * kk + lane / 16));
    int interior_first, interior_end;
    interior_key_tiles(row_start, g, lower, upper, first, end, interior_first, interior_end);

    // Scores in base 2, as in the forward (fold, t); lse₂ = log2(e) · lse.
    const float fold = SCORE_TERMS ? 1.0f : qk_scale * LOG2E;
    float dq_acc[D_BLOCKS][4] = {};
    // Over the key tiles the query tile sees (dS rounded to the input type, reused from registers as the A operand):
    //   S = Q Kᵀ;  P = 2^(fold · S − lse₂);  dP = dO Vᵀ ⊙ D (D = M/(1 − p) with dropout, else 1);  dS = P ⊙ (dP − Δ)
    //   dU = dS ⊙ (1 − tanh²(U/c)) if softcapped;  dQ += dU K
    // masked: a constant at each call, so the interior loop's inlined copy compiles without the masks.
    auto tile = [&](bool masked) {
        cp_async_wait<0>();
        __syncthreads();  // the key tile has landed for every thread; every warp is done with the other stage
        const int next = meeting_tile(key_start + BLOCK_N);
        const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
        if (next < end) load_keys(next, stage ^ 1);
        cp_async_commit();
        const elem_t* k_tile = k_stages + stage * BLOCK_N * BLOCK_D;
        const elem_t* v_tile = v_stages + stage * BLOCK_N * BLOCK_DV;

        float s[KEY_BLOCKS][4] = {}, dp[KEY_BLOCKS][4] = {};
#pragma unroll
        for (int kk = 0; kk < BLOCK_D / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < KEY_BLOCKS; j += 2) {  // B = Kᵀ: key rows 8j..8j+15, columns 16kk..16kk+15
                unsigned b[4];
                ldmatrix_x4(b, k_tile + k_rows.at(j, kk));
                mma_m16n8k16<elem_t>(s[j], q_fragments[kk], {b[0], b[1]});
                mma_m16n8k16<elem_t>(s[j + 1], q_fragments[kk], {b[2], b[3]});
            }
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_DV / 16; ++kk) {
#pragma unroll
            for (int j = 0; j < KEY_BLOCKS; j += 2) {  // B = Vᵀ, in the same way
                unsigned b[4];
                ldmatrix_x4(b, v_tile + v_rows.at(j, kk));
                mma_m16n8k16<elem_t>(dp[j], do_fragments[kk], {b[0], b[1]});
                mma_m16n8k16<elem_t>(dp[j + 1], do_fragments[kk], {b[2], b[3]});
            }
        }
#pragma unroll
        for (int j = 0; j < KEY_BLOCKS; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // dp becomes dU
                const int row = row_start + 16 * warp + lane_row + 8 * (i / 2), col = key_start + 8 * j + pair + i % 2;
                float ds = 0.0f;
                if (!masked || visible(row, col, g, lower, upper, planes, program_tile)) {
                    float t = s[j][i], tanh_u = 0.0f;
                    if (SCORE_TERMS) {
                        const Score sc = score(t, 1.0f, 1.0f, qk_scale, softcap, row, col, planes);
                        t = sc.s * LOG2E;
                        tanh_u = sc.tanh_u;
                    }
                    const float dp_kept = dp[j][i] * dropout_factor(dropout, batch, head, row, col);
                    ds = exp2_approx(fmaf(t, fold, -row_lse[i / 2])) * (dp_kept - row_delta[i / 2]);
                    if (HAS_SOFTCAP) ds *= 1.0f - tanh_u * tanh_u;
                }
                dp[j][i] = ds;
            }
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // keys 16kk..16kk+15: dS's A fragment is C fragments 2kk, 2kk+1
            const unsigned a[4] = {pack_pair(dp[2 * kk][0], dp[2 * kk][1]), pack_pair(dp[2 * kk][2], dp[2 * kk][3]),
                                   pack_pair(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                   pack_pair(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
            for (int jd = 0; jd < D_BLOCKS; jd += 2) {  // B = K: key rows 16kk.., columns 8jd..8jd+15, transposed
                unsigned b[4];
                ldmatrix_x4_trans(b, k_tile + k_columns.at(2 * kk, jd / 2));
                mma_m16n8k16<elem_t>(dq_acc[jd], a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(dq_acc[jd + 1], a, {b[2], b[3]});
            }
        }
        key_start = next;
        stage ^= 1;
    };
    while (key_start < interior_first) tile(true);
    while (key_start < interior_end) tile(false);
    while (key_start < end) tile(true);

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_start + 16 * warp + lane_row + 8 * h;
        if (row >= len_q) continue;
        grad_t* dq_row = dq + batch * dq_b + head * dq_h + row * dq_m;
#pragma unroll
        for (int jd = 0; jd < D_BLOCKS; ++jd)
#pragma unroll
            for (int i = 2 * h; i < 2 * h + 2; ++i)
                if (8 * jd + pair + i % 2 < HEAD_DIM) assign(dq_row[8 * jd + pair + i % 2], dq_acc[jd][i] * grad_scale);
    }
#else
    SharedCursor cursor = {shared_memory};
    elem_t* q_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_D);
    elem_t* do_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_DV);
    elem_t* k_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_D);
    elem_t* v_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_DV);
    float* s_tile = cursor.take<float>(BLOCK_M * BLOCK_N);
    float* dp_tile = cursor.take<float>(BLOCK_M * BLOCK_N);
    elem_t* ds_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_N);
    float* dq_acc = cursor.take<float>(BLOCK_M * BLOCK_D);
    float* lse_tile = cursor.take<float>(BLOCK_M);
    float* delta_tile = cursor.take<float>(BLOCK_M);
    float* q_inverse = cursor.take<float>(BLOCK_M);
    float* k_inverse = cursor.take<float>(BLOCK_N);

    load_tile<BLOCK_M, BLOCK_D>(q_tile, q + batch * q_b + head * q_h, q_m, row_start, g.q_len, HEAD_DIM, g.q_ids);
    load_tile<BLOCK_M, BLOCK_DV>(do_tile, dout + batch * do_b + head * do_h, do_m, row_start, g.q_len, HEAD_DIM_V,
                                 g.q_ids);
    load_row_statistics(lse_tile, delta_tile, lse, delta, row_base, row_start, g);
    zero<BLOCK_M * BLOCK_D>(dq_acc);
    __syncthreads();
    if (COSINE) inverse_norms<BLOCK_M, BLOCK_D>(q_inverse, q_tile);

    int first, end;
    key_span(row_start, g, lower, upper, first, end);
    const SegmentRange q_range = segment_range<BLOCK_M>(q_segment_ranges, batch, row_start, len_q);
    // P = exp(S − lse);  dP = dO Vᵀ ⊙ D;  dS = P ⊙ (dP − Δ);  dU = dS ⊙ (1 − tanh²(U/c)) if softcapped;  dq += dU K
    // (D = M/(1 − p) with dropout, else 1)
    for (int key_start = first; key_start < end; key_start += BLOCK_N) {
        // A key tile sharing no segment id with the query tile, or empty under the program, is skipped.
        if (!ranges_meet(q_range, segment_range<BLOCK_N>(kv_segment_ranges, batch, key_start, len_k))) continue;
        const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
        if (program_tile == TILE_EMPTY) continue;
        load_tile<BLOCK_N, BLOCK_D>(k_tile, k_head, k_n, key_start, g.kv_len, HEAD_DIM, g.kv_ids);
        load_tile<BLOCK_N, BLOCK_DV>(v_tile, v_head, v_n, key_start, g.kv_len, HEAD_DIM_V, g.kv_ids);
        __syncthreads();
        if (COSINE) inverse_norms<BLOCK_N, BLOCK_D>(k_inverse, k_tile);
        tile_mma<BLOCK_M, BLOCK_N, BLOCK_D, false, true, false>(s_tile, BLOCK_N, q_tile, BLOCK_D, k_tile, BLOCK_D);
        tile_mma<BLOCK_M, BLOCK_N, BLOCK_DV, false, true, false>(dp_tile, BLOCK_N, do_tile, BLOCK_DV, v_tile,
                                                                 BLOCK_DV);
        __syncthreads();
        for (int idx = threadIdx.x; idx < BLOCK_M * BLOCK_N; idx += NUM_THREADS) {
            const int r = idx / BLOCK_N, c = idx % BLOCK_N, row = row_start + r, col = key_start + c;
            float ds = 0.0f;
            if (visible(row, col, g, lower, upper, planes, program_tile)) {
                const Score sc = score(s_tile[idx], q_inverse[r], k_inverse[c], qk_scale, softcap, row, col, planes);
                const float dp = dp_tile[idx] * dropout_factor(dropout, batch, head, row, col);
                ds = expf(sc.s - lse_tile[r]) * (dp - delta_tile[r]);
                if (HAS_SOFTCAP) ds *= 1.0f - sc.tanh_u * sc.tanh_u;
                if (COSINE) ds *= k_inverse[c];  // dq̂ = scale · dU k̂ = scale · (dU / ‖k‖) k
            }
            assign(ds_tile[idx], ds);
        }
        __syncthreads();
        tile_mma<BLOCK_M, BLOCK_D, BLOCK_N, false, false, true>(dq_acc, BLOCK_D, ds_tile, BLOCK_N, k_tile, BLOCK_D);
        __syncthreads();
    }
    for (int idx = threadIdx.x; idx < BLOCK_M * HEAD_DIM; idx += NUM_THREADS) {
        const int r = idx / HEAD_DIM, c = idx % HEAD_DIM, row = row_start + r;
        if (row < len_q) assign(dq[batch * dq_b + head * dq_h + row * dq_m + c], dq_acc[r * BLOCK_D + c] * grad_scale);
    }
#endif
}

// dk, dv (and dS into the full-shape float32 dbias) for one key tile of one (batch, kv head). Grid (key tiles,
// Hkv, B). The G query heads sharing the kv head are summed here, so dk and dv need no atomics. With ATOMIC_DQ (the
// one-pass backward: no dQ kernel recomputes S and dP) each tile's dU K is also added into the float32 sum dq_sum
// (B, Hq, Lq, D) by atomicAdd, in an order that varies between runs; the caller scales and rounds it once.
#if ATOMIC_DQ
#define DQ_SUM_PARAMETERS , float *__restrict__ dq_sum, index_t dq_b, index_t dq_h, index_t dq_m
#else
#define DQ_SUM_PARAMETERS
#endif
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
    attention_backward_dkdv(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                            const elem_t* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ delta, grad_t* __restrict__ dk, grad_t* __restrict__ dv,
                            float* __restrict__ dbias, const float* __restrict__ bias,
                            const unsigned char* __restrict__ mask, const int* __restrict__ q_lengths,
                            const int* __restrict__ kv_lengths, const index_t* __restrict__ q_segment_ids,
                            const index_t* __restrict__ kv_segment_ids, const index_t* __restrict__ q_segment_ranges,
                            const index_t* __restrict__ kv_segment_ranges, const float* __restrict__ alibi_slopes,
                            index_t q_b, index_t q_h, index_t q_m, index_t k_b, index_t k_h, index_t k_n, index_t v_b,
                            index_t v_h, index_t v_n, index_t do_b, index_t do_h, index_t do_m, index_t dk_b,
                            index_t dk_h, index_t dk_n, index_t dv_b, index_t dv_h, index_t dv_n, index_t bias_b,
                            index_t bias_h, index_t bias_m, index_t bias_n, index_t mask_b, index_t mask_h,
                            index_t mask_m, index_t mask_n, index_t alibi_b, int heads_q, int group, int len_q,
                            int len_k, float qk_scale, float softcap, float grad_scale, int lower,
                            int upper DQ_SUM_PARAMETERS DROPOUT_PARAMETERS PROGRAM_PARAMETERS) {
    const int key_start = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = blockIdx.z;
    const Program program = PROGRAM_ARGUMENTS;
    const Dropout dropout = DROPOUT_ARGUMENTS;
    const Geometry g = batch_geometry(q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, batch, len_q, len_k);
    const PlaneStrides strides = {mask_b, mask_h, mask_m, mask_n, bias_b, bias_h, bias_m, bias_n, alibi_b};

#if REGISTER_DKDV
    // Register-resident dK/dV in the transposed formulation: warp w owns keys 16w..16w+15 of the key tile; Sᵀ, Pᵀ,
    // dPᵀ, dSᵀ and the dK, dV accumulators live in mma.sync fragments (lane l: key rows g, g+8 with g = l/4, query
    // column pair 2·(l%4) of each 8-query block), so Pᵀ and dSᵀ are the A operands of dV and dK straight from
    // registers. Q and dO (with their rows' lse and Δ) stream through two shared-memory stages by cp.async.
    static_assert(BLOCK_N == 16 * NUM_WARPS && BLOCK_M % 16 == 0, "16 keys per warp, query tiles of 16");
    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM_V % 8 == 0 && !COSINE, "whole 16-byte chunks, no cosine");
    constexpr int QUERY_BLOCKS = BLOCK_M / 8, D_BLOCKS = BLOCK_D / 8, DV_BLOCKS = BLOCK_DV / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    SharedCursor cursor = {shared_memory};
    elem_t* k_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_D);
    elem_t* v_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_DV);
    elem_t* q_stages = cursor.take<elem_t>(2 * BLOCK_M * BLOCK_D);  // stage s at q_stages + s · BLOCK_M · BLOCK_D
    elem_t* do_stages = cursor.take<elem_t>(2 * BLOCK_M * BLOCK_DV);
    float* lse_stages = cursor.take<float>(2 * BLOCK_M);  // base 2
    float* delta_stages = cursor.take<float>(2 * BLOCK_M);
#if ATOMIC_DQ
    elem_t* du_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_M);  // dUᵀ of the current query tile, swizzled
#endif
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, lane_row = lane / 4, pair = 2 * (lane % 4);
    // The lane's ldmatrix rows. `columns`: lane l addresses row l % 16 of a 16-row block at chunk 2c + l / 16, so
    // the four matrices are (rows 0–7, chunk 2c), (8–15, 2c), (0–7, 2c + 1), (8–15, 2c + 1): the A fragment of K and V
    // (the warp's 16 keys, from k_warp and v_warp) and, transposed, the B fragments of Q and dO for two column blocks
    // (with ATOMIC_DQ, of K too). `rows`: lane l addresses row l % 8 + 8 · (l / 16) at chunk 2c + l / 8 % 2, so the
    // matrices are (0–7, 2c), (0–7, 2c + 1), (8–15, 2c), (8–15, 2c + 1): the B fragments of Qᵀ and dOᵀ for two query
    // blocks (a B fragment's two registers must be adjacent).
    const SwizzledRows<BLOCK_D> q_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2), d_columns(lane % 16, lane / 16);
    const SwizzledRows<BLOCK_DV> do_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2), dv_columns(lane % 16, lane / 16);
    const elem_t *k_warp = k_tile + 16 * warp * BLOCK_D, *v_warp = v_tile + 16 * warp * BLOCK_DV;
#if ATOMIC_DQ
    // dU K's split between the warps: STRIP_WARPS along the strips of 16 queries, COLUMN_WARPS along the column pairs
    // (16 columns), each warp a contiguous block of STRIPS_PER_WARP × PAIRS_PER_WARP units (the last block short of
    // pairs where COLUMN_WARPS does not divide their count).
    constexpr int DQ_STRIPS = BLOCK_M / 16, COLUMN_PAIRS = D_BLOCKS / 2;
    constexpr int STRIP_WARPS = DQ_STRIPS < NUM_WARPS ? DQ_STRIPS : NUM_WARPS, COLUMN_WARPS = NUM_WARPS / STRIP_WARPS;
    constexpr int STRIPS_PER_WARP = DQ_STRIPS / STRIP_WARPS;
    constexpr int PAIRS_PER_WARP = (COLUMN_PAIRS + COLUMN_WARPS - 1) / COLUMN_WARPS;
    static_assert(NUM_WARPS % STRIP_WARPS == 0 && DQ_STRIPS % STRIP_WARPS == 0, "whole strips per warp");
    const int first_strip = warp / COLUMN_WARPS * STRIPS_PER_WARP, first_pair = warp % COLUMN_WARPS * PAIRS_PER_WARP;
    const SwizzledRows<BLOCK_M> du_rows(lane % 8 + 8 * (lane / 16), lane / 8 % 2, first_strip);
    const SwizzledRows<BLOCK_D> k_columns(lane % 16, lane / 16, first_pair);  // K transposed, the B operand
    // The lane's place in dq_sum from its query tile's first row: its first strip's row g, its first pair's column 2t
    // (an int: BLOCK_M rows of the float32 sum, whose rows are D floats).
    const int dq_lane = (16 * first_strip + lane_row) * static_cast<int>(dq_m) + 16 * first_pair + pair;
#endif

    int first, end;
    query_span(key_start, g, lower, upper, first, end);
    const SegmentRange k_range = segment_range<BLOCK_N>(kv_segment_ranges, batch, key_start, len_k);
    // The query tile of one head at or after row_start that shares a segment id with the key tile and that the
    // program does not leave empty (every tile without ids and program).
    auto meeting_tile = [&](int head, int row_start) {
        return meeting_tile_from<BLOCK_M>(row_start, end, k_range, q_segment_ranges, batch, len_q, [&](int start) {
            return program_tile_class(program, batch, head, start, key_start) == TILE_EMPTY;
        });
    };
    auto load_queries = [&](int head, int row_start, int stage) {
        load_tile_async<BLOCK_M, BLOCK_D>(q_stages + stage * BLOCK_M * BLOCK_D, q + batch * q_b + head * q_h, q_m,
                                          row_start, g.q_len, HEAD_DIM, g.q_ids);
        load_tile_async<BLOCK_M, BLOCK_DV>(do_stages + stage * BLOCK_M * BLOCK_DV, dout + batch * do_b + head * do_h,
                                           do_m, row_start, g.q_len, HEAD_DIM_V, g.q_ids);
        load_row_statistics(lse_stages + stage * BLOCK_M, delta_stages + stage * BLOCK_M, lse, delta,
                            ((index_t)batch * heads_q + head) * len_q, row_start, g, LOG2E);
    };
    const int row_first = meeting_tile(head_kv * group, first), head_end = head_kv * group + group;
    int head = head_kv * group, row_start = row_first, stage = 0;
#if HAS_MASK_PROGRAM  // the classes differ by head: the first head with a live query tile
    while (row_start >= end && ++head < head_end) row_start = meeting_tile(head, first);
#endif
    load_tile_async<BLOCK_N, BLOCK_D>(k_tile, k + batch * k_b + head_kv * k_h, k_n, key_start, g.kv_len, HEAD_DIM,
                                      g.kv_ids);
    load_tile_async<BLOCK_N, BLOCK_DV>(v_tile, v + batch * v_b + head_kv * v_h, v_n, key_start, g.kv_len,
                                       HEAD_DIM_V, g.kv_ids);
    if (row_start < end) load_queries(head, row_start, stage);
    cp_async_commit();
    if (row_start >= end) head = head_end;  // no query tile sees this key tile: dK = dV = 0

    int interior_first, interior_end;
    interior_query_tiles(key_start, g, lower, upper, first, end, interior_first, interior_end);

    // Scores in base 2, as in the forward: t = q·k with the scale folded into the exponent's FMA, or with a softcap,
    // bias or ALiBi t = log2(e) · S with fold 1; lse₂ = log2(e) · lse.
    const float fold = SCORE_TERMS ? 1.0f : qk_scale * LOG2E;
    float dk_acc[D_BLOCKS][4] = {}, dv_acc[DV_BLOCKS][4] = {};
    // Over the G query heads of this kv head and the query tiles that see this key tile (Sᵀ and dPᵀ 16 keys × BLOCK_M
    // queries per warp; Pᵀ and dSᵀ rounded to the input type, reused from registers as A operands):
    //   Sᵀ = K Qᵀ;  Pᵀ = 2^(fold · Sᵀ − lse₂);  dV += (Pᵀ ⊙ Dᵀ) dO;  dPᵀ = V dOᵀ ⊙ Dᵀ;  dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)
    //   dbias = dS;  dUᵀ = dSᵀ ⊙ (1 − tanh²(U/c)) if softcapped;  dK += dUᵀ Q  (D = M/(1 − p) with dropout, else 1)
    //   ATOMIC_DQ: dq_sum += dU K, atomically, once per block (the warps' dUᵀ gathered in shared memory)
    // masked: a constant at each call, so the interior loop's inlined copy compiles without the masks.
    auto tile = [&](bool masked) {
        cp_async_wait<0>();
        __syncthreads();  // the query tile has landed for every thread; every warp is done with the other stage
        int next_head = head, next_row = meeting_tile(head, row_start + BLOCK_M);
#if HAS_MASK_PROGRAM  // each head's first live query tile, the classes differing by head
        while (next_row >= end && ++next_head < head_end) next_row = meeting_tile(next_head, first);
#else
        if (next_row >= end) next_head += 1, next_row = row_first;
#endif
        const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
        if (next_head < head_end) load_queries(next_head, next_row, stage ^ 1);
        cp_async_commit();
        const elem_t* q_tile = q_stages + stage * BLOCK_M * BLOCK_D;
        const elem_t* do_tile = do_stages + stage * BLOCK_M * BLOCK_DV;
        const float* lse_tile = lse_stages + stage * BLOCK_M;
        const float* delta_tile = delta_stages + stage * BLOCK_M;

        float s[QUERY_BLOCKS][4] = {}, dp[QUERY_BLOCKS][4] = {};
#pragma unroll
        for (int kk = 0; kk < BLOCK_D / 16; ++kk) {  // A = K: the warp's 16 key rows, columns 16kk..16kk+15
            unsigned a[4];
            ldmatrix_x4(a, k_warp + d_columns.at(0, kk));
#pragma unroll
            for (int j = 0; j < QUERY_BLOCKS; j += 2) {  // B = Qᵀ: query rows 8j..8j+15, columns 16kk..16kk+15
                unsigned b[4];
                ldmatrix_x4(b, q_tile + q_rows.at(j, kk));
                mma_m16n8k16<elem_t>(s[j], a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(s[j + 1], a, {b[2], b[3]});
            }
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_DV / 16; ++kk) {  // A = V, B = dOᵀ, in the same way
            unsigned a[4];
            ldmatrix_x4(a, v_warp + dv_columns.at(0, kk));
#pragma unroll
            for (int j = 0; j < QUERY_BLOCKS; j += 2) {
                unsigned b[4];
                ldmatrix_x4(b, do_tile + do_rows.at(j, kk));
                mma_m16n8k16<elem_t>(dp[j], a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(dp[j + 1], a, {b[2], b[3]});
            }
        }
        const Planes planes = planes_of(mask, bias, alibi_slopes, strides, g, program, batch, head);
        const index_t row_base = ((index_t)batch * heads_q + head) * len_q;
#pragma unroll
        for (int j = 0; j < QUERY_BLOCKS; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // s becomes Pᵀ, dp becomes dUᵀ
                const int r = 8 * j + pair + i % 2, row = row_start + r;
                const int col = key_start + 16 * warp + lane_row + 8 * (i / 2);
                float p = 0.0f, ds = 0.0f;
                if (!masked || visible(row, col, g, lower, upper, planes, program_tile)) {
                    float t = s[j][i], tanh_u = 0.0f;
                    if (SCORE_TERMS) {
                        const Score sc = score(t, 1.0f, 1.0f, qk_scale, softcap, row, col, planes);
                        t = sc.s * LOG2E;
                        tanh_u = sc.tanh_u;
                    }
                    p = exp2_approx(fmaf(t, fold, -lse_tile[r]));
                    const float factor = dropout_factor(dropout, batch, head, row, col);
                    ds = p * (dp[j][i] * factor - delta_tile[r]);
                    p *= factor;
                    if (HAS_DBIAS) dbias[(row_base + row) * len_k + col] = ds;
                    if (HAS_SOFTCAP) ds *= 1.0f - tanh_u * tanh_u;
                }
                s[j][i] = p;
                dp[j][i] = ds;
            }
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {  // queries 16kk..16kk+15: the A fragments are C fragments 2kk, 2kk+1
            const unsigned p_a[4] = {pack_pair(s[2 * kk][0], s[2 * kk][1]), pack_pair(s[2 * kk][2], s[2 * kk][3]),
                                     pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                     pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const unsigned ds_a[4] = {pack_pair(dp[2 * kk][0], dp[2 * kk][1]), pack_pair(dp[2 * kk][2], dp[2 * kk][3]),
                                      pack_pair(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                      pack_pair(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
            for (int jv = 0; jv < DV_BLOCKS; jv += 2) {  // B = dO: query rows 16kk.., columns 8jv..8jv+15, transposed
                unsigned b[4];
                ldmatrix_x4_trans(b, do_tile + dv_columns.at(2 * kk, jv / 2));
                mma_m16n8k16<elem_t>(dv_acc[jv], p_a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(dv_acc[jv + 1], p_a, {b[2], b[3]});
            }
#pragma unroll
            for (int jd = 0; jd < D_BLOCKS; jd += 2) {  // B = Q, in the same way
                unsigned b[4];
                ldmatrix_x4_trans(b, q_tile + d_columns.at(2 * kk, jd / 2));
                mma_m16n8k16<elem_t>(dk_acc[jd], ds_a, {b[0], b[1]});
                mma_m16n8k16<elem_t>(dk_acc[jd + 1], ds_a, {b[2], b[3]});
            }
#if ATOMIC_DQ
            // The block's dUᵀ tile (keys × queries) gathers every warp's rows: ds_a[i] holds key g + 8(i%2), queries
            // 16kk + 8(i/2) + pair, pair + 1.
#pragma unroll
            for (int i = 0; i < 4; ++i)
                *reinterpret_cast<unsigned*>(
                    du_tile + swizzled<BLOCK_M>(16 * warp + lane_row + 8 * (i % 2), 2 * kk + i / 2) + pair) = ds_a[i];
#endif
        }
#if ATOMIC_DQ
        __syncthreads();  // the whole dUᵀ tile is stored
        // dq_sum += dU K over the block's BLOCK_N keys, in units of 16 queries (a strip) × 16 columns (a column pair),
        // each warp its block of units, each unit a compile-time step from the warp's addresses, computed once
        // (du_rows, k_columns, dq_lane). A = dU by ldmatrix .trans from dUᵀ (as Qᵀ's fragments are read for Sᵀ),
        // B = K transposed.
        float* dq_tile = dq_sum + batch * dq_b + head * dq_h + row_start * dq_m + dq_lane;
#pragma unroll
        for (int i = 0; i < STRIPS_PER_WARP; ++i) {  // unrolled: the tile loop stays innermost
#pragma unroll
            for (int c = 0; c < PAIRS_PER_WARP; ++c) {
                const int strip = first_strip + i, jd = 2 * (first_pair + c);
                if (COLUMN_PAIRS % COLUMN_WARPS != 0 && jd >= D_BLOCKS) break;
                float dq[2][4] = {};
#pragma unroll
                for (int kn = 0; kn < BLOCK_N / 16; ++kn) {
                    unsigned a[4], b[4];
                    ldmatrix_x4_trans(a, du_tile + du_rows.at(2 * kn, i));
                    ldmatrix_x4_trans(b, k_tile + k_columns.at(2 * kn, c));
                    mma_m16n8k16<elem_t>(dq[0], a, {b[0], b[1]});
                    mma_m16n8k16<elem_t>(dq[1], a, {b[2], b[3]});
                }
                const int row = row_start + 16 * strip + lane_row;
                float* dq_rows = dq_tile + 16 * i * dq_m + 16 * c;
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int h = 0; h < 2; ++h)  // rows g and g + 8, columns pair and pair + 1
                        if ((HEAD_DIM % 16 == 0 || 8 * (jd + half) < HEAD_DIM) && (!masked || row + 8 * h < g.q_len))
                            atomic_add_pair(dq_rows + 8 * h * dq_m + 8 * half, dq[half][2 * h], dq[half][2 * h + 1]);
            }
        }
#endif
        head = next_head;
        row_start = next_row;
        stage ^= 1;
    };
    while (head < head_end) {
        const int current = head;
        while (head == current && row_start < interior_first) tile(true);
        while (head == current && row_start < interior_end) tile(false);
        while (head == current) tile(true);
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = key_start + 16 * warp + lane_row + 8 * h;
        if (key >= len_k) continue;
        grad_t* dk_row = dk + batch * dk_b + head_kv * dk_h + key * dk_n;
        grad_t* dv_row = dv + batch * dv_b + head_kv * dv_h + key * dv_n;
#pragma unroll
        for (int i = 2 * h; i < 2 * h + 2; ++i) {
#pragma unroll
            for (int jd = 0; jd < D_BLOCKS; ++jd)
                if (8 * jd + pair + i % 2 < HEAD_DIM) assign(dk_row[8 * jd + pair + i % 2], dk_acc[jd][i] * grad_scale);
#pragma unroll
            for (int jv = 0; jv < DV_BLOCKS; ++jv)
                if (8 * jv + pair + i % 2 < HEAD_DIM_V) assign(dv_row[8 * jv + pair + i % 2], dv_acc[jv][i]);
        }
    }
#else
    SharedCursor cursor = {shared_memory};
    elem_t* k_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_D);
    elem_t* v_tile = cursor.take<elem_t>(BLOCK_N * BLOCK_DV);
    float* dk_acc = cursor.take<float>(BLOCK_N * BLOCK_D);
    float* dv_acc = cursor.take<float>(BLOCK_N * BLOCK_DV);
    elem_t* q_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_D);
    elem_t* do_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_DV);
    float* s_tile = cursor.take<float>(BLOCK_M * BLOCK_N);
    float* dp_tile = cursor.take<float>(BLOCK_M * BLOCK_N);
    elem_t* p_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_N);
    elem_t* ds_tile = cursor.take<elem_t>(BLOCK_M * BLOCK_N);
    float* lse_tile = cursor.take<float>(BLOCK_M);
    float* delta_tile = cursor.take<float>(BLOCK_M);
    float* q_inverse = cursor.take<float>(BLOCK_M);
    float* k_inverse = cursor.take<float>(BLOCK_N);

    load_tile<BLOCK_N, BLOCK_D>(k_tile, k + batch * k_b + head_kv * k_h, k_n, key_start, g.kv_len, HEAD_DIM, g.kv_ids);
    load_tile<BLOCK_N, BLOCK_DV>(v_tile, v + batch * v_b + head_kv * v_h, v_n, key_start, g.kv_len, HEAD_DIM_V,
                                 g.kv_ids);
    zero<BLOCK_N * BLOCK_D>(dk_acc);
    zero<BLOCK_N * BLOCK_DV>(dv_acc);
    __syncthreads();
    if (COSINE) inverse_norms<BLOCK_N, BLOCK_D>(k_inverse, k_tile);

    int first, end;
    query_span(key_start, g, lower, upper, first, end);
    const SegmentRange k_range = segment_range<BLOCK_N>(kv_segment_ranges, batch, key_start, len_k);
    // Over the G query heads of this kv head and the query tiles that see this key tile:
    //   P = exp(S − lse);  dV += (P ⊙ D)ᵀ dO;  dP = dO Vᵀ ⊙ D;  dS = P ⊙ (dP − Δ);  dbias = dS
    //   dU = dS ⊙ (1 − tanh²(U/c)) if softcapped;  dK += dUᵀ q;  ATOMIC_DQ: dq_sum += dU K, atomically
    //   (D = M/(1 − p) with dropout, else 1)
    for (int head = head_kv * group; head < head_kv * group + group; ++head) {
        const Planes planes = planes_of(mask, bias, alibi_slopes, strides, g, program, batch, head);
        const index_t row_base = ((index_t)batch * heads_q + head) * len_q;
        for (int row_start = first; row_start < end; row_start += BLOCK_M) {
            // A query tile sharing no segment id with the key tile, or empty under the program, is skipped.
            if (!ranges_meet(segment_range<BLOCK_M>(q_segment_ranges, batch, row_start, len_q), k_range)) continue;
            const int program_tile = program_tile_class(program, batch, head, row_start, key_start);
            if (program_tile == TILE_EMPTY) continue;
            load_tile<BLOCK_M, BLOCK_D>(q_tile, q + batch * q_b + head * q_h, q_m, row_start, g.q_len, HEAD_DIM,
                                        g.q_ids);
            load_tile<BLOCK_M, BLOCK_DV>(do_tile, dout + batch * do_b + head * do_h, do_m, row_start, g.q_len,
                                         HEAD_DIM_V, g.q_ids);
            load_row_statistics(lse_tile, delta_tile, lse, delta, row_base, row_start, g);
            __syncthreads();
            if (COSINE) inverse_norms<BLOCK_M, BLOCK_D>(q_inverse, q_tile);
            tile_mma<BLOCK_M, BLOCK_N, BLOCK_D, false, true, false>(s_tile, BLOCK_N, q_tile, BLOCK_D, k_tile, BLOCK_D);
            tile_mma<BLOCK_M, BLOCK_N, BLOCK_DV, false, true, false>(dp_tile, BLOCK_N, do_tile, BLOCK_DV, v_tile,
                                                                     BLOCK_DV);
            __syncthreads();
            for (int idx = threadIdx.x; idx < BLOCK_M * BLOCK_N; idx += NUM_THREADS) {
                const int r = idx / BLOCK_N, c = idx % BLOCK_N, row = row_start + r, col = key_start + c;
                float p = 0.0f, ds = 0.0f, ds_q = 0.0f;
                if (visible(row, col, g, lower, upper, planes, program_tile)) {
                    const Score sc =
                        score(s_tile[idx], q_inverse[r], k_inverse[c], qk_scale, softcap, row, col, planes);
                    p = expf(sc.s - lse_tile[r]);
                    const float factor = dropout_factor(dropout, batch, head, row, col);
                    ds = p * (dp_tile[idx] * factor - delta_tile[r]);
                    p *= factor;
                    if (HAS_DBIAS) dbias[(row_base + row) * len_k + col] = ds;
                    if (HAS_SOFTCAP) ds *= 1.0f - sc.tanh_u * sc.tanh_u;
                    ds_q = COSINE ? ds * k_inverse[c] : ds;  // dq̂ = scale · dU k̂ = scale · (dU / ‖k‖) k
                    if (COSINE) ds *= q_inverse[r];  // dk̂ = scale · dUᵀ q̂ = scale · (dU / ‖q‖)ᵀ q
                }
                assign(p_tile[idx], p);
                assign(ds_tile[idx], ds);
                if (ATOMIC_DQ) dp_tile[idx] = rounded(ds_q);  // dP is spent: it holds dU for dq_sum
            }
            __syncthreads();
            tile_mma<BLOCK_N, BLOCK_DV, BLOCK_M, true, false, true>(dv_acc, BLOCK_DV, p_tile, BLOCK_N, do_tile,
                                                                    BLOCK_DV);
            tile_mma<BLOCK_N, BLOCK_D, BLOCK_M, true, false, true>(dk_acc, BLOCK_D, ds_tile, BLOCK_N, q_tile, BLOCK_D);
#if ATOMIC_DQ
            // dq_sum += dU K, element by element (the one-pass backward where the register body does not run).
            for (int idx = threadIdx.x; idx < BLOCK_M * HEAD_DIM; idx += NUM_THREADS) {
                const int r = idx / HEAD_DIM, d = idx % HEAD_DIM, row = row_start + r;
                if (row >= g.q_len) continue;
                float sum = 0.0f;
                for (int c = 0; c < BLOCK_N; ++c)
                    sum = fmaf(dp_tile[r * BLOCK_N + c], to_float(k_tile[c * BLOCK_D + d]), sum);
                atomicAdd(dq_sum + batch * dq_b + head * dq_h + row * dq_m + d, sum);
            }
#endif
            __syncthreads();
        }
    }
    for (int idx = threadIdx.x; idx < BLOCK_N * HEAD_DIM; idx += NUM_THREADS) {
        const int c = idx / HEAD_DIM, d = idx % HEAD_DIM, key = key_start + c;
        if (key < len_k) assign(dk[batch * dk_b + head_kv * dk_h + key * dk_n + d], dk_acc[c * BLOCK_D + d] * grad_scale);
    }
    for (int idx = threadIdx.x; idx < BLOCK_N * HEAD_DIM_V; idx += NUM_THREADS) {
        const int c = idx / HEAD_DIM_V, d = idx % HEAD_DIM_V, key = key_start + c;
        if (key < len_k) assign(dv[batch * dv_b + head_kv * dv_h + key * dv_n + d], dv_acc[c * BLOCK_DV + d]);
    }
#endif
}
