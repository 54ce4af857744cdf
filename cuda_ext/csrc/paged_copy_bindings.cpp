// CUDA implementations of radixkv::_paged_gather_cuda / radixkv::_paged_scatter_cuda.
//
// The schemas are defined once, in cuda_ext/ops.py; the public ops radixkv::paged_gather /
// paged_scatter validate their arguments there (cuda_ext/validate.py, block-id range
// included) and then call these. The checks below are only a memory-safety backstop for
// direct callers of the private ops: they do not range-check block ids (that would need a
// device->host sync); the kernel skips out-of-range ids instead of touching memory.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "paged_copy.h"

namespace {

radixkv::DType to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf:
      return radixkv::DType::kFloat16;
    case at::kBFloat16:
      return radixkv::DType::kBFloat16;
    case at::kFloat:
      return radixkv::DType::kFloat32;
    case at::kDouble:
      return radixkv::DType::kFloat64;
    default:
      break;
  }
  TORCH_CHECK(false, "radixkv paged copy: unsupported dtype ", type);
}

// Appends one view per (pool, cache) pair after checking it matches the shared geometry:
// pool [num_blocks, block_size, H, D] contiguous, cache [batch, H, num_tokens, D], one dtype
// per pair, everything on `device`.
void add_views(const char* name, at::TensorList pools, at::TensorList caches, at::Device device,
               const radixkv::PagedCopyGeometry& g, std::vector<radixkv::LayerView>& views) {
  for (size_t i = 0; i < pools.size(); ++i) {
    const at::Tensor& pool = pools[i];
    const at::Tensor& cache = caches[i];
    TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.size(0) == g.num_blocks &&
                    pool.size(1) == g.block_size && pool.size(3) <= radixkv::kMaxHeadDim,
                "radixkv paged copy: ", name, " pool ", i, " must be contiguous [", g.num_blocks,
                ", ", g.block_size, ", heads, head_dim <= ", radixkv::kMaxHeadDim, "], got ",
                pool.sizes());
    TORCH_CHECK(cache.dim() == 4 && cache.size(0) == g.batch && cache.size(1) == pool.size(2) &&
                    cache.size(2) == g.num_tokens && cache.size(3) == pool.size(3),
                "radixkv paged copy: ", name, " cache ", i, " must be [", g.batch, ", ",
                pool.size(2), ", ", g.num_tokens, ", ", pool.size(3), "], got ", cache.sizes());
    TORCH_CHECK(pool.device() == device && cache.device() == device &&
                    cache.scalar_type() == pool.scalar_type(),
                "radixkv paged copy: ", name, " layer ", i, ": pool is ", pool.scalar_type(), " on ",
                pool.device(), ", cache is ", cache.scalar_type(), " on ", cache.device(),
                "; both must share the dtype and be on ", device);
    radixkv::LayerView v{};
    v.pool = pool.data_ptr();
    v.cache = cache.data_ptr();
    for (int d = 0; d < 4; ++d) v.cache_stride[d] = cache.stride(d);
    v.num_heads = pool.size(2);
    v.head_dim = pool.size(3);
    v.dtype = to_dtype(pool.scalar_type());
    views.push_back(v);
  }
}

void paged_copy(radixkv::Direction direction, at::TensorList k_pools, at::TensorList v_pools,
                const at::Tensor& block_ids, int64_t num_tokens, at::TensorList k_cache,
                at::TensorList v_cache) {
  const size_t n = k_pools.size();
  TORCH_CHECK(v_pools.size() == n && k_cache.size() == n && v_cache.size() == n,
              "radixkv paged copy: layer counts differ");
  if (n == 0) return;
  const at::Tensor& ref = k_pools[0];
  TORCH_CHECK(ref.is_cuda() && ref.dim() == 4, "radixkv paged copy: pools must be 4-D CUDA tensors");
  TORCH_CHECK(block_ids.device() == ref.device() && block_ids.dim() == 2 &&
                  (block_ids.scalar_type() == at::kInt || block_ids.scalar_type() == at::kLong),
              "radixkv paged copy: block_ids must be a 2-D int32/int64 tensor on ", ref.device());

  radixkv::PagedCopyGeometry g{};
  g.block_ids = block_ids.data_ptr();
  g.block_ids_int32 = block_ids.scalar_type() == at::kInt;
  g.block_id_stride[0] = block_ids.stride(0);
  g.block_id_stride[1] = block_ids.stride(1);
  g.batch = block_ids.size(0);
  g.num_block_cols = block_ids.size(1);
  g.num_tokens = num_tokens;
  g.num_blocks = ref.size(0);
  g.block_size = ref.size(1);
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= g.num_block_cols * g.block_size,
              "radixkv paged copy: num_tokens=", num_tokens, " exceeds ", g.num_block_cols,
              " blocks of ", g.block_size);

  std::vector<radixkv::LayerView> views;
  views.reserve(2 * n);
  add_views("K", k_pools, k_cache, ref.device(), g, views);
  add_views("V", v_pools, v_cache, ref.device(), g, views);

  const c10::cuda::CUDAGuard guard(ref.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ref.device().index()).stream();
  const cudaError_t err = radixkv::paged_copy(direction, g, views.data(),
                                              static_cast<int64_t>(views.size()), stream);
  TORCH_CHECK(err != cudaErrorInvalidValue, "radixkv paged copy: geometry rejected by the launcher");
  C10_CUDA_CHECK(err);
}

void gather_cuda(at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& block_ids,
                 int64_t num_tokens, at::TensorList k_out, at::TensorList v_out) {
  paged_copy(radixkv::Direction::kGather, k_pools, v_pools, block_ids, num_tokens, k_out, v_out);
}

void scatter_cuda(at::TensorList k_src, at::TensorList v_src, const at::Tensor& block_ids,
                  at::TensorList k_pools, at::TensorList v_pools) {
  const int64_t num_tokens = k_src.empty() ? 0 : k_src[0].size(2);
  paged_copy(radixkv::Direction::kScatter, k_pools, v_pools, block_ids, num_tokens, k_src, v_src);
}

}  // namespace

TORCH_LIBRARY_IMPL(radixkv, CUDA, m) {
  m.impl("_paged_gather_cuda", &gather_cuda);
  m.impl("_paged_scatter_cuda", &scatter_cuda);
}
