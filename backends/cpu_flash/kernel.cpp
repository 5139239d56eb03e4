// cpu-flash: FlashAttention-2 on the CPU, forward and backward, for float32 operands (docs/semantics.md).
//
// Each tile is a (query rows x key columns) block: its scores come from one BLAS call, then one vectorised pass
// applies softcap, visibility (index arithmetic, only on tiles the band crosses) and the softmax, and one more BLAS
// call consumes it, while the tile is still in cache. U = q_scale q k^T, with q_scale = scale (/ softcap when
// softcapped), is the score, or the tanh argument. Visibility (section 4): with rel = j - i - offset[b],
// low <= rel <= high on each bounded side, i < q_len[b] and j < kv_len[b]; offset[b] = kv_len[b] - q_len[b] for
// bottom-right alignment, else 0. A user mask (True = may attend) and an additive bias are read per tile through
// their strides (0 on broadcast axes), never expanded: S = cap tanh U + bias, then hidden pairs -inf. Segment ids
// (section 4.5): q_ids[i] == kv_ids[j] >= 0 besides; a query block's key tiles are runs of key granules whose ids can
// meet the block's, so a key granule that cannot is never read (a packed row costs its documents' sum of L_i^2).

// The headers of what the kernel uses, not <torch/extension.h> (torch's whole C++ frontend): parsing that took most
// of the build (docs/cpu_flash.md, "Build").
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

extern "C" {
// BLAS as torch's MKL exports it (column-major).
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c, const int* ldc);
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major C(m x n) = alpha op(A) op(B) + beta C, with op(X) = X^T when trans_x: the column-major call on the
// transposes.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = m, ni = n, ki = k, ldai = lda, ldbi = ldb, ldci = ldc;
  sgemm_(trans_b ? "T" : "N", trans_a ? "T" : "N", &ni, &mi, &ki, &alpha, b, &ldbi, a, &ldai, &beta, c, &ldci);
}

// Per-thread scratch: every element is written before it is read. While attnkit.testing.poison's variable is set
// (the test suite), it starts at NaN instead of std::vector's zeros, so a read before the write shows in the results
// instead of passing on the zeros (as a kernel on uninitialised GPU memory would not).
bool poison_scratch() {
  const char* value = std::getenv("ATTNKIT_POISON_UNINITIALISED");
  return value != nullptr && value[0] == '1';
}

std::vector<float> scratch(int64_t size) {
  return std::vector<float>(size, poison_scratch() ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
}

float nan_max(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? NAN : std::max(a, b); }

// max over the lanes, NaN if any lane is NaN (at::vec::maximum propagates NaN, a bare max would drop it).
float lane_max(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

float lane_sum(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// tanh within ~2 ulp (float32, against float64 over [0, 50] and every float in [0.3, 1.2]) at ~3x the speed of
// Vec::tanh (Sleef's u10, which was a third of a softcapped forward): below atanh(1/2) an odd polynomial in x
// (coefficients fitted here for relative error), above it 1 - 2 / (e^2|x| + 1), whose subtraction cannot cancel
// there. Overflow gives e = inf and so 1; NaN stays NaN in both branches.
Vec fast_tanh(const Vec& x) {
  const Vec ax = x.abs(), x2 = x * x;
  Vec p(-0.006292885169386864f);
  p = at::vec::fmadd(p, x2, Vec(0.021085498854517937f));
  p = at::vec::fmadd(p, x2, Vec(-0.05385588854551315f));
  p = at::vec::fmadd(p, x2, Vec(0.1333262324333191f));
  p = at::vec::fmadd(p, x2, Vec(-0.33333319425582886f));
  const Vec small = at::vec::fmadd(ax * x2, p, ax);
  const Vec large = Vec(1.0f) - Vec(2.0f) / ((ax + ax).exp_u20() + Vec(1.0f));
  const Vec magnitude = Vec::blendv(large, small, ax < Vec(0.5493061443340549f));
  return magnitude | (x & Vec(-0.0f));  // the sign of x
}

struct Band {
  bool has_low, has_high;
  int64_t low, high;
  bool bottom_right;
};

struct Sizes {
  int64_t batch, heads_q, heads_kv, len_q, len_k, dim, dim_v;
  int64_t block_q, block_k;  // tile: query rows x key columns
  float q_scale;             // U = q_scale q k^T: the scale, divided by the softcap when there is one
};

struct Rows {  // one batch element's view of the band
  int64_t q_len, kv_len, offset;
};

// One (batch, head)'s plane of a 4-D mask or bias as attend hands it (broadcastable to (B, Hq, Lq, Lk)): element
// (i, j) at base[i * row + j * col], strides 0 on broadcast axes. base null: no such tensor.
template <typename T>
struct Plane {
  T* base = nullptr;
  int64_t row = 0, col = 0;
  T* at(int64_t i, int64_t j) const { return base + i * row + j * col; }
};

template <typename T>
struct Strided {  // the whole 4-D tensor; plane(b, h) picks one (batch, head)
  T* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  Plane<T> plane(int64_t b, int64_t h) const {
    if (!data) return {};
    return {data + b * stride[0] + h * stride[1], stride[2], stride[3]};
  }
};

template <typename T>
Strided<T> strided(const std::optional<at::Tensor>& x) {
  Strided<T> view;
  if (!x.has_value()) return view;
  view.data = reinterpret_cast<T*>(x->data_ptr());
  for (int d = 0; d < 4; ++d) view.stride[d] = x->size(d) == 1 ? 0 : x->stride(d);
  return view;
}

Rows rows_of(const Band& band, const int64_t* q_lens, const int64_t* kv_lens, int64_t b) {
  Rows r{q_lens[b], kv_lens[b], 0};
  if (band.bottom_right) r.offset = r.kv_len - r.q_len;
  return r;
}

// Segment ids (section 4.5) of one batch element, and their summaries per granule of positions, as
// attnkit.contract.torch.SegmentTiles makes them: (least, greatest) non-negative id (least > greatest: padding only)
// and uniform (one non-negative id throughout). ids null: the call has none.
struct IdRange {
  int64_t least = std::numeric_limits<int64_t>::max(), greatest = -1;
  bool uniform = true;
};

struct Segments {
  const int64_t *q_ids = nullptr, *kv_ids = nullptr;
  const int64_t *q_tiles = nullptr, *kv_tiles = nullptr;  // (granules, 3): least, greatest, uniform
  int64_t granule = 1;

  bool active() const { return q_ids != nullptr; }

  static IdRange tile(const int64_t* tiles, int64_t g) { return {tiles[3 * g], tiles[3 * g + 1], tiles[3 * g + 2] != 0}; }

  // Query rows [r0, r1) summarised over the granules they lie in.
  IdRange queries(int64_t r0, int64_t r1) const {
    IdRange rows;
    for (int64_t g = r0 / granule; g <= (r1 - 1) / granule; ++g) {
      const IdRange t = tile(q_tiles, g);
      rows.least = std::min(rows.least, t.least), rows.greatest = std::max(rows.greatest, t.greatest);
      rows.uniform = rows.uniform && t.uniform;
    }
    rows.uniform = rows.uniform && rows.least == rows.greatest;
    return rows;
  }

  // Whether some row of `rows` may share an id with some key of key's granule.
  bool meets(const IdRange& rows, int64_t key) const {
    const IdRange t = tile(kv_tiles, key / granule);
    return std::max(rows.least, t.least) <= std::min(rows.greatest, t.greatest);
  }

  // Whether every row of `rows` shares its one id with every key of [c0, c1): the ids hide no pair there.
  bool whole(const IdRange& rows, int64_t c0, int64_t c1) const {
    if (!rows.uniform) return false;
    for (int64_t g = c0 / granule; g <= (c1 - 1) / granule; ++g) {
      const IdRange t = tile(kv_tiles, g);
      if (!t.uniform || t.least != rows.least) return false;
    }
    return true;
  }
};

// The next key tile of a query block from c0 on, before last: [c0, c1) of at most block_k keys, not crossing a
// multiple of grid (> 0: a mask program's tile classes). With segment ids it starts at the first key granule whose
// ids meet the block's and ends before the next one that does not, so no granule the ids hide is ever read. False
// when no tile remains.
bool next_key_tile(const Segments& segments, const IdRange& rows, int64_t block_k, int64_t grid, int64_t last,
                   int64_t& c0, int64_t& c1) {
  const auto limit_of = [&](int64_t from) {
    const int64_t end = std::min(from + block_k, last);
    return grid > 0 ? std::min(end, (from / grid + 1) * grid) : end;
  };
  if (!segments.active()) {
    c1 = limit_of(c0);
    return c0 < last;
  }
  const int64_t g = segments.granule;
  while (c0 < last && !segments.meets(rows, c0)) c0 = (c0 / g + 1) * g;
  const int64_t limit = limit_of(c0);
  c1 = c0;
  while (c1 < limit && segments.meets(rows, c1)) c1 = std::min((c1 / g + 1) * g, limit);
  return c0 < last;
}

// Keys [first, last) some row of [r0, r1) may see.
void key_range(const Band& band, const Rows& rows, int64_t r0, int64_t r1, int64_t* first, int64_t* last) {
  *first = band.has_low ? std::max<int64_t>(0, r0 + rows.offset + band.low) : 0;
  *last = band.has_high ? std::min<int64_t>(rows.kv_len, r1 - 1 + rows.offset + band.high + 1) : rows.kv_len;
}

// Whether some pair of the tile is hidden by the band (lengths are handled by the ranges themselves).
bool needs_mask(const Band& band, const Rows& rows, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  return (band.has_low && c0 - (r1 - 1) - rows.offset < band.low) ||
         (band.has_high && (c1 - 1) - r0 - rows.offset > band.high);
}

// ---------------------------------------------------------------------------------------------------------------
// Mask programs (section 17): a traced mask_mod(b, h, q_idx, kv_idx) -> bool, run by one interpreter compiled once,
// so a new program, sequence length or captured value never rebuilds the kernel (docs/cpu_flash.md, "Mask
// programs"). backend.py lists the program's nodes in dependency order, one register each, with the level a node
// varies at: kFixed (b, h, constants: once per tile), kRow (q_idx without kv_idx: one scalar per row), kColumn
// (kv_idx without q_idx: lanes once per tile), kPair (both: lanes per row). Lanes are a tile row's int32 values, one
// per key; a scalar node that a lane node reads is broadcast into its lanes when computed (`spread`), so every lane
// operation reads lanes only and its loop vectorises. Integers are int32 (bind refuses programs leaving that range);
// arithmetic wraps rather than trapping, and a zero divisor (the program's error) gives 0.
enum ProgramOp : int32_t {
  kIndexB, kIndexH, kIndexQ, kIndexKv, kConst, kRead,
  kAdd, kSub, kMul, kFloorDiv, kMod, kTruncDiv, kTruncRem, kMin, kMax,
  kEq, kNe, kLt, kLe, kGt, kGe, kAnd, kOr, kXor,
  kNeg, kAbs, kNot, kToBool, kToInt, kWhere,
};
enum ProgramLevel : int32_t { kFixed = 0, kRow = 1, kColumn = 2, kPair = 3 };
// An instruction's columns (backend.py's _instructions writes them).
enum ProgramField : int32_t { kOp, kLevel, kValue, kFirstOperand, kOperandCount, kSpread, kFields };

int32_t wrap(int64_t x) { return static_cast<int32_t>(static_cast<uint32_t>(x)); }

// Python's // and % (rounding toward -inf) and C's / and % (toward zero), total: 0 for a zero divisor, and
// INT32_MIN / -1 wraps.
int32_t floor_div(int32_t a, int32_t b) {
  if (b == 0) return 0;
  const int64_t q = static_cast<int64_t>(a) / b;
  return wrap(q - ((static_cast<int64_t>(a) % b != 0) && ((a < 0) != (b < 0))));
}
int32_t floor_mod(int32_t a, int32_t b) {
  if (b == 0) return 0;
  const int64_t r = static_cast<int64_t>(a) % b;
  return wrap(r != 0 && ((r < 0) != (b < 0)) ? r + b : r);
}
int32_t trunc_div(int32_t a, int32_t b) { return b == 0 ? 0 : wrap(static_cast<int64_t>(a) / b); }
int32_t trunc_rem(int32_t a, int32_t b) { return b == 0 ? 0 : wrap(static_cast<int64_t>(a) % b); }

// fn(f) with f the scalar function of a two-operand op; false if `op` has two operands of another kind (none here).
template <typename Fn>
bool with_binary(int32_t op, Fn fn) {
  switch (op) {
    case kAdd: fn([](int32_t a, int32_t b) { return wrap(int64_t{a} + b); }); return true;
    case kSub: fn([](int32_t a, int32_t b) { return wrap(int64_t{a} - b); }); return true;
    case kMul: fn([](int32_t a, int32_t b) { return wrap(int64_t{a} * b); }); return true;
    case kFloorDiv: fn([](int32_t a, int32_t b) { return floor_div(a, b); }); return true;
    case kMod: fn([](int32_t a, int32_t b) { return floor_mod(a, b); }); return true;
    case kTruncDiv: fn([](int32_t a, int32_t b) { return trunc_div(a, b); }); return true;
    case kTruncRem: fn([](int32_t a, int32_t b) { return trunc_rem(a, b); }); return true;
    case kMin: fn([](int32_t a, int32_t b) { return std::min(a, b); }); return true;
    case kMax: fn([](int32_t a, int32_t b) { return std::max(a, b); }); return true;
    case kEq: fn([](int32_t a, int32_t b) { return int32_t{a == b}; }); return true;
    case kNe: fn([](int32_t a, int32_t b) { return int32_t{a != b}; }); return true;
    case kLt: fn([](int32_t a, int32_t b) { return int32_t{a < b}; }); return true;
    case kLe: fn([](int32_t a, int32_t b) { return int32_t{a <= b}; }); return true;
    case kGt: fn([](int32_t a, int32_t b) { return int32_t{a > b}; }); return true;
    case kGe: fn([](int32_t a, int32_t b) { return int32_t{a >= b}; }); return true;
    case kAnd: fn([](int32_t a, int32_t b) { return a & b; }); return true;  // booleans are 0/1
    case kOr: fn([](int32_t a, int32_t b) { return a | b; }); return true;
    case kXor: fn([](int32_t a, int32_t b) { return a ^ b; }); return true;
    default: return false;
  }
}

template <typename Fn>
bool with_unary(int32_t op, Fn fn) {
  switch (op) {
    case kNeg: fn([](int32_t a) { return wrap(-int64_t{a}); }); return true;
    case kAbs: fn([](int32_t a) { return wrap(a < 0 ? -int64_t{a} : int64_t{a}); }); return true;
    case kNot: fn([](int32_t a) { return a ^ 1; }); return true;  // of a boolean (the tracer refuses others)
    case kToBool: fn([](int32_t a) { return int32_t{a != 0}; }); return true;
    case kToInt: fn([](int32_t a) { return a; }); return true;
    default: return false;
  }
}

// A captured tensor as the kernel reads it: int32, contiguous, with its shape for the clamp.
struct Captured {
  const int32_t* data = nullptr;
  int32_t sizes[8] = {}, strides[8] = {};
  int32_t dims = 0;
};

struct Program {
  const int32_t* code = nullptr;  // (nodes, kFields)
  const int32_t* operands = nullptr;  // the nodes' operands, node indices, kFirstOperand/kOperandCount into it
  int64_t count = 0;  // nodes; the last is the root
  std::vector<Captured> captured;
  bool active() const { return code != nullptr; }
  const int32_t* node(int64_t n) const { return code + n * kFields; }
};

// One thread's registers for a program over tiles of up to block_k keys. begin_tile(b, h, c0, cols) computes what
// the tile's rows share; row(i) returns the visibility of (i, c0 .. c0 + cols) as 0/1 lanes.
class ProgramRows {
 public:
  ProgramRows(const Program* program, int64_t block_k)
      : program_(program), block_k_(block_k),
        scalars_(program ? program->count : 0), lanes_(program ? program->count * block_k : 0) {}

  void begin_tile(int64_t b, int64_t h, int64_t c0, int64_t cols) {
    b_ = static_cast<int32_t>(b), h_ = static_cast<int32_t>(h), c0_ = static_cast<int32_t>(c0), cols_ = cols;
    run_level(kFixed);
    run_level(kColumn);
  }

  const int32_t* row(int64_t i) {
    q_ = static_cast<int32_t>(i);
    run_level(kRow);
    run_level(kPair);
    return lanes(program_->count - 1);
  }

 private:
  int32_t* lanes(int64_t n) { return lanes_.data() + n * block_k_; }
  const int32_t* operand(const int32_t* node, int32_t k) const { return program_->operands + node[kFirstOperand] + k; }

  void run_level(int32_t level) {
    for (int64_t n = 0; n < program_->count; ++n) {
      const int32_t* node = program_->node(n);
      if (node[kLevel] != level) continue;
      if (level == kFixed || level == kRow) {
        scalars_[n] = scalar(node);
        if (node[kSpread]) std::fill(lanes(n), lanes(n) + cols_, scalars_[n]);
      } else {
        vector(node, lanes(n));
      }
    }
  }

  int32_t scalar(const int32_t* node) const {
    const int32_t op = node[kOp];
    const auto arg = [&](int32_t k) { return scalars_[*operand(node, k)]; };
    switch (op) {
      case kIndexB: return b_;
      case kIndexH: return h_;
      case kIndexQ: return q_;
      case kConst: return node[kValue];
      case kWhere: return arg(0) ? arg(1) : arg(2);
      case kRead: {
        const Captured& t = program_->captured[node[kValue]];
        int64_t at = 0;
        for (int32_t d = 0; d < t.dims; ++d) at += int64_t{std::clamp(arg(d), 0, t.sizes[d] - 1)} * t.strides[d];
        return t.data[at];
      }
      default: break;
    }
    int32_t result = 0;
    if (!with_binary(op, [&](auto f) { result = f(arg(0), arg(1)); })) with_unary(op, [&](auto f) { result = f(arg(0)); });
    return result;
  }

  void vector(const int32_t* node, int32_t* out) {
    const int32_t op = node[kOp];
    const int64_t cols = cols_;
    const auto arg = [&](int32_t k) -> const int32_t* { return lanes(*operand(node, k)); };
    switch (op) {
      case kIndexKv:
        for (int64_t c = 0; c < cols; ++c) out[c] = c0_ + static_cast<int32_t>(c);
        return;
      case kWhere: {
        const int32_t *cond = arg(0), *a = arg(1), *b = arg(2);
        for (int64_t c = 0; c < cols; ++c) out[c] = cond[c] ? a[c] : b[c];
        return;
      }
      case kRead: {  // flat offsets first, then the gather
        const Captured& t = program_->captured[node[kValue]];
        std::fill(out, out + cols, 0);
        for (int32_t d = 0; d < t.dims; ++d) {
          const int32_t* index = arg(d);
          const int32_t high = t.sizes[d] - 1, stride = t.strides[d];
          for (int64_t c = 0; c < cols; ++c) out[c] += std::clamp(index[c], 0, high) * stride;
        }
        for (int64_t c = 0; c < cols; ++c) out[c] = t.data[out[c]];
        return;
      }
      default: break;
    }
    if (with_binary(op, [&](auto f) {
          const int32_t *a = arg(0), *b = arg(1);
          for (int64_t c = 0; c < cols; ++c) out[c] = f(a[c], b[c]);
        }))
      return;
    with_unary(op, [&](auto f) {
      const int32_t* a = arg(0);
      for (int64_t c = 0; c < cols; ++c) out[c] = f(a[c]);
    });
  }

  const Program* program_;
  int64_t block_k_;
  std::vector<int32_t> scalars_, lanes_;
  int32_t b_ = 0, h_ = 0, q_ = 0, c0_ = 0;
  int64_t cols_ = 0;
};

// A program's tile classes (attnkit.contract.programs.tile_classes: EMPTY 0, PARTIAL 1, FULL 2) for one (batch,
// query head), on the grid of the pass's own tiles; no data: no program, every tile FULL.
constexpr uint8_t kEmptyTile = 0, kPartialTile = 1, kFullTile = 2;

struct TileClasses {
  const uint8_t* data = nullptr;  // (B|1, Hq|1, tiles_q, tiles_k)
  int64_t batch = 1, heads = 1, tiles_q = 0, tiles_k = 0, block_q = 1, block_k = 1;

  // The class of the tile holding query r0 and key c0 of batch element b, query head h.
  uint8_t of(int64_t b, int64_t h, int64_t r0, int64_t c0) const {
    if (!data) return kFullTile;
    const int64_t plane = (batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : h);
    return data[(plane * tiles_q + r0 / block_q) * tiles_k + c0 / block_k];
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Dropout (section 18): element (b, h, i, j) of the call (h its query head, i and j rows of q and k as given, each
// offset by the call's head_start, query_start and key_start) is kept iff word j & 3 of Philox4x32-10 with counter
// (j >> 2, i, h, b) and key (seed_low, seed_high) is at least `threshold`. One round of Philox4x32 (Random123):
//   (hi0, lo0) = mulhilo(0xD2511F53, c0);  (hi1, lo1) = mulhilo(0xCD9E8D57, c2)
//   c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);  then the key grows by (0x9E3779B9, 0xBB67AE85)
// It is written once (philox_rounds) over PhiloxLanes: one counter per 64-bit lane, its 32-bit word in the lane's low
// half; the high half is never read (the widening product takes the low halves), so a round is two widening
// products, two moves of their high halves down and two three-way XORs per vector, with no masking.
constexpr uint32_t kPhiloxMultiplier0 = 0xD2511F53u, kPhiloxMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Besides the round's operations, each PhiloxLanes writes a block's outputs key by key (four words per counter, word w
// of counter n at 4 n + w): as words (store), or applied (keep: out = in · (`value` where the word is at least the
// threshold, else 0), a multiply, so that NaN stays NaN), compared while they are in registers.
#if defined(__AVX512F__)
struct PhiloxLanes {
  using V = __m512i;
  static constexpr int kCount = 8;
  static V broadcast(uint32_t x) { return _mm512_set1_epi64(x); }
  static V counters(uint32_t first) {
    return _mm512_add_epi64(broadcast(first), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V product(V a, uint32_t m) { return _mm512_mul_epu32(a, broadcast(m)); }
  static V high(V product) { return _mm512_shuffle_epi32(product, _MM_PERM_DDBB); }
  static V xor3(V a, V b, V c) { return _mm512_ternarylogic_epi64(a, b, c, 0x96); }
  // Lanes 0-3 and 4-7's 16 words each, key by key: (w0, w1) and (w2, w3) paired in 64-bit lanes, then interleaved.
  static void words(V w0, V w1, V w2, V w3, V (&halves)[2]) {
    const V w01 = _mm512_mask_blend_epi32(0xAAAA, w0, _mm512_slli_epi64(w1, 32));
    const V w23 = _mm512_mask_blend_epi32(0xAAAA, w2, _mm512_slli_epi64(w3, 32));
    halves[0] = _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), w23);
    halves[1] = _mm512_permutex2var_epi64(w01, _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15), w23);
  }
  static void store(V w0, V w1, V w2, V w3, uint32_t* out) {
    V halves[2];
    words(w0, w1, w2, w3, halves);
    _mm512_storeu_si512(out, halves[0]), _mm512_storeu_si512(out + 16, halves[1]);
  }
  static void keep(V w0, V w1, V w2, V w3, uint32_t threshold, float value, const float* in, float* out) {
    V halves[2];
    words(w0, w1, w2, w3, halves);
    for (int half = 0; half < 2; ++half) {
      const __mmask16 kept = _mm512_cmpge_epu32_mask(halves[half], _mm512_set1_epi32(static_cast<int>(threshold)));
      const __m512 factor = _mm512_maskz_mov_ps(kept, _mm512_set1_ps(value));
      _mm512_storeu_ps(out + 16 * half, _mm512_mul_ps(_mm512_loadu_ps(in + 16 * half), factor));
    }
  }
};
#elif defined(__AVX2__)
struct PhiloxLanes {
  using V = __m256i;
  static constexpr int kCount = 4;
  static V broadcast(uint32_t x) { return _mm256_set1_epi64x(x); }
  static V counters(uint32_t first) { return _mm256_add_epi64(broadcast(first), _mm256_setr_epi64x(0, 1, 2, 3)); }
  static V product(V a, uint32_t m) { return _mm256_mul_epu32(a, broadcast(m)); }
  static V high(V product) { return _mm256_shuffle_epi32(product, 0xF5); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static void words(V w0, V w1, V w2, V w3, V (&halves)[2]) {
    const V w01 = _mm256_blend_epi32(w0, _mm256_slli_epi64(w1, 32), 0xAA);
    const V w23 = _mm256_blend_epi32(w2, _mm256_slli_epi64(w3, 32), 0xAA);
    const V even = _mm256_unpacklo_epi64(w01, w23), odd = _mm256_unpackhi_epi64(w01, w23);  // lanes 0, 2 | 1, 3
    halves[0] = _mm256_permute2x128_si256(even, odd, 0x20), halves[1] = _mm256_permute2x128_si256(even, odd, 0x31);
  }
  static void store(V w0, V w1, V w2, V w3, uint32_t* out) {
    V halves[2];
    words(w0, w1, w2, w3, halves);
    _mm256_storeu_si256(reinterpret_cast<V*>(out), halves[0]);
    _mm256_storeu_si256(reinterpret_cast<V*>(out + 8), halves[1]);
  }
  static void keep(V w0, V w1, V w2, V w3, uint32_t threshold, float value, const float* in, float* out) {
    V halves[2];
    words(w0, w1, w2, w3, halves);
    for (int half = 0; half < 2; ++half) {  // unsigned x >= t as max(x, t) == x
      const V x = halves[half], kept = _mm256_cmpeq_epi32(_mm256_max_epu32(x, _mm256_set1_epi32(threshold)), x);
      const __m256 factor = _mm256_and_ps(_mm256_castsi256_ps(kept), _mm256_set1_ps(value));
      _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(_mm256_loadu_ps(in + 8 * half), factor));
    }
  }
};
#else
struct PhiloxLanes {
  using V = uint64_t;
  static constexpr int kCount = 1;
  static V broadcast(uint32_t x) { return x; }
  static V counters(uint32_t first) { return first; }
  static V product(V a, uint32_t m) { return (a & 0xFFFFFFFFu) * m; }
  static V high(V product) { return product >> 32; }
  static V xor3(V a, V b, V c) { return a ^ b ^ c; }
  static void store(V w0, V w1, V w2, V w3, uint32_t* out) {
    out[0] = static_cast<uint32_t>(w0), out[1] = static_cast<uint32_t>(w1);
    out[2] = static_cast<uint32_t>(w2), out[3] = static_cast<uint32_t>(w3);
  }
  static void keep(V w0, V w1, V w2, V w3, uint32_t threshold, float value, const float* in, float* out) {
    const V words[4] = {w0, w1, w2, w3};
    for (int w = 0; w < 4; ++w) out[w] = in[w] * (static_cast<uint32_t>(words[w]) >= threshold ? value : 0.0f);
  }
};
#endif

// Philox4x32-10 on n vectors of counters c[word][vector] in place (n independent chains keep the multiplier busy).
template <int n>
void philox_rounds(PhiloxLanes::V (&c)[4][n], uint32_t k0, uint32_t k1) {
  using L = PhiloxLanes;
  for (int round = 0; round < kPhiloxRounds; ++round) {
    if (round) k0 += kPhiloxWeyl0, k1 += kPhiloxWeyl1;
    const L::V key0 = L::broadcast(k0), key1 = L::broadcast(k1);
    for (int v = 0; v < n; ++v) {
      const L::V product0 = L::product(c[0][v], kPhiloxMultiplier0), product1 = L::product(c[2][v], kPhiloxMultiplier1);
      c[0][v] = L::xor3(L::high(product1), c[1][v], key0);
      c[2][v] = L::xor3(L::high(product0), c[3][v], key1);
      c[1][v] = product1, c[3][v] = product0;
    }
  }
}

constexpr int kPhiloxVectors = 4;  // independent chains per block: a round's latency over its throughput, rounded up
constexpr int64_t kPhiloxCounters = kPhiloxVectors * PhiloxLanes::kCount;  // counters per block
constexpr int64_t kVectorKeys = 4 * PhiloxLanes::kCount;  // keys per vector of counters

// Philox4x32-10 of n vectors of consecutive counters (first + m, row, head, batch) into c.
template <int n>
void philox_block(uint32_t first, uint32_t row, uint32_t head, uint32_t batch, uint32_t k0, uint32_t k1,
                  PhiloxLanes::V (&c)[4][n]) {
  using L = PhiloxLanes;
  for (int v = 0; v < n; ++v)
    c[0][v] = L::counters(first + v * L::kCount), c[1][v] = L::broadcast(row), c[2][v] = L::broadcast(head),
    c[3][v] = L::broadcast(batch);
  philox_rounds(c, k0, k1);
}

struct Dropout {
  bool active = false;
  uint32_t seed_low = 0, seed_high = 0, threshold = 0;
  float scale = 1.0f;  // 1 / (1 - p), rounded to float32
  int64_t head_start = 0, query_start = 0, key_start = 0;

  // The keep step, which every pass calls: out[c] = in[c] · (`value` where key c0 + c of row (b, h, i), the pass's
  // local query head and query, is kept, else 0) for c in [from, to), the columns the row can see (nothing is
  // generated for hidden ones); in and out may be one row.
  void keep(int64_t b, int64_t h, int64_t i, int64_t c0, int64_t from, int64_t to, float value, const float* in,
            float* out) const {
    const int64_t origin = key_start + c0, first = origin + from, last = origin + to;  // the keys j of section 18
    const uint32_t row = static_cast<uint32_t>(query_start + i), head = static_cast<uint32_t>(head_start + h);
    const Range keys{first, last, origin, row, head, static_cast<uint32_t>(b)};
    for (int64_t counter = first >> 2; 4 * counter < last; counter += kPhiloxCounters) {
      switch (std::min<int64_t>(kPhiloxVectors, (last - 4 * counter + kVectorKeys - 1) / kVectorKeys)) {
        case 1: keep_block<1>(counter, keys, value, in, out); break;  // a row's last keys: the vectors they need
        case 2: keep_block<2>(counter, keys, value, in, out); break;
        case 3: keep_block<3>(counter, keys, value, in, out); break;
        default: keep_block<kPhiloxVectors>(counter, keys, value, in, out);
      }
    }
  }

 private:
  struct Range {  // keys [first, last) of one row, key j at column j - origin of in and out
    int64_t first, last, origin;
    uint32_t row, head, batch;
  };

  // The block of n vectors of counters from `counter`, applied to its keys in the range: a vector inside it where
  // its keys lie, one at an end of it through a vector's worth of factors.
  template <int n>
  void keep_block(int64_t counter, const Range& keys, float value, const float* in, float* out) const {
    using L = PhiloxLanes;
    static const std::vector<float> ones(kVectorKeys, 1.0f);
    L::V c[4][n];
    philox_block(static_cast<uint32_t>(counter), keys.row, keys.head, keys.batch, seed_low, seed_high, c);
    for (int v = 0; v < n; ++v) {
      const int64_t base = 4 * counter + v * kVectorKeys;
      const int64_t start = std::max(keys.first, base), stop = std::min(keys.last, base + kVectorKeys);
      if (start == base && stop == base + kVectorKeys) {
        L::keep(c[0][v], c[1][v], c[2][v], c[3][v], threshold, value, in + (base - keys.origin),
                out + (base - keys.origin));
      } else if (start < stop) {
        float factors[kVectorKeys];
        L::keep(c[0][v], c[1][v], c[2][v], c[3][v], threshold, value, ones.data(), factors);
        for (int64_t j = start; j < stop; ++j) out[j - keys.origin] = in[j - keys.origin] * factors[j - base];
      }
    }
  }
};

// The caller's mask and bias for one (batch, head), and its ALiBi slope (0: none, §16).
// With a mask program: its registers (null on tiles it need not be evaluated on), and its tile classes.
struct UserTerms {
  Plane<const uint8_t> mask;
  Plane<const float> bias;
  float slope = 0.0f;
  ProgramRows* program = nullptr;
  const TileClasses* classes = nullptr;
  int64_t b = 0, h = 0;  // the batch element and query head, which the program and dropout read
  const Dropout* dropout = nullptr;  // null without dropout

  uint8_t tile_class(int64_t r0, int64_t c0) const { return classes ? classes->of(b, h, r0, c0) : kFullTile; }
  // The terms of a tile of class `tile`: the program is evaluated on PARTIAL tiles only.
  UserTerms on_tile(uint8_t tile) const {
    UserTerms terms = *this;
    if (tile != kPartialTile) terms.program = nullptr;
    return terms;
  }
  // Key tiles end on the classes' grid, so that each lies in one classified tile.
  int64_t grid(int64_t block_k) const { return classes ? block_k : 0; }
};

// ALiBi's slope of (batch b, query head h) from the (B, Hq) float32 slopes, 0 without them.
float slope_of(const float* slopes, int64_t heads_q, int64_t b, int64_t h) {
  return slopes ? slopes[b * heads_q + h] : 0.0f;
}

// One tile's segment ids (rows from r0, keys from c0); null where the ids hide no pair of the tile.
struct TileIds {
  const int64_t *rows = nullptr, *keys = nullptr;
};

TileIds tile_ids(const Segments& segments, const IdRange& rows, int64_t r0, int64_t c0, int64_t c1) {
  if (!segments.active() || segments.whole(rows, c0, c1)) return {};
  return {segments.q_ids + r0, segments.kv_ids + c0};
}

// The columns [from, to) of tile row i (keys c0 .. c0 + cols) inside the band: all of them where the tile is not
// masked (the band does not cross it).
std::pair<int64_t, int64_t> band_columns(const Band& band, const Rows& geometry, bool masked, int64_t i, int64_t c0,
                                         int64_t cols) {
  if (!masked) return {0, cols};
  const int64_t from = band.has_low ? std::clamp<int64_t>(i + geometry.offset + band.low - c0, 0, cols) : 0;
  const int64_t to = band.has_high ? std::clamp<int64_t>(i + geometry.offset + band.high + 1 - c0, 0, cols) : cols;
  return {from, std::max(from, to)};
}

// U -> S in place for one tile (rows x cols, ld cols): S = cap tanh U when softcapped (tanh kept in `tanh_out` when
// given), + bias, - slope |i + offset - j| (ALiBi), hidden pairs -inf (the band's when masked, then the user mask's,
// the segment ids' and the mask program's).
void scores(float* s, float* tanh_out, int64_t rows, int64_t cols, float softcap, bool masked, const Band& band,
            const Rows& geometry, int64_t r0, int64_t c0, const UserTerms& user, const TileIds& ids) {
  const int64_t step = Vec::size();
  if (user.program) user.program->begin_tile(user.b, user.h, c0, cols);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * cols;
    if (softcap > 0) {
      float* t = tanh_out ? tanh_out + r * cols : nullptr;
      int64_t c = 0;
      for (; c + step <= cols; c += step) {
        Vec th = fast_tanh(Vec::loadu(row + c));
        if (t) th.store(t + c);
        (th * Vec(softcap)).store(row + c);
      }
      for (; c < cols; ++c) {
        float th = std::tanh(row[c]);
        if (t) t[c] = th;
        row[c] = softcap * th;
      }
    }
    if (user.bias.base) {
      const float* bias = user.bias.at(r0 + r, c0);
      int64_t c = 0;
      if (user.bias.col == 1)
        for (; c + step <= cols; c += step) (Vec::loadu(row + c) + Vec::loadu(bias + c)).store(row + c);
      for (; c < cols; ++c) row[c] += bias[c * user.bias.col];
    }
    if (user.slope != 0.0f) {  // positions below 2^24 are exact in float32
      const float aligned = static_cast<float>(r0 + r + geometry.offset - c0);  // i + offset - j at j = c0
      const Vec slope(user.slope), lanes = Vec::arange(0.0f, 1.0f);
      int64_t c = 0;
      for (; c + step <= cols; c += step)
        (Vec::loadu(row + c) - slope * (Vec(aligned - static_cast<float>(c)) - lanes).abs()).store(row + c);
      for (; c < cols; ++c) row[c] -= user.slope * std::abs(aligned - static_cast<float>(c));
    }
    if (masked) {  // row i sees the key interval i + offset + [low, high]: fill what lies outside it
      const auto [from, to] = band_columns(band, geometry, masked, r0 + r, c0, cols);
      std::fill(row, row + from, kNegInf);
      std::fill(row + to, row + cols, kNegInf);
    }
    if (user.mask.base) {
      const uint8_t* visible = user.mask.at(r0 + r, c0);
      for (int64_t c = 0; c < cols; ++c)
        if (!visible[c * user.mask.col]) row[c] = kNegInf;
    }
    if (ids.rows) {  // a negative query id equals no key's id it may see: its whole row is hidden
      const int64_t id = ids.rows[r];
      for (int64_t c = 0; c < cols; ++c)
        if (id < 0 || ids.keys[c] != id) row[c] = kNegInf;
    }
    if (user.program) {
      const int32_t* visible = user.program->row(r0 + r);
      for (int64_t c = 0; c < cols; ++c) row[c] = visible[c] ? row[c] : kNegInf;
    }
  }
}

// The online softmax's state for `rows` rows: m = -inf, l = 0, acc = 0.
void start_rows(int64_t rows, int64_t dim_v, float* row_max, float* row_sum, float* acc) {
  std::fill(acc, acc + rows * dim_v, 0.0f);
  std::fill(row_max, row_max + rows, kNegInf);
  std::fill(row_sum, row_sum + rows, 0.0f);
}

// One tile's step of the online softmax (the equations over fwd_block): S (rows x cols, ld cols) becomes P in place,
// m and l move on and acc (rows x dim_v) is rescaled by alpha; adding P V is the caller's.
void softmax_step(float* s, int64_t rows, int64_t cols, int64_t dim_v, float* row_max, float* row_sum, float* acc) {
  const int64_t step = Vec::size();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * cols;
    Vec vmax(kNegInf);
    int64_t c = 0;
    for (; c + step <= cols; c += step) vmax = at::vec::maximum(vmax, Vec::loadu(row + c));
    float tile_max = lane_max(vmax);
    for (; c < cols; ++c) tile_max = nan_max(tile_max, row[c]);
    const float new_max = nan_max(row_max[r], tile_max);
    const float shift = new_max == kNegInf ? 0.0f : new_max;
    const float alpha = std::exp(row_max[r] - shift);
    Vec vsum(0.0f), vshift(shift);
    for (c = 0; c + step <= cols; c += step) {
      Vec p = (Vec::loadu(row + c) - vshift).exp_u20();
      p.store(row + c);
      vsum = vsum + p;
    }
    float total = lane_sum(vsum);
    for (; c < cols; ++c) total += (row[c] = std::exp(row[c] - shift));
    row_sum[r] = row_sum[r] * alpha + total;
    row_max[r] = new_max;
    float* acc_row = acc + r * dim_v;
    if (alpha != 1.0f)
      for (int64_t d = 0; d < dim_v; ++d) acc_row[d] *= alpha;
  }
}

// out = acc / l · scale (dropout's 1 / (1 - p), else 1) and lse = m + log l for `rows` rows; a row that saw no key
// (l = 0) gets 0 and -inf.
void finish_rows(float* out, float* lse, int64_t rows, int64_t dim_v, const float* row_max, const float* row_sum,
                 const float* acc, float scale = 1.0f) {
  for (int64_t r = 0; r < rows; ++r) {
    const bool empty = row_sum[r] == 0.0f;  // NaN is not empty
    const float inverse = empty ? 0.0f : scale / row_sum[r];
    for (int64_t d = 0; d < dim_v; ++d) out[r * dim_v + d] = empty ? 0.0f : acc[r * dim_v + d] * inverse;
    lse[r] = empty ? kNegInf : row_max[r] + std::log(row_sum[r]);
  }
}

// Dropout's step on a forward tile: P <- P ⊙ M (M the keep-mask, section 18) on the columns each row can see (P is
// 0 on the others); the scale 1 / (1 - p) is applied to out once, at the end.
void drop_probabilities(float* p, int64_t rows, int64_t cols, bool masked, const Band& band, const Rows& geometry,
                        int64_t r0, int64_t c0, const UserTerms& user) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto [from, to] = band_columns(band, geometry, masked, r0 + r, c0, cols);
    user.dropout->keep(user.b, user.h, r0 + r, c0, from, to, 1.0f, p + r * cols, p + r * cols);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward. Per query block, over its key tiles (online softmax; M dropout's keep-mask, all ones without):
//   m' = max(m, rowmax S);  alpha = exp(m - m');  P = exp(S - m');  l' = alpha l + rowsum P
//   acc' = alpha acc + (P ⊙ M) V
// then out = acc / l · 1 / (1 - p) and lse = m + log l (the scores' lse: dropout leaves it). A row that has seen no
// key keeps m = -inf: its shift is taken as 0 so that P and alpha are exp(-inf) = 0, never NaN. l = 0 at the end: no
// visible key, out 0 and lse -inf. NaN stays NaN.
void fwd_block(const float* q, const float* k, const float* v, float* out, float* lse, const Sizes& n, const Band& band,
               const Rows& geometry, const UserTerms& user, const Segments& segments, float softcap, int64_t r0,
               int64_t r1, std::vector<float>& s, std::vector<float>& acc, std::vector<float>& row_max,
               std::vector<float>& row_sum) {
  const int64_t rows = r1 - r0;
  start_rows(rows, n.dim_v, row_max.data(), row_sum.data(), acc.data());
  int64_t first, last, c1;
  key_range(band, geometry, r0, r1, &first, &last);
  const IdRange ids = segments.active() ? segments.queries(r0, r1) : IdRange{};
  for (int64_t c0 = first; next_key_tile(segments, ids, n.block_k, user.grid(n.block_k), last, c0, c1); c0 = c1) {
    const uint8_t tile = user.tile_class(r0, c0);
    if (tile == kEmptyTile) continue;  // the program hides all of it: never read
    const int64_t cols = c1 - c0;
    const bool masked = needs_mask(band, geometry, r0, r1, c0, c1);
    gemm(false, true, rows, cols, n.dim, n.q_scale, q + r0 * n.dim, n.dim, k + c0 * n.dim, n.dim, 0.0f, s.data(), cols);
    scores(s.data(), nullptr, rows, cols, softcap, masked, band, geometry, r0, c0, user.on_tile(tile),
           tile_ids(segments, ids, r0, c0, c1));
    softmax_step(s.data(), rows, cols, n.dim_v, row_max.data(), row_sum.data(), acc.data());
    if (user.dropout) drop_probabilities(s.data(), rows, cols, masked, band, geometry, r0, c0, user);
    gemm(false, false, rows, n.dim_v, cols, 1.0f, s.data(), cols, v + c0 * n.dim_v, n.dim_v, 1.0f, acc.data(), n.dim_v);
  }
  finish_rows(out + r0 * n.dim_v, lse + r0, rows, n.dim_v, row_max.data(), row_sum.data(), acc.data(),
              user.dropout ? user.dropout->scale : 1.0f);
}

// ---------------------------------------------------------------------------------------------------------------
// Backward. Per kv head, per query block of every head in its group, over the key tiles it sees (the forward's
// tiles), with F = M / (1 - p) (M dropout's keep-mask regenerated from the seed; F = 1 without dropout):
//   P = exp(S - lse) (lse +inf on empty rows, so P = 0);  dV += (P ⊙ F)^T dO;  dP = (dO V^T) ⊙ F;
//   dS = P (dP - Delta), Delta = rowsum(dO out) - dlse (out the dropped output), with dropout as
//   (P ⊙ F)(dO V^T) - P Delta (F itself is never stored);  dbias += dS;
//   dU = dS cap (1 - tanh^2 U) when softcapped;  dq += q_scale dU K;  dK += q_scale dU^T q.
// The task owns batch element b's kv head h_kv: its query heads' dbias planes are its alone (dbias is allocated per
// batch element and query head), so accumulating over broadcast rows or keys needs no atomics.
struct BackwardTerms {
  Strided<const uint8_t> mask;
  Strided<const float> bias;
  Strided<float> dbias;
  const float* slopes = nullptr;  // ALiBi's (B, Hq), or null
  const Program* program = nullptr;  // a mask program, or null
  TileClasses classes;  // its classes on the backward's tiles
  const Dropout* dropout = nullptr;  // null without dropout
};

// dbias[c .. c + lanes) += dS's lanes, for a dbias row whose keys are contiguous (col 1), broadcast (0) or strided.
void accumulate_dbias(float* dbias, int64_t col, int64_t c, const Vec& ds) {
  if (col == 1) {
    (Vec::loadu(dbias + c) + ds).store(dbias + c);
    return;
  }
  float lanes[Vec::size()];
  ds.store(lanes);
  for (int64_t lane = 0; lane < Vec::size(); ++lane) dbias[(c + lane) * col] += lanes[lane];
}

// Dropout's step on a backward tile: kept = P ⊙ F, F = M / (1 - p), generated on the columns each row can see and 0
// on the others (P is 0 there), and on rows that see no key; lse: the rows' from r0 on.
void drop_gradient_rows(const float* p, float* kept, int64_t rows, int64_t cols, bool masked, const Band& band,
                        const Rows& geometry, int64_t r0, int64_t c0, const UserTerms& user, const float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    auto [from, to] = band_columns(band, geometry, masked, r0 + r, c0, cols);
    if (lse[r0 + r] == kNegInf) from = to = 0;
    float* kept_row = kept + r * cols;
    std::fill(kept_row, kept_row + from, 0.0f);
    std::fill(kept_row + to, kept_row + cols, 0.0f);
    user.dropout->keep(user.b, user.h, r0 + r, c0, from, to, user.dropout->scale, p + r * cols, kept_row);
  }
}

void bwd_kv_head(const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta,
                 float* dq, float* dk, float* dv, const Sizes& n, const Band& band, const Rows& geometry,
                 const Segments& segments, float softcap, int64_t group, const BackwardTerms& terms, int64_t b,
                 int64_t first_head) {
  std::vector<float> s = scratch(n.block_q * n.block_k), t = scratch(n.block_q * n.block_k),
                     dp = scratch(n.block_q * n.block_k), kept = scratch(terms.dropout ? n.block_q * n.block_k : 0);
  ProgramRows program(terms.program, n.block_k);
  const int64_t q_rows = std::min(geometry.q_len, n.len_q), step = Vec::size();
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head_rows = g * n.len_q;  // offset of this query head's rows within the group
    const UserTerms user{terms.mask.plane(b, first_head + g), terms.bias.plane(b, first_head + g),
                         slope_of(terms.slopes, n.heads_q, b, first_head + g), terms.program ? &program : nullptr,
                         terms.program ? &terms.classes : nullptr, b, first_head + g, terms.dropout};
    const Plane<float> dbias = terms.dbias.plane(b, first_head + g);
    for (int64_t r0 = 0; r0 < q_rows; r0 += n.block_q) {
      const int64_t r1 = std::min(r0 + n.block_q, q_rows), rows = r1 - r0;
      const float* q_block = q + (head_rows + r0) * n.dim;
      const float* dout_block = dout + (head_rows + r0) * n.dim_v;
      float* dq_block = dq + (head_rows + r0) * n.dim;
      int64_t first, last, c1;
      key_range(band, geometry, r0, r1, &first, &last);
      const IdRange ids = segments.active() ? segments.queries(r0, r1) : IdRange{};
      for (int64_t c0 = first; next_key_tile(segments, ids, n.block_k, user.grid(n.block_k), last, c0, c1);
           c0 = c1) {
        const uint8_t tile = user.tile_class(r0, c0);
        if (tile == kEmptyTile) continue;  // the program hides all of it: never read
        const int64_t cols = c1 - c0;
        const bool masked = needs_mask(band, geometry, r0, r1, c0, c1);
        gemm(false, true, rows, cols, n.dim, n.q_scale, q_block, n.dim, k + c0 * n.dim, n.dim, 0.0f, s.data(), cols);
        scores(s.data(), t.data(), rows, cols, softcap, masked, band, geometry, r0, c0, user.on_tile(tile),
               tile_ids(segments, ids, r0, c0, c1));
        for (int64_t r = 0; r < rows; ++r) {
          const float row_lse = lse[head_rows + r0 + r];
          const float shift = row_lse == kNegInf ? std::numeric_limits<float>::infinity() : row_lse;
          float* row = s.data() + r * cols;
          int64_t c = 0;
          for (; c + step <= cols; c += step) (Vec::loadu(row + c) - Vec(shift)).exp_u20().store(row + c);
          for (; c < cols; ++c) row[c] = std::exp(row[c] - shift);
        }
        if (terms.dropout)
          drop_gradient_rows(s.data(), kept.data(), rows, cols, masked, band, geometry, r0, c0, user, lse + head_rows);
        gemm(true, false, cols, n.dim_v, rows, 1.0f, terms.dropout ? kept.data() : s.data(), cols, dout_block,
             n.dim_v, 1.0f, dv + c0 * n.dim_v, n.dim_v);
        gemm(false, true, rows, cols, n.dim_v, 1.0f, dout_block, n.dim_v, v + c0 * n.dim_v, n.dim_v, 0.0f, dp.data(),
             cols);
        for (int64_t r = 0; r < rows; ++r) {
          const float row_delta = delta[head_rows + r0 + r];
          float* p = s.data() + r * cols;  // becomes dU in place
          const float* dp_row = dp.data() + r * cols;
          const float* t_row = t.data() + r * cols;
          const float* kept_row = terms.dropout ? kept.data() + r * cols : nullptr;
          // dbias takes dS before the softcap's chain rule: the bias is added after the tanh.
          float* dbias_row = dbias.base ? dbias.at(r0 + r, c0) : nullptr;
          int64_t c = 0;
          for (; c + step <= cols; c += step) {
            Vec ds = kept_row ? Vec::loadu(kept_row + c) * Vec::loadu(dp_row + c) - Vec::loadu(p + c) * Vec(row_delta)
                              : Vec::loadu(p + c) * (Vec::loadu(dp_row + c) - Vec(row_delta));
            if (dbias_row) accumulate_dbias(dbias_row, dbias.col, c, ds);
            if (softcap > 0) {
              Vec th = Vec::loadu(t_row + c);
              ds = ds * (Vec(softcap) * (Vec(1.0f) - th * th));
            }
            ds.store(p + c);
          }
          for (; c < cols; ++c) {
            float ds = kept_row ? kept_row[c] * dp_row[c] - p[c] * row_delta : p[c] * (dp_row[c] - row_delta);
            if (dbias_row) dbias_row[c * dbias.col] += ds;
            if (softcap > 0) ds *= softcap * (1.0f - t_row[c] * t_row[c]);
            p[c] = ds;
          }
        }
        gemm(false, false, rows, n.dim, cols, n.q_scale, s.data(), cols, k + c0 * n.dim, n.dim, 1.0f, dq_block, n.dim);
        gemm(true, false, cols, n.dim, rows, n.q_scale, s.data(), cols, q_block, n.dim, 1.0f, dk + c0 * n.dim, n.dim);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Paged forward (section 13): the forward's tiles over keys that lie in cache blocks. Key j of a sequence is slot
// j % block_size of block table[j / block_size]; within a block one kv head's rows are Hkv * D floats apart (the cache
// is (num_blocks, block_size, Hkv, D)), which BLAS takes as its leading dimension, so nothing is gathered. A tile of
// block_k keys crosses several blocks or lies inside one: S = q_scale q K^T and P V are one GEMM per block piece, the
// softmax one pass per tile as in fwd_block. Cosine scales column j of U by 1 / max(|k_j|, eps) (k_j / |k_j| is the
// normalised key; the cache is never rewritten). Caches of float16 or bfloat16 (T) are widened as they are read:
// vector by vector in the decode loops, a block piece at a time into a float buffer for the GEMMs.
// Split-K (flash-decoding): a row's keys [first, last) may be cut into ranges, each finished alone into
// (out_s, lse_s), then merged by section 6: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
template <typename T>
struct PagedSequence {  // one sequence's blocks
  const T* k;  // the caches (num_blocks, block_size, Hkv, D | Dv)
  const T* v;
  const int32_t* table;  // the sequence's row of the block table
  int64_t block_size, k_block, v_block, k_row, v_row;  // strides in elements: block to block, slot to slot
  float cosine_eps;  // > 0 for the cosine variant
  // Key (value) j of kv head 0; kv head h is h * D (h * Dv) elements on.
  const T* key(int64_t j) const { return k + table[j / block_size] * k_block + (j % block_size) * k_row; }
  const T* value(int64_t j) const { return v + table[j / block_size] * v_block + (j % block_size) * v_row; }
};

// Vec::size() elements from p, as floats.
template <typename T>
Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// `rows` rows of `width` elements, `row` elements apart, as floats: where they lie when T is float (leading dimension
// `row`), else widened into staging (leading dimension `width`).
struct FloatRows {
  const float* data;
  int64_t ld;
};

template <typename T>
FloatRows float_rows(const T* x, int64_t rows, int64_t width, int64_t row, float* staging) {
  if constexpr (std::is_same_v<T, float>) {
    return {x, row};
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < width; ++d) staging[r * width + d] = static_cast<float>(x[r * row + d]);
    return {staging, width};
  }
}

// fn(a, b) for each piece [a, b) of the keys [c0, c1) that lies in one block.
template <typename Fn>
void for_each_piece(int64_t c0, int64_t c1, int64_t block_size, Fn fn) {
  for (int64_t a = c0; a < c1;) {
    const int64_t b = std::min(c1, (a / block_size + 1) * block_size);
    fn(a, b);
    a = b;
  }
}

// x . y over dim elements, in float: two accumulators, so the FMA chain is half as long.
template <typename A, typename B>
float dot(const A* x, const B* y, int64_t dim) {
  const int64_t step = Vec::size();
  Vec even(0.0f), odd(0.0f);
  int64_t d = 0;
  for (; d + 2 * step <= dim; d += 2 * step) {
    even = at::vec::fmadd(load_floats(x + d), load_floats(y + d), even);
    odd = at::vec::fmadd(load_floats(x + d + step), load_floats(y + d + step), odd);
  }
  for (; d + step <= dim; d += step) even = at::vec::fmadd(load_floats(x + d), load_floats(y + d), even);
  float total = lane_sum(even + odd);
  for (; d < dim; ++d) total += static_cast<float>(x[d]) * static_cast<float>(y[d]);
  return total;
}

template <typename T>
float inverse_norm(const T* k, int64_t dim, float eps) {
  return 1.0f / std::max(std::sqrt(dot(k, k, dim)), eps);
}

// Columns [0, keys) of the rows x ld tile s times 1 / max(|k_j|, eps), keys rows of length dim `row` floats apart.
template <typename T>
void divide_by_key_norms(float* s, int64_t rows, int64_t ld, int64_t keys, const T* k, int64_t row, int64_t dim,
                         float eps) {
  for (int64_t j = 0; j < keys; ++j) {
    const float inverse = inverse_norm(k + j * row, dim, eps);
    for (int64_t r = 0; r < rows; ++r) s[r * ld + j] *= inverse;
  }
}

// Decode-sized products (kFewRows query rows per head), below the cost of a BLAS call, read slot by slot: a slot
// holds every kv head's key (Hkv * D floats in a row), so the cache streams in address order, where a head at a time
// would touch each slot's 4 KiB Hkv times, an Hkv-th of it each time (1.3-1.5x slower, docs/performance.md).
constexpr int64_t kFewRows = 4;
constexpr int64_t kAhead = 2;  // slots read ahead

template <typename T>
void prefetch_row(const T* row, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(T)) __builtin_prefetch(row + i);
}

// fn(j, slot) for the keys [c0, c1) in order, slot pointing at key j's row (every kv head) in `cache` (the k or v
// cache of `sequence`, blocks `block` and slots `row` elements apart), the slot kAhead on prefetched. The table is
// read once per block piece: a division per key cost as much as a slot's products at block_size 16.
template <typename T, typename Fn>
void for_each_slot(const T* cache, const PagedSequence<T>& sequence, int64_t block, int64_t row, int64_t c0,
                   int64_t c1, Fn fn) {
  const int64_t block_size = sequence.block_size;
  const auto at = [&](int64_t j) { return cache + sequence.table[j / block_size] * block + (j % block_size) * row; };
  for_each_piece(c0, c1, block_size, [&](int64_t a, int64_t b) {
    const T* slot = at(a);
    for (int64_t j = a; j < b; ++j, slot += row) {
      if (j + kAhead < c1) prefetch_row(j + kAhead < b ? slot + kAhead * row : at(j + kAhead), row);
      fn(j, slot);
    }
  });
}

// S_h[r, j - c0] = q_scale q_{h,r} . k_{j,h/group} for the keys [c0, c1) of every head h: S_h is `rows` x cols at
// s + h * rows * cols. Cosine divides column j by max(|k_j|, eps) (the cache keeps unnormalised keys).
template <typename T>
void few_rows_scores(const float* q, const PagedSequence<T>& cache, const Sizes& n, int64_t rows, int64_t c0, int64_t c1,
                     float* s) {
  const int64_t cols = c1 - c0, group = n.heads_q / n.heads_kv;
  for_each_slot(cache.k, cache, cache.k_block, cache.k_row, c0, c1, [&](int64_t j, const T* slot) {
    for (int64_t h_kv = 0; h_kv < n.heads_kv; ++h_kv) {
      const T* key = slot + h_kv * n.dim;
      const float alpha = n.q_scale * (cache.cosine_eps > 0 ? inverse_norm(key, n.dim, cache.cosine_eps) : 1.0f);
      for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h)
        for (int64_t r = 0; r < rows; ++r)
          s[(h * rows + r) * cols + (j - c0)] = alpha * dot(q + (h * n.len_q + r) * n.dim, key, n.dim);
    }
  });
}

// acc_h[r] += sum_j P_h[r, j - c0] v_{j,h/group} for the keys [c0, c1) of every head, P_h laid out as S_h above and
// acc_h at acc + h * acc_size.
template <typename T>
void few_rows_values(const float* p, const PagedSequence<T>& cache, const Sizes& n, int64_t rows, int64_t c0, int64_t c1,
                     float* acc, int64_t acc_size) {
  const int64_t cols = c1 - c0, group = n.heads_q / n.heads_kv, step = Vec::size();
  for_each_slot(cache.v, cache, cache.v_block, cache.v_row, c0, c1, [&](int64_t j, const T* slot) {
    for (int64_t h = 0; h < n.heads_q; ++h) {
      const T* value = slot + h / group * n.dim_v;
      for (int64_t r = 0; r < rows; ++r) {
        const float weight = p[(h * rows + r) * cols + (j - c0)];
        float* acc_row = acc + h * acc_size + r * n.dim_v;
        int64_t d = 0;
        for (; d + step <= n.dim_v; d += step)
          at::vec::fmadd(Vec(weight), load_floats(value + d), Vec::loadu(acc_row + d)).store(acc_row + d);
        for (; d < n.dim_v; ++d) acc_row[d] += weight * static_cast<float>(value[d]);
      }
    }
  });
}

// Rows [r0, r1) of every query head of one sequence over its keys [first, last). q, out and lse point at the
// sequence's head 0; the online softmax keeps its state per head (row_max, row_sum: block_q per head; acc:
// block_q * Dv per head). Decode-sized rows read the tile slot by slot for all heads at once (few_rows_*; s holds
// every head's scores); more rows take one GEMM per head and block piece, each head's rows of a block Hkv * D floats
// apart, which BLAS takes as its leading dimension. slopes: the sequence's ALiBi slopes (Hq,), or null.
template <typename T>
void fwd_rows_paged(const float* q, const PagedSequence<T>& cache, const float* slopes, float* out, float* lse,
                    const Sizes& n, const Band& band, const Rows& geometry, float softcap, int64_t r0, int64_t r1,
                    int64_t first, int64_t last, float* s, float* acc, float* row_max, float* row_sum,
                    float* staging) {
  const int64_t rows = r1 - r0, group = n.heads_q / n.heads_kv, acc_size = n.block_q * n.dim_v;
  const bool few = rows <= kFewRows;
  for (int64_t h = 0; h < n.heads_q; ++h)
    start_rows(rows, n.dim_v, row_max + h * n.block_q, row_sum + h * n.block_q, acc + h * acc_size);
  for (int64_t c0 = first; c0 < last; c0 += n.block_k) {
    const int64_t c1 = std::min(c0 + n.block_k, last), cols = c1 - c0;
    const bool masked = needs_mask(band, geometry, r0, r1, c0, c1);
    if (few) few_rows_scores(q + r0 * n.dim, cache, n, rows, c0, c1, s);
    for (int64_t h = 0; h < n.heads_q; ++h) {
      float* head_s = few ? s + h * rows * cols : s;
      if (!few) {
        const float* q_rows = q + (h * n.len_q + r0) * n.dim;
        for_each_piece(c0, c1, cache.block_size, [&](int64_t a, int64_t b) {
          const FloatRows keys = float_rows(cache.key(a) + h / group * n.dim, b - a, n.dim, cache.k_row, staging);
          gemm(false, true, rows, b - a, n.dim, n.q_scale, q_rows, n.dim, keys.data, keys.ld, 0.0f, s + (a - c0), cols);
          if (cache.cosine_eps > 0)
            divide_by_key_norms(s + (a - c0), rows, cols, b - a, keys.data, keys.ld, n.dim, cache.cosine_eps);
        });
      }
      const UserTerms user{{}, {}, slope_of(slopes, n.heads_q, 0, h)};
      scores(head_s, nullptr, rows, cols, softcap, masked, band, geometry, r0, c0, user, TileIds{});
      softmax_step(head_s, rows, cols, n.dim_v, row_max + h * n.block_q, row_sum + h * n.block_q, acc + h * acc_size);
      if (!few)
        for_each_piece(c0, c1, cache.block_size, [&](int64_t a, int64_t b) {
          const FloatRows values =
              float_rows(cache.value(a) + h / group * n.dim_v, b - a, n.dim_v, cache.v_row, staging);
          gemm(false, false, rows, n.dim_v, b - a, 1.0f, s + (a - c0), cols, values.data, values.ld, 1.0f,
               acc + h * acc_size, n.dim_v);
        });
    }
    if (few) few_rows_values(s, cache, n, rows, c0, c1, acc, acc_size);
  }
  for (int64_t h = 0; h < n.heads_q; ++h)
    finish_rows(out + (h * n.len_q + r0) * n.dim_v, lse + h * n.len_q + r0, rows, n.dim_v, row_max + h * n.block_q,
                row_sum + h * n.block_q, acc + h * acc_size);
}

// Split-K's merge (section 6) of parts (splits, rows, dim_v) and their lse (splits, rows) into out, lse.
void merge_splits(const float* parts, const float* part_lse, int64_t splits, int64_t rows, int64_t dim_v, float* out,
                  float* lse) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float top = kNegInf;
      for (int64_t p = 0; p < splits; ++p) top = nan_max(top, part_lse[p * rows + r]);
      float* out_row = out + r * dim_v;
      std::fill(out_row, out_row + dim_v, 0.0f);
      if (top == kNegInf) {  // every part empty: -inf - (-inf) would be NaN
        lse[r] = kNegInf;
        continue;
      }
      float total = 0.0f;
      for (int64_t p = 0; p < splits; ++p) total += std::exp(part_lse[p * rows + r] - top);
      lse[r] = top + std::log(total);
      for (int64_t p = 0; p < splits; ++p) {
        const float weight = std::exp(part_lse[p * rows + r] - lse[r]);
        const float* part = parts + (p * rows + r) * dim_v;
        for (int64_t d = 0; d < dim_v; ++d) out_row[d] += weight * part[d];
      }
    }
  });
}

Sizes sizes_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t block_q, int64_t block_k,
               double q_scale) {
  TORCH_CHECK(block_q >= 1 && block_k >= 1, "block_q=", block_q, " and block_k=", block_k, " must be >= 1");
  return Sizes{q.size(0),  q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3),
               block_q,    block_k,   (float)q_scale};
}

Band band_of(bool has_low, int64_t low, bool has_high, int64_t high, bool bottom_right) {
  return Band{has_low, has_high, low, high, bottom_right};
}

void check(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

// ALiBi's slopes: float32 (B, Hq) contiguous on the CPU, or None (null).
const float* checked_slopes(const std::optional<at::Tensor>& slopes, const at::Tensor& q) {
  if (!slopes) return nullptr;
  TORCH_CHECK(slopes->device().is_cpu() && slopes->scalar_type() == at::kFloat && slopes->is_contiguous() &&
                  slopes->dim() == 2 && slopes->size(0) == q.size(0) && slopes->size(1) == q.size(1),
              "alibi slopes must be a contiguous CPU float32 (B, Hq) tensor");
  return slopes->data_ptr<float>();
}

// A mask (uint8) and a bias (float32) are 4-D CPU tensors, each axis q's batch, query heads, queries or k's keys, or 1.
void check_terms(const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                 const at::Tensor& q, const at::Tensor& k) {
  const int64_t full[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  for (const auto* term : {&mask, &bias}) {
    if (!term->has_value()) continue;
    const auto& x = **term;
    const char* name = term == &mask ? "mask" : "bias";
    TORCH_CHECK(x.scalar_type() == (term == &mask ? at::kByte : at::kFloat) && x.device().is_cpu(), name,
                " must be a CPU tensor, mask uint8 and bias float32");
    TORCH_CHECK(x.dim() == 4, name, " must be 4-D, got ", x.dim(), "-D");
    for (int d = 0; d < 4; ++d)
      TORCH_CHECK(x.size(d) == 1 || x.size(d) == full[d], name, " has size ", x.size(d), " on axis ", d,
                  ", expected 1 or ", full[d]);
  }
}

// The call's segment ids (B, Lq) and (B, Lk), int64, and their summaries (B, granules, 3), or none of them.
struct SegmentArgs {
  const int64_t *q_ids = nullptr, *kv_ids = nullptr, *q_tiles = nullptr, *kv_tiles = nullptr;
  int64_t len_q = 0, len_k = 0, q_granules = 0, kv_granules = 0, granule = 1;

  Segments of(int64_t b) const {
    if (!q_ids) return {};
    return {q_ids + b * len_q, kv_ids + b * len_k, q_tiles + b * q_granules * 3, kv_tiles + b * kv_granules * 3,
            granule};
  }
};

SegmentArgs segment_args(const std::optional<at::Tensor>& q_ids, const std::optional<at::Tensor>& kv_ids,
                         const std::optional<at::Tensor>& q_tiles, const std::optional<at::Tensor>& kv_tiles,
                         int64_t granule, const at::Tensor& q, const at::Tensor& k) {
  SegmentArgs args;
  if (!q_ids.has_value()) return args;
  TORCH_CHECK(kv_ids.has_value() && q_tiles.has_value() && kv_tiles.has_value() && granule >= 1,
              "segment ids need both sides and their tile summaries");
  const int64_t granules_q = (q.size(2) + granule - 1) / granule, granules_k = (k.size(2) + granule - 1) / granule;
  const std::pair<const at::Tensor*, std::vector<int64_t>> expected[] = {
      {&*q_ids, {q.size(0), q.size(2)}},
      {&*kv_ids, {q.size(0), k.size(2)}},
      {&*q_tiles, {q.size(0), granules_q, 3}},
      {&*kv_tiles, {q.size(0), granules_k, 3}}};
  for (const auto& [x, shape] : expected)
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous() && x->device().is_cpu() &&
                    x->sizes() == c10::IntArrayRef(shape),
                "segment ids and summaries must be contiguous int64 CPU tensors of shape ", c10::IntArrayRef(shape),
                ", got ", x->sizes());
  args.q_ids = q_ids->data_ptr<int64_t>(), args.kv_ids = kv_ids->data_ptr<int64_t>();
  args.q_tiles = q_tiles->data_ptr<int64_t>(), args.kv_tiles = kv_tiles->data_ptr<int64_t>();
  args.len_q = q.size(2), args.len_k = k.size(2), args.q_granules = granules_q, args.kv_granules = granules_k;
  args.granule = granule;
  return args;
}

// A mask program's arguments: code (nodes, kFields) and operands int32, captured tensors int32 contiguous (at most
// 8-D, fewer than 2^31 elements), classes uint8 (B|1, Hq|1, tiles_q, tiles_k) on the pass's tiles; no code: none.
Program program_args(const std::optional<at::Tensor>& code, const std::optional<at::Tensor>& operands,
                     const std::vector<at::Tensor>& captured) {
  Program program;
  if (!code.has_value()) return program;
  TORCH_CHECK(operands.has_value(), "a mask program needs its operands");
  for (const auto* x : {&*code, &*operands})
    TORCH_CHECK(x->scalar_type() == at::kInt && x->is_contiguous() && x->device().is_cpu(),
                "a mask program's code and operands must be contiguous int32 CPU tensors");
  TORCH_CHECK(code->dim() == 2 && code->size(1) == kFields && code->size(0) >= 1, "a mask program's code must be (n, ",
              int(kFields), "), got ", code->sizes());
  program.code = code->data_ptr<int32_t>(), program.operands = operands->data_ptr<int32_t>();
  program.count = code->size(0);
  for (const auto& x : captured) {
    TORCH_CHECK(x.scalar_type() == at::kInt && x.is_contiguous() && x.device().is_cpu() && x.dim() <= 8 &&
                    x.numel() >= 1 && x.numel() < (int64_t{1} << 31),
                "captured tensors must be non-empty contiguous int32 CPU tensors of at most 8 dimensions, got ",
                x.sizes());
    Captured view;
    view.data = x.data_ptr<int32_t>(), view.dims = static_cast<int32_t>(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d)
      view.sizes[d] = static_cast<int32_t>(x.size(d)), view.strides[d] = static_cast<int32_t>(x.stride(d));
    program.captured.push_back(view);
  }
  const int64_t operand_count = operands->numel();
  for (int64_t n = 0; n < program.count; ++n) {  // every operand an earlier node, every read a captured slot
    const int32_t* node = program.node(n);
    TORCH_CHECK(node[kFirstOperand] >= 0 && node[kOperandCount] >= 0 &&
                    node[kFirstOperand] + node[kOperandCount] <= operand_count,
                "mask program node ", n, ": operands out of range");
    for (int32_t k = 0; k < node[kOperandCount]; ++k) {
      const int32_t arg = program.operands[node[kFirstOperand] + k];
      TORCH_CHECK(arg >= 0 && arg < n, "mask program node ", n, " reads node ", arg);
    }
    TORCH_CHECK(node[kOp] != kRead || (node[kValue] >= 0 && node[kValue] < (int64_t)captured.size() &&
                                       node[kOperandCount] == program.captured[node[kValue]].dims),
                "mask program node ", n, ": a read of a missing slot or with the wrong number of indices");
  }
  return program;
}

TileClasses tile_classes_of(const std::optional<at::Tensor>& classes, const Sizes& n) {
  TileClasses view;
  if (!classes.has_value()) return view;
  const auto& x = *classes;
  const int64_t tiles_q = (n.len_q + n.block_q - 1) / n.block_q, tiles_k = (n.len_k + n.block_k - 1) / n.block_k;
  TORCH_CHECK(x.scalar_type() == at::kByte && x.is_contiguous() && x.device().is_cpu() && x.dim() == 4 &&
                  (x.size(0) == 1 || x.size(0) == n.batch) && (x.size(1) == 1 || x.size(1) == n.heads_q) &&
                  x.size(2) == tiles_q && x.size(3) == tiles_k,
              "tile classes must be contiguous uint8 (B|1, Hq|1, ", tiles_q, ", ", tiles_k, "), got ", x.sizes());
  view.data = x.data_ptr<uint8_t>(), view.batch = x.size(0), view.heads = x.size(1);
  view.tiles_q = tiles_q, view.tiles_k = tiles_k, view.block_q = n.block_q, view.block_k = n.block_k;
  return view;
}

}  // namespace

// Dropout's arguments (section 18): the seed's 32-bit words, the threshold, the scale and the offsets; p = 0 (none) is
// `active` false.
Dropout dropout_of(bool active, int64_t seed_low, int64_t seed_high, int64_t threshold, double scale,
                   int64_t head_start, int64_t query_start, int64_t key_start) {
  if (!active) return {};
  for (const int64_t word : {seed_low, seed_high, threshold})
    TORCH_CHECK(word >= 0 && word <= 0xFFFFFFFFll, "dropout seed words and threshold must lie in [0, 2**32), got ",
                word);
  return {true, static_cast<uint32_t>(seed_low), static_cast<uint32_t>(seed_high), static_cast<uint32_t>(threshold),
          static_cast<float>(scale), head_start, query_start, key_start};
}

// q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), lengths (B,) int64 -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq).
// mask: uint8 (0 = hidden), bias: float32, each 4-D broadcastable to (B, Hq, Lq, Lk), or None. ALiBi slopes: float32
// (B, Hq) contiguous, or None. Segment ids: q_ids (B, Lq), kv_ids (B, Lk) int64 and their summaries per granule of
// positions (B, granules, 3), or all None. A mask program: its code, operands and captured tensors (program_args),
// and its classes on the tiles (block_q, block_k), or None, None, [], None. Dropout: dropout_of's arguments.
std::vector<at::Tensor> forward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_lens,
                                   at::Tensor kv_lens, std::optional<at::Tensor> mask,
                                   std::optional<at::Tensor> bias, std::optional<at::Tensor> slopes,
                                   std::optional<at::Tensor> q_ids,
                                   std::optional<at::Tensor> kv_ids, std::optional<at::Tensor> q_tiles,
                                   std::optional<at::Tensor> kv_tiles, int64_t granule, bool has_low, int64_t low,
                                   bool has_high, int64_t high, bool bottom_right, double softcap, double q_scale,
                                   int64_t block_q, int64_t block_k, std::optional<at::Tensor> program_code,
                                   std::optional<at::Tensor> program_operands, std::vector<at::Tensor> captured,
                                   std::optional<at::Tensor> classes, bool dropout_active, int64_t seed_low,
                                   int64_t seed_high, int64_t threshold, double dropout_scale, int64_t head_start,
                                   int64_t query_start, int64_t key_start) {
  check(q, "q"), check(k, "k"), check(v, "v"), check_terms(mask, bias, q, k);
  const Dropout dropout = dropout_of(dropout_active, seed_low, seed_high, threshold, dropout_scale, head_start,
                                     query_start, key_start);
  const float* slope_values = checked_slopes(slopes, q);
  const SegmentArgs segments = segment_args(q_ids, kv_ids, q_tiles, kv_tiles, granule, q, k);
  const Strided<const uint8_t> mask_view = strided<const uint8_t>(mask);
  const Strided<const float> bias_view = strided<const float>(bias);
  const Sizes n = sizes_of(q, k, v, block_q, block_k, q_scale);
  const Band band = band_of(has_low, low, has_high, high, bottom_right);
  const Program program = program_args(program_code, program_operands, captured);
  const TileClasses tile_classes = tile_classes_of(classes, n);
  TORCH_CHECK(program.active() == (tile_classes.data != nullptr), "a mask program comes with its tile classes");
  auto out = at::zeros({n.batch, n.heads_q, n.len_q, n.dim_v}, q.options());
  auto lse = at::full({n.batch, n.heads_q, n.len_q}, kNegInf, q.options());
  const int64_t* q_len = q_lens.data_ptr<int64_t>();
  const int64_t* kv_len = kv_lens.data_ptr<int64_t>();
  const int64_t blocks = (n.len_q + n.block_q - 1) / n.block_q, group = n.heads_q / n.heads_kv;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  at::parallel_for(0, n.batch * n.heads_q * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s = scratch(n.block_q * n.block_k), acc = scratch(n.block_q * n.dim_v),
                       row_max = scratch(n.block_q), row_sum = scratch(n.block_q);
    ProgramRows program_rows(program.active() ? &program : nullptr, n.block_k);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % blocks, head = (task / blocks) % n.heads_q, b = task / blocks / n.heads_q;
      const Rows geometry = rows_of(band, q_len, kv_len, b);
      const int64_t r0 = block * n.block_q, r1 = std::min({r0 + n.block_q, n.len_q, geometry.q_len});
      if (r0 >= r1) continue;
      const int64_t kv_head = b * n.heads_kv + head / group, q_head = b * n.heads_q + head;
      const UserTerms user{mask_view.plane(b, head), bias_view.plane(b, head),
                           slope_of(slope_values, n.heads_q, b, head), program.active() ? &program_rows : nullptr,
                           program.active() ? &tile_classes : nullptr, b, head,
                           dropout.active ? &dropout : nullptr};
      fwd_block(qp + q_head * n.len_q * n.dim, kp + kv_head * n.len_k * n.dim, vp + kv_head * n.len_k * n.dim_v,
                op + q_head * n.len_q * n.dim_v, lp + q_head * n.len_q, n, band, geometry, user, segments.of(b),
                (float)softcap, r0, r1, s, acc, row_max, row_sum);
    }
  });
  return {out, lse};
}

// delta = rowsum(dout * out) - dlse, (B, Hq, Lq). Returns dq (for the scaled q), dk, dv, and with need_dbias the
// bias gradient as (B, Hq, Lq|1, Lk|1): summed over the bias's broadcast rows and keys, not yet over its broadcast
// batch and heads (each task owns its planes; the caller sums those), else an empty tensor.
std::vector<at::Tensor> backward(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor dout,
                                    at::Tensor lse, at::Tensor delta, at::Tensor q_lens, at::Tensor kv_lens,
                                    std::optional<at::Tensor> mask, std::optional<at::Tensor> bias,
                                    std::optional<at::Tensor> slopes, std::optional<at::Tensor> q_ids,
                                    std::optional<at::Tensor> kv_ids,
                                    std::optional<at::Tensor> q_tiles, std::optional<at::Tensor> kv_tiles,
                                    int64_t granule, bool need_dbias, bool has_low, int64_t low, bool has_high,
                                    int64_t high, bool bottom_right, double softcap, double q_scale, int64_t block_q,
                                    int64_t block_k, std::optional<at::Tensor> program_code,
                                    std::optional<at::Tensor> program_operands, std::vector<at::Tensor> captured,
                                    std::optional<at::Tensor> classes, bool dropout_active, int64_t seed_low,
                                    int64_t seed_high, int64_t threshold, double dropout_scale, int64_t head_start,
                                    int64_t query_start, int64_t key_start) {
  check(q, "q"), check(k, "k"), check(v, "v"), check(dout, "dout"), check(lse, "lse"), check(delta, "delta");
  const Dropout dropout = dropout_of(dropout_active, seed_low, seed_high, threshold, dropout_scale, head_start,
                                     query_start, key_start);
  check_terms(mask, bias, q, k);
  const SegmentArgs segments = segment_args(q_ids, kv_ids, q_tiles, kv_tiles, granule, q, k);
  TORCH_CHECK(!need_dbias || bias.has_value(), "need_dbias without a bias");
  const Sizes n = sizes_of(q, k, v, block_q, block_k, q_scale);
  const Band band = band_of(has_low, low, has_high, high, bottom_right);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  auto dbias = need_dbias ? at::zeros({n.batch, n.heads_q, bias->size(2), bias->size(3)}, q.options())
                          : at::empty({0}, q.options());
  const Program program = program_args(program_code, program_operands, captured);
  const BackwardTerms terms{strided<const uint8_t>(mask), strided<const float>(bias),
                            need_dbias ? strided<float>(dbias) : Strided<float>{}, checked_slopes(slopes, q),
                            program.active() ? &program : nullptr, tile_classes_of(classes, n),
                            dropout.active ? &dropout : nullptr};
  TORCH_CHECK(program.active() == (terms.classes.data != nullptr), "a mask program comes with its tile classes");
  const int64_t* q_len = q_lens.data_ptr<int64_t>();
  const int64_t* kv_len = kv_lens.data_ptr<int64_t>();
  const int64_t group = n.heads_q / n.heads_kv;
  at::parallel_for(0, n.batch * n.heads_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / n.heads_kv;
      const int64_t q_head = task * group;  // the first of the group's query heads: b * Hq + h_kv * group
      const int64_t q_offset = q_head * n.len_q;
      bwd_kv_head(q.data_ptr<float>() + q_offset * n.dim, k.data_ptr<float>() + task * n.len_k * n.dim,
                  v.data_ptr<float>() + task * n.len_k * n.dim_v, dout.data_ptr<float>() + q_offset * n.dim_v,
                  lse.data_ptr<float>() + q_offset, delta.data_ptr<float>() + q_offset,
                  dq.data_ptr<float>() + q_offset * n.dim, dk.data_ptr<float>() + task * n.len_k * n.dim,
                  dv.data_ptr<float>() + task * n.len_k * n.dim_v, n, band, rows_of(band, q_len, kv_len, b),
                  segments.of(b), (float)softcap, group, terms, b, (task % n.heads_kv) * group);
    }
  });
  return {dq, dk, dv, dbias};
}

// q (B, Hq, Lq, D); k_cache (num_blocks, block_size, Hkv, D), v_cache (num_blocks, block_size, Hkv, Dv); block_table
// int32 (B, max_blocks); lengths (B,) int64; ALiBi slopes float32 (B, Hq) or None -> out (B, Hq, Lq, Dv), lse
// (B, Hq, Lq). Each row's keys are cut into
// `splits` ranges (split-K) that separate tasks run, merged at the end; 1 runs each row whole.
std::vector<at::Tensor> forward_paged(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                         at::Tensor block_table, at::Tensor q_lens, at::Tensor kv_lens,
                                         std::optional<at::Tensor> slopes, bool has_low, int64_t low,
                                         bool has_high, int64_t high, bool bottom_right, double softcap,
                                         double q_scale, double cosine_eps, int64_t block_q, int64_t block_k,
                                         int64_t splits) {
  check(q, "q");
  const float* slope_values = checked_slopes(slopes, q);
  for (const auto* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->is_contiguous() && cache->device().is_cpu() && cache->scalar_type() == k_cache.scalar_type() &&
                    (cache->scalar_type() == at::kFloat || cache->scalar_type() == at::kBFloat16 ||
                     cache->scalar_type() == at::kHalf),
                "k_cache and v_cache must be contiguous CPU tensors of one dtype: float32, bfloat16 or float16");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table must be a contiguous 2-D int32 tensor");
  TORCH_CHECK(splits >= 1, "splits=", splits, " must be >= 1");
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), max_blocks = block_table.size(1);
  const Sizes n{q.size(0), q.size(1), k_cache.size(2), q.size(2), max_blocks * block_size, q.size(3), v_cache.size(3),
                block_q, block_k, (float)q_scale};
  TORCH_CHECK(block_q >= 1 && block_k >= 1, "block_q=", block_q, " and block_k=", block_k, " must be >= 1");
  const int64_t* q_len = q_lens.data_ptr<int64_t>();
  const int64_t* kv_len = kv_lens.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < n.batch; ++b) {  // the entries the kernel reads must lie in the cache
    TORCH_CHECK(kv_len[b] >= 0 && kv_len[b] <= n.len_k, "kv_lengths[", b, "]=", kv_len[b], " outside [0, ", n.len_k,
                "]");
    for (int64_t i = 0; i < (kv_len[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * max_blocks + i] >= 0 && table[b * max_blocks + i] < num_blocks, "block_table[", b, ", ",
                  i, "]=", table[b * max_blocks + i], " outside [0, ", num_blocks, ")");
  }
  const Band band = band_of(has_low, low, has_high, high, bottom_right);
  auto out = at::zeros({n.batch, n.heads_q, n.len_q, n.dim_v}, q.options());
  auto lse = at::full({n.batch, n.heads_q, n.len_q}, kNegInf, q.options());
  const int64_t rows = n.batch * n.heads_q * n.len_q;
  // One split writes straight into out and lse; more write parts, merged below.
  auto parts = splits == 1 ? out : at::zeros({splits, n.batch, n.heads_q, n.len_q, n.dim_v}, q.options());
  auto part_lse = splits == 1 ? lse : at::full({splits, n.batch, n.heads_q, n.len_q}, kNegInf, q.options());
  const int64_t blocks = (n.len_q + n.block_q - 1) / n.block_q;
  const float* qp = q.data_ptr<float>();
  float *op = parts.data_ptr<float>(), *lp = part_lse.data_ptr<float>();
  const auto run = [&](auto element) {  // the caches' element type: float, at::BFloat16 or at::Half
    using scalar_t = decltype(element);
    const scalar_t *kp = k_cache.data_ptr<scalar_t>(), *vp = v_cache.data_ptr<scalar_t>();
    const int64_t staging_size =
        std::is_same_v<scalar_t, float> ? 0 : std::min(n.block_k, block_size) * std::max(n.dim, n.dim_v);
    // A task: one sequence's query block, every head, one split of the keys.
    at::parallel_for(0, n.batch * blocks * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> s = scratch(std::max(n.block_q, n.heads_q * kFewRows) * n.block_k),
                         acc = scratch(n.heads_q * n.block_q * n.dim_v), row_max = scratch(n.heads_q * n.block_q),
                         row_sum = scratch(n.heads_q * n.block_q), staging = scratch(staging_size);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t split = task % splits, block = task / splits % blocks, b = task / splits / blocks;
        const Rows geometry = rows_of(band, q_len, kv_len, b);
        const int64_t r0 = block * n.block_q, r1 = std::min({r0 + n.block_q, n.len_q, geometry.q_len});
        if (r0 >= r1) continue;
        int64_t first, last;
        key_range(band, geometry, r0, r1, &first, &last);
        // This split's share of the keys, in whole tiles.
        const int64_t tiles = std::max<int64_t>(last - first, 0) / n.block_k + 1;
        const int64_t share = (tiles + splits - 1) / splits * n.block_k;
        const int64_t from = first + split * share, to = std::min(last, from + share);
        if (split > 0 && from >= to) continue;  // empty: its part keeps out 0, lse -inf
        const PagedSequence<scalar_t> cache{kp, vp, table + b * max_blocks, block_size, block_size * n.heads_kv * n.dim,
                                  block_size * n.heads_kv * n.dim_v, n.heads_kv * n.dim, n.heads_kv * n.dim_v,
                                  (float)cosine_eps};
        const int64_t head_0 = split * rows + b * n.heads_q * n.len_q;  // row (b, head 0, query 0) of this split's part
        fwd_rows_paged(qp + b * n.heads_q * n.len_q * n.dim, cache,
                       slope_values ? slope_values + b * n.heads_q : nullptr, op + head_0 * n.dim_v, lp + head_0, n, band,
                       geometry, (float)softcap, r0, r1, from, std::max(from, to), s.data(), acc.data(), row_max.data(),
                       row_sum.data(), staging.data());
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat) run(float{});
  else if (k_cache.scalar_type() == at::kBFloat16) run(at::BFloat16{});
  else run(at::Half{});
  if (splits > 1) merge_splits(op, lp, splits, rows, n.dim_v, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// Philox4x32-10's words for the counters (counter[0] + n, counter[1], counter[2], counter[3]), n < kPhiloxCounters,
// words[4 n + w], through the vector code the keep step runs: for known-answer tests.
std::vector<int64_t> philox4x32(std::array<int64_t, 4> counter, std::array<int64_t, 2> key) {
  for (const int64_t word : {counter[0], counter[1], counter[2], counter[3], key[0], key[1]})
    TORCH_CHECK(word >= 0 && word <= 0xFFFFFFFFll, "Philox words must lie in [0, 2**32), got ", word);
  PhiloxLanes::V c[4][kPhiloxVectors];
  philox_block(static_cast<uint32_t>(counter[0]), static_cast<uint32_t>(counter[1]), static_cast<uint32_t>(counter[2]),
               static_cast<uint32_t>(counter[3]), static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]), c);
  uint32_t words[4 * kPhiloxCounters];
  for (int v = 0; v < kPhiloxVectors; ++v)
    PhiloxLanes::store(c[0][v], c[1][v], c[2][v], c[3][v], words + 4 * v * PhiloxLanes::kCount);
  return std::vector<int64_t>(words, words + 4 * kPhiloxCounters);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "cpu-flash forward: (out, lse)");
  m.def("backward", &backward, "cpu-flash backward: (dq, dk, dv)");
  m.def("forward_paged", &forward_paged, "cpu-flash forward over a paged KV cache: (out, lse)");
  m.def("philox4x32", &philox4x32, "Philox4x32-10's words of a block of counters (known-answer tests)");
}
