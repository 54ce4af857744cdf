// Fused paged KV gather / scatter: one kernel launch copies every layer's K and V.
//
// Grid: x = (batch row b, tile of `tile_tokens` tokens), y = view (one layer's K or V).
// A token's row is [num_heads, head_dim] elements, cut into "units" of 16, 8, 4 or 2 bytes
// (the largest that divides the head's bytes, the pointers and every stride in use). A thread
// owns fixed units and walks the tile's tokens, so per copied unit it does one block-id load
// (an L1 broadcast) and a few multiply-adds; divisions happen once per unit, not per token.
// Values are moved as raw bytes (uint4/uint2/uint32/uint16), so the copy is bit-exact and the
// dtype only sets the element size. All offsets are int64.
//
// The per-CTA body is __host__ __device__ and uses no shared memory or barriers, so the tests
// run it on the CPU (thread by thread) against the pure-torch reference.
#include "paged_copy.h"

#include <climits>
#include <cstdint>
#include <cstring>

#include <cuda_runtime.h>
#include <vector_types.h>

// `#pragma unroll` only means something to the device compiler (the host one warns).
#if defined(__CUDA_ARCH__)
#define RADIXKV_UNROLL(n) _Pragma(#n)
#else
#define RADIXKV_UNROLL(n)
#endif

// Host-side hook on every emulated unit copy. memcpy forgives what a GPU vector access does
// not (an address that is not a multiple of the unit size), so the CPU emulation in the tests
// defines this to flag misaligned units; a real build never runs copy_unit on the host.
#ifndef RADIXKV_HOST_COPY_HOOK
#define RADIXKV_HOST_COPY_HOOK(dst, src, unit_bytes)
#endif

namespace radixkv {
namespace detail {

constexpr int32_t kThreads = 128;
constexpr int32_t kUnitsPerThread = 8;  // copies a thread aims to keep in flight per CTA

struct ViewParams {  // 56 bytes
  char* pool;
  char* cache;
  int64_t stride_b;         // cache strides in bytes; 0 for a dimension of size 1
  int64_t stride_h;
  int64_t stride_t;
  int64_t stride_unit;      // bytes between consecutive units of one head on the cache side
  int32_t units_per_token;  // num_heads * units_per_head (> 0)
  uint16_t units_per_head;  // head_dim * elem_size / unit_bytes (<= kMaxHeadDim)
  uint16_t unit_bytes;      // 16, 8, 4 or 2
};

struct LaunchParams {
  const char* block_ids;
  int64_t id_stride_b;  // bytes
  int64_t id_stride_c;  // bytes
  int64_t num_blocks;
  int32_t ids_int32;
  int32_t num_tokens;
  int32_t block_size;
  int32_t block_shift;  // log2(block_size) when it is a power of two, else -1
  int32_t tile_tokens;
  int32_t tiles_per_row;
  int32_t num_views;
  ViewParams views[kMaxViewsPerLaunch];
};
static_assert(sizeof(LaunchParams) <= 4000, "kernel parameters must fit in 4 KB");

struct Launch {
  LaunchParams params;
  int64_t grid_x;  // batch * tiles_per_row
  int32_t grid_y;  // number of views
};

__host__ __device__ inline int64_t load_block_id(const LaunchParams& p, int64_t b, int32_t col) {
  const char* ptr = p.block_ids + b * p.id_stride_b + col * p.id_stride_c;
  return p.ids_int32 ? static_cast<int64_t>(*reinterpret_cast<const int32_t*>(ptr))
                     : *reinterpret_cast<const int64_t*>(ptr);
}

template <typename Unit>
__host__ __device__ inline void copy_unit(char* dst, const char* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Unit*>(dst) = *reinterpret_cast<const Unit*>(src);
#else
  RADIXKV_HOST_COPY_HOOK(dst, src, sizeof(Unit));
  std::memcpy(dst, src, sizeof(Unit));
#endif
}

// Copies tokens [t0, t1) of batch row b for one view. Threads [0, nthreads) split the row's
// units; when a row has fewer units than threads, several tokens are copied side by side.
template <typename Unit, bool kScatter>
__host__ __device__ inline void copy_tile(const LaunchParams& p, const ViewParams& v, int64_t b,
                                          int32_t t0, int32_t t1, int32_t tid, int32_t nthreads) {
  const int32_t units = v.units_per_token;
  const int32_t units_per_head = v.units_per_head;
  int32_t lane = 0, r_first = tid, r_step = nthreads, t_step = 1;
  if (units < nthreads) {
    const int32_t lanes = nthreads / units;
    lane = tid / units;
    if (lane >= lanes) return;
    r_first = tid - lane * units;
    r_step = units;
    t_step = lanes;
  }
  const int64_t row_bytes = static_cast<int64_t>(units) * v.unit_bytes;  // = heads * head bytes
  for (int32_t r = r_first; r < units; r += r_step) {
    const int32_t h = r / units_per_head;
    const int32_t u = r - h * units_per_head;
    // Pool rows are contiguous [num_heads, head_dim]: unit r sits r * unit_bytes into the row.
    char* const pool_r = v.pool + static_cast<int64_t>(r) * v.unit_bytes;
    char* const cache_r = v.cache + b * v.stride_b + h * v.stride_h + u * v.stride_unit;
    RADIXKV_UNROLL(unroll 4)
    for (int32_t t = t0 + lane; t < t1; t += t_step) {
      const int32_t col = p.block_shift >= 0 ? (t >> p.block_shift) : (t / p.block_size);
      const int32_t slot = t - col * p.block_size;
      const int64_t id = load_block_id(p, b, col);
      if (id < 0 || id >= p.num_blocks) continue;  // never touch memory outside the pool
      char* const pool_ptr = pool_r + (id * p.block_size + slot) * row_bytes;
      char* const cache_ptr = cache_r + t * v.stride_t;
      if (kScatter) {
        copy_unit<Unit>(pool_ptr, cache_ptr);
      } else {
        copy_unit<Unit>(cache_ptr, pool_ptr);
      }
    }
  }
}

// The work of CTA (cta, view): one tile of one batch row of one view.
template <bool kScatter>
__host__ __device__ inline void copy_cta(const LaunchParams& p, int32_t view, int64_t cta,
                                         int32_t tid, int32_t nthreads) {
  const ViewParams& v = p.views[view];
  const int64_t b = cta / p.tiles_per_row;
  const int32_t tile = static_cast<int32_t>(cta - b * p.tiles_per_row);
  const int32_t t0 = tile * p.tile_tokens;
  const int32_t t1 = t0 + p.tile_tokens < p.num_tokens ? t0 + p.tile_tokens : p.num_tokens;
  switch (v.unit_bytes) {
    case 16:
      copy_tile<uint4, kScatter>(p, v, b, t0, t1, tid, nthreads);
      break;
    case 8:
      copy_tile<uint2, kScatter>(p, v, b, t0, t1, tid, nthreads);
      break;
    case 4:
      copy_tile<uint32_t, kScatter>(p, v, b, t0, t1, tid, nthreads);
      break;
    case 2:
      copy_tile<uint16_t, kScatter>(p, v, b, t0, t1, tid, nthreads);
      break;
    default:
      break;
  }
}

template <bool kScatter>
__global__ void __launch_bounds__(kThreads) paged_copy_kernel(const __grid_constant__ LaunchParams p) {
  copy_cta<kScatter>(p, static_cast<int32_t>(blockIdx.y), static_cast<int64_t>(blockIdx.x),
                     static_cast<int32_t>(threadIdx.x), static_cast<int32_t>(blockDim.x));
}

// ---- host-side planning -----------------------------------------------------------------

inline bool geometry_ok(const PagedCopyGeometry& g, const LayerView* views, int64_t num_views) {
  if (num_views < 0 || (num_views > 0 && views == nullptr)) return false;
  if (g.batch < 0 || g.num_block_cols < 0 || g.num_tokens < 0 || g.num_blocks < 0) return false;
  if (g.block_size < 1 || g.block_size > INT32_MAX) return false;
  if (g.num_tokens > INT32_MAX / 2) return false;  // leaves room for t0 + tile_tokens
  if (g.num_tokens > 0 && (g.num_tokens - 1) / g.block_size >= g.num_block_cols) return false;
  if (g.block_id_stride[0] < 0 || g.block_id_stride[1] < 0) return false;
  const bool work = g.batch > 0 && g.num_tokens > 0;
  if (work && g.block_ids == nullptr) return false;
  for (int64_t i = 0; i < num_views; ++i) {
    const LayerView& v = views[i];
    const int64_t elem = elem_size(v.dtype);
    if (elem == 0 || v.num_heads < 0 || v.num_heads > INT32_MAX) return false;
    if (v.head_dim < 0 || v.head_dim > kMaxHeadDim) return false;
    if (v.num_heads * v.head_dim * elem > INT32_MAX) return false;  // row bytes fit int32
    for (int d = 0; d < 4; ++d) {
      if (v.cache_stride[d] < 0) return false;
    }
    if (work && v.num_heads * v.head_dim > 0 && (v.pool == nullptr || v.cache == nullptr)) {
      return false;
    }
  }
  return true;
}

// Largest unit (16, 8, 4 bytes, else one element) dividing the head's bytes, both pointers
// and every cache stride of a dimension longer than 1; units > elem need a unit dim stride.
inline int32_t pick_unit_bytes(const PagedCopyGeometry& g, const LayerView& v, int64_t elem) {
  const int64_t sizes[3] = {g.batch, v.num_heads, g.num_tokens};
  for (int64_t unit = 16; unit > elem; unit /= 2) {
    if ((v.head_dim * elem) % unit != 0 || v.cache_stride[3] != 1) continue;
    if (reinterpret_cast<uintptr_t>(v.pool) % unit != 0) continue;
    if (reinterpret_cast<uintptr_t>(v.cache) % unit != 0) continue;
    bool aligned = true;
    for (int d = 0; d < 3; ++d) {
      if (sizes[d] > 1 && (v.cache_stride[d] * elem) % unit != 0) aligned = false;
    }
    if (aligned) return static_cast<int32_t>(unit);
  }
  return static_cast<int32_t>(elem);
}

inline ViewParams make_view(const PagedCopyGeometry& g, const LayerView& v) {
  const int64_t elem = elem_size(v.dtype);
  const int64_t sizes[4] = {g.batch, v.num_heads, g.num_tokens, v.head_dim};
  int64_t stride[4];
  for (int d = 0; d < 4; ++d) stride[d] = sizes[d] > 1 ? v.cache_stride[d] * elem : 0;
  const int32_t unit = pick_unit_bytes(g, v, elem);
  const int64_t units_per_head = v.head_dim * elem / unit;
  ViewParams out{};
  out.pool = static_cast<char*>(v.pool);
  out.cache = static_cast<char*>(v.cache);
  out.stride_b = stride[0];
  out.stride_h = stride[1];
  out.stride_t = stride[2];
  out.stride_unit = unit > elem ? unit : stride[3];
  out.units_per_token = static_cast<int32_t>(v.num_heads * units_per_head);
  out.units_per_head = static_cast<uint16_t>(units_per_head);
  out.unit_bytes = static_cast<uint16_t>(unit);
  return out;
}

// Plans the launches for all views (at most kMaxViewsPerLaunch per launch; views with no
// heads or a zero head dim have nothing to copy) and calls fn(const Launch&) -> cudaError_t
// for each.
template <typename Fn>
cudaError_t for_each_launch(const PagedCopyGeometry& g, const LayerView* views, int64_t num_views,
                            Fn&& fn) {
  if (!geometry_ok(g, views, num_views)) return cudaErrorInvalidValue;
  if (g.batch == 0 || g.num_tokens == 0) return cudaSuccess;

  Launch launch{};
  LaunchParams& p = launch.params;
  p.block_ids = static_cast<const char*>(g.block_ids);
  p.ids_int32 = g.block_ids_int32 ? 1 : 0;
  const int64_t id_bytes = g.block_ids_int32 ? 4 : 8;
  p.id_stride_b = g.batch > 1 ? g.block_id_stride[0] * id_bytes : 0;
  p.id_stride_c = g.block_id_stride[1] * id_bytes;
  p.num_blocks = g.num_blocks;
  p.num_tokens = static_cast<int32_t>(g.num_tokens);
  p.block_size = static_cast<int32_t>(g.block_size);
  p.block_shift = -1;
  if ((g.block_size & (g.block_size - 1)) == 0) {
    p.block_shift = 0;
    while ((int64_t{1} << p.block_shift) < g.block_size) ++p.block_shift;
  }

  int32_t count = 0;
  int64_t max_units = 1;
  auto flush = [&]() -> cudaError_t {
    int64_t tile = int64_t{kThreads} * kUnitsPerThread / max_units;
    tile = tile < 1 ? 1 : (tile > g.num_tokens ? g.num_tokens : tile);
    const int64_t tiles_per_row = (g.num_tokens + tile - 1) / tile;
    if (g.batch > INT32_MAX / tiles_per_row) return cudaErrorInvalidValue;  // grid.x limit
    p.tile_tokens = static_cast<int32_t>(tile);
    p.tiles_per_row = static_cast<int32_t>(tiles_per_row);
    p.num_views = count;
    launch.grid_x = g.batch * tiles_per_row;
    launch.grid_y = count;
    const cudaError_t err = fn(static_cast<const Launch&>(launch));
    count = 0;
    max_units = 1;
    return err;
  };
  for (int64_t i = 0; i < num_views; ++i) {
    if (views[i].num_heads == 0 || views[i].head_dim == 0) continue;
    p.views[count] = make_view(g, views[i]);
    if (p.views[count].units_per_token > max_units) max_units = p.views[count].units_per_token;
    if (++count == kMaxViewsPerLaunch) {
      const cudaError_t err = flush();
      if (err != cudaSuccess) return err;
    }
  }
  return count > 0 ? flush() : cudaSuccess;
}

}  // namespace detail

cudaError_t paged_copy(Direction direction, const PagedCopyGeometry& geometry,
                       const LayerView* views, int64_t num_views, cudaStream_t stream) {
  if (direction != Direction::kGather && direction != Direction::kScatter) {
    return cudaErrorInvalidValue;
  }
  const bool scatter = direction == Direction::kScatter;
  return detail::for_each_launch(geometry, views, num_views, [&](const detail::Launch& l) {
    const dim3 grid(static_cast<unsigned>(l.grid_x), static_cast<unsigned>(l.grid_y));
    if (scatter) {
      detail::paged_copy_kernel<true><<<grid, detail::kThreads, 0, stream>>>(l.params);
    } else {
      detail::paged_copy_kernel<false><<<grid, detail::kThreads, 0, stream>>>(l.params);
    }
    return cudaGetLastError();
  });
}

}  // namespace radixkv
