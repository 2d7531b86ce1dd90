// Mask pasting for evaluation, fused: each detection's mask resampled over the pixels of its box.
//
// Twin: mrcnn_tf2/ops/masks.py paste_masks (NumPy), whose rules and float operations this repeats (its
// pixel ranges in double, as Python computes them, the bilinear weights and products in float32). The
// op returns only each box's region, packed one after another, with the region's extent: the caller
// places them into a zero-initialised [D, h, w] array, so the pixels outside every box (most of the
// output) are never written. The twin multiplies the weights by BLAS matrix products, whose summation
// order (and use of FMA) is not fixed, so results agree to float rounding, not bit for bit.
//
// Glossary: D detections, R mask side, h x w image.

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace mrcnn {
namespace {

// masks.py _MIN_EXTENT.
constexpr double kMinExtent = 1e-6;

REGISTER_OP("MrcnnPasteMasks")
    .Input("masks: float")      // [D, R, R] probabilities relative to their box
    .Input("boxes: float")      // [D, 4] [ymin, xmin, ymax, xmax] in target-image pixels
    .Output("regions: out_type")  // [sum of region sizes] each box's rows x cols region, row-major
    .Output("extents: int32")   // [D, 4] (top, left, rows, cols) of each region
    .Attr("height: int >= 0")
    .Attr("width: int >= 0")
    .Attr("threshold: float = 0.5")  // used when out_type is uint8: 1 where probability >= threshold
    .Attr("out_type: {float, uint8}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->Dim(c->input(1), 0), 4));
      return Status();
    });

// masks.py _axis_weights: the pixels of one axis whose centres lie in [start, end) and, for each, its
// two mask cells and their bilinear weights.
struct AxisWeights {
  int64_t first = 0, count = 0;
  std::vector<int> low, high;
  std::vector<float> w_low, w_high;

  void Compute(float start_f, float end_f, int mask_size, int64_t num_pixels) {
    const double start = start_f, end = end_f;  // Python floats
    auto ceil_clamped = [](double v, int64_t lo, int64_t hi) {
      const double c = std::ceil(v);
      return c < lo ? lo : (c > hi ? hi : static_cast<int64_t>(c));
    };
    first = ceil_clamped(start - 0.5, 0, num_pixels);
    const int64_t stop = ceil_clamped(end - 0.5, first, num_pixels);
    count = stop - first;
    // The scale is a Python float, rounded to float32 when it meets the float32 centres.
    const float scale = static_cast<float>(mask_size / std::max(end - start, kMinExtent));
    const float top = static_cast<float>(mask_size - 1);
    low.resize(count);
    high.resize(count);
    w_low.resize(count);
    w_high.resize(count);
    for (int64_t p = 0; p < count; ++p) {
      const float centre = static_cast<float>(first + p) + 0.5f;
      float coord = (centre - start_f) * scale - 0.5f;
      coord = std::min(std::max(coord, 0.0f), top);
      const float lo = std::floor(coord);
      low[p] = static_cast<int>(lo);
      high[p] = std::min(low[p] + 1, mask_size - 1);
      const float frac = coord - lo;
      // Where low == high the twin's single weight is (1 - frac) + frac; frac is 0 there.
      w_low[p] = 1.0f - frac;
      w_high[p] = frac;
    }
  }
};

template <typename T>
class PasteMasksOp : public OpKernel {
 public:
  explicit PasteMasksOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("height", &height_));
    OP_REQUIRES_OK(context, context->GetAttr("width", &width_));
    OP_REQUIRES_OK(context, context->GetAttr("threshold", &threshold_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& masks = context->input(0);
    const Tensor& boxes = context->input(1);
    OP_REQUIRES(context, masks.dims() == 3 && masks.dim_size(1) == masks.dim_size(2) && masks.dim_size(1) >= 1,
                InvalidArgument("masks must be [D, R, R], got ", masks.shape().DebugString()));
    OP_REQUIRES(context, boxes.dims() == 2 && boxes.dim_size(0) == masks.dim_size(0) && boxes.dim_size(1) == 4,
                InvalidArgument("boxes must be [D, 4], got ", boxes.shape().DebugString()));
    const int64_t num = masks.dim_size(0);
    const int R = masks.dim_size(1);
    const auto box = boxes.matrix<float>();

    // Extents first (cheap, serial), so that the packed output can be allocated at its exact size.
    std::vector<AxisWeights> ys(num), xs(num);
    std::vector<int64_t> offsets(num + 1, 0);
    Tensor* extents = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({num, 4}), &extents));
    auto extent = extents->matrix<int32_t>();
    for (int64_t d = 0; d < num; ++d) {
      ys[d].Compute(box(d, 0), box(d, 2), R, height_);
      xs[d].Compute(box(d, 1), box(d, 3), R, width_);
      if (ys[d].count == 0 || xs[d].count == 0) ys[d].count = xs[d].count = 0;  // the twin skips it
      extent(d, 0) = ys[d].first;
      extent(d, 1) = xs[d].first;
      extent(d, 2) = ys[d].count;
      extent(d, 3) = xs[d].count;
      offsets[d + 1] = offsets[d] + ys[d].count * xs[d].count;
    }
    Tensor* regions = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({offsets[num]}), &regions));
    T* out_data = regions->flat<T>().data();
    const float* mask_data = masks.flat<float>().data();

    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> rows_by_mask;  // the twin's rows @ mask: [rows, R]
      for (int64_t d = begin; d < end; ++d) {
        const AxisWeights &y = ys[d], &x = xs[d];
        const float* mask = mask_data + d * R * R;
        rows_by_mask.resize(y.count * R);
        for (int64_t p = 0; p < y.count; ++p) {
          const float* lo = mask + y.low[p] * R;
          const float* hi = mask + y.high[p] * R;
          float* row = rows_by_mask.data() + p * R;
          for (int l = 0; l < R; ++l) row[l] = y.w_low[p] * lo[l] + y.w_high[p] * hi[l];
        }
        T* out = out_data + offsets[d];
        for (int64_t p = 0; p < y.count; ++p) {
          const float* row = rows_by_mask.data() + p * R;
          for (int64_t q = 0; q < x.count; ++q) {
            const float value = row[x.low[q]] * x.w_low[q] + row[x.high[q]] * x.w_high[q];
            out[p * x.count + q] = Convert(value);
          }
        }
      }
    };
    ParallelFor(context, num, 20 * (offsets[num] / std::max<int64_t>(num, 1)) + 1000, work);
  }

 private:
  T Convert(float value) const;

  int height_, width_;
  float threshold_;
};

template <>
float PasteMasksOp<float>::Convert(float value) const {
  return value;
}
template <>
uint8_t PasteMasksOp<uint8_t>::Convert(float value) const {
  return value >= threshold_ ? 1 : 0;
}

REGISTER_KERNEL_BUILDER(
    Name("MrcnnPasteMasks").Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("out_type"),
    PasteMasksOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("MrcnnPasteMasks").Device(tensorflow::DEVICE_CPU).TypeConstraint<uint8_t>("out_type"),
    PasteMasksOp<uint8_t>);

}  // namespace
}  // namespace mrcnn
