// Meta kernels of the index family (tensor/meta/target.h): each costs the bytes it reads and
// writes. The ops allocate what they need (the mask positions included); the only kernel that
// allocates scratch is CUDA's sort of rows longer than kCudaBlockSortMax (a segmented radix
// sort, tensor/index/cuda.cu's radix_sort): its keys and positions twice over and the row
// offsets are charged in its order; cub's temporary storage, whose size cub gives only on the
// GPU, is not, and the dry run notes it (memory::note_unreplayed).
#include "memory/meta.h"

#include "tensor/index/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

void sort(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim,
          bool /*descending*/) {
  cost(values, 0, tensor_bytes(values, indices, x));
  const RowsAlong rows = rows_along(x, dim);
  if (!replays_cuda(x) || rows.n <= kCudaBlockSortMax) return;
  const int64_t total = rows.count * rows.n;
  const Tensor keys =
      alloc_scratch(2 * total, x.dtype() == DType::bool_ ? DType::uint8 : x.dtype(), x.device());
  const Tensor positions = alloc_scratch(2 * total, DType::int64, x.device());
  const Tensor offsets = alloc_scratch(rows.count + 1, DType::int64, x.device());
  memory::note_unreplayed(x.device(),
                          "sort: cub's temporary storage for rows over 2,048 elements on CUDA "
                          "(its size is asked of the GPU itself; counted as 0 B)");
}

}  // namespace

const IndexKernels index_kernels{.gather = nothing,
                                 .scatter = nothing,
                                 .scan = nothing,
                                 .sort = &sort,
                                 .remap = nothing,
                                 .masked_select = nothing,
                                 .masked_scatter = nothing};

}  // namespace tally::meta
