// Plain C++ launcher API for the fused paged KV gather/scatter kernels (no torch headers).
//
// Pool storage per layer:   [num_blocks, block_size, num_heads, head_dim], contiguous.
// Cache side per layer:     [batch, num_heads, num_tokens, head_dim], any non-negative strides.
// Gather:  cache[b, h, t, :] = pool[ids[b, t / block_size], t % block_size, h, :]
// Scatter: pool[ids[b, t / block_size], t % block_size, h, :] = cache[b, h, t, :]
// for t < num_tokens. Values are copied as raw bytes (bit-exact, no arithmetic).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace radixkv {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

enum class Direction : int32_t { kGather = 0, kScatter = 1 };

// Bytes per element; 0 for an unknown value.
inline int64_t elem_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

// One layer's K (or V): the pool tensor and the cache-side tensor it is copied to / from.
// Heads, head dim and dtype are per view (layers of one model may differ).
struct LayerView {
  void* pool;                // [num_blocks, block_size, num_heads, head_dim], contiguous
  void* cache;               // [batch, num_heads, num_tokens, head_dim]
  int64_t cache_stride[4];   // in elements: batch, head, token, dim (>= 0)
  int64_t num_heads;
  int64_t head_dim;          // <= kMaxHeadDim
  DType dtype;               // of both tensors
};

// What every view of one call shares: the block ids index every layer's pool.
struct PagedCopyGeometry {
  const void* block_ids;        // [batch, num_block_cols] in device memory
  bool block_ids_int32;         // else int64
  int64_t block_id_stride[2];   // in elements
  int64_t batch;
  int64_t num_block_cols;
  int64_t num_tokens;           // <= num_block_cols * block_size
  int64_t num_blocks;
  int64_t block_size;
};

constexpr int64_t kMaxHeadDim = 65535;

// Views per kernel launch: their parameters are passed by value (kernel parameter space is
// 4 KB), so 64 views = 32 layers of K and V go in one launch; more views take
// ceil(num_views / 64) launches.
constexpr int kMaxViewsPerLaunch = 64;

// Enqueues the copy of all views on `stream` (asynchronous). Returns cudaErrorInvalidValue,
// without launching anything, when the geometry is inconsistent (negative or too large
// sizes, num_tokens beyond the block ids' capacity, an unknown dtype, a head dim above
// kMaxHeadDim, a token row above 2 GiB, null pointers);
// otherwise the launch's error. Block ids are NOT range-checked on the host (they live in
// device memory): the kernel skips tokens whose block id is outside [0, num_blocks), so a
// bad id never reads or writes outside the pool; callers validate ids beforehand.
cudaError_t paged_copy(Direction direction, const PagedCopyGeometry& geometry,
                       const LayerView* views, int64_t num_views, cudaStream_t stream);

}  // namespace radixkv
