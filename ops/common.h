// Helpers shared by the fused Mask R-CNN ops.
#ifndef MRCNN_OPS_COMMON_H_
#define MRCNN_OPS_COMMON_H_

#include <cstdint>
#include <functional>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace mrcnn {

// The TensorFlow names every kernel file uses, declared once for the project's namespace.
using tensorflow::DataType;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::OpOutputList;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// Runs work(begin, end) over [0, total) on TF's intra-op CPU thread pool, so that every core works.
// cost_per_unit is a rough count of cycles per unit: Shard uses it to avoid splitting tiny jobs.
inline void ParallelFor(tensorflow::OpKernelContext* context, int64_t total, int64_t cost_per_unit,
                        const std::function<void(int64_t, int64_t)>& work) {
  auto* threads = context->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(threads->num_threads, threads->workers, total, cost_per_unit, work);
}

}  // namespace mrcnn

#endif  // MRCNN_OPS_COMMON_H_
