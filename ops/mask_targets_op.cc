// Mask targets of the sampled RoIs, fused.
//
// Twin: mrcnn_tf2/ops/masks.py mask_targets, which edge-pads each GT crop by one cell, resamples it with
// tf.image.crop_and_resize at the RoI's grid points and thresholds at 0.5 inside the GT box. This kernel
// repeats the twin's float operations in the same order (including crop_and_resize's own arithmetic), so
// the thresholded result is bit-identical, not merely close.
//
// Glossary: B batch, F RoI slots, M crop side, R output side.

#include <algorithm>
#include <cmath>

#include "common.h"

namespace mrcnn {
namespace {

// masks.py _MIN_EXTENT: floor on GT extents when dividing by them.
constexpr float kMinExtent = 1e-6f;

REGISTER_OP("MrcnnMaskTargets")
    .Input("rois: float")      // [B, F, 4] pixels [ymin, xmin, ymax, xmax]; padded rows all -1
    .Input("gt_boxes: float")  // [B, F, 4] matched GT box of each RoI
    .Input("crops: float")     // [B, F, M, M] matched GT mask cropped to its box
    .Output("targets: float")  // [B, F, R, R] in {0, 1}
    .Attr("output_size: int >= 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int output_size;
      TF_RETURN_IF_ERROR(c->GetAttr("output_size", &output_size));
      shape_inference::ShapeHandle rois;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &rois));
      c->set_output(0, c->MakeShape({c->Dim(rois, 0), c->Dim(rois, 1), output_size, output_size}));
      return Status();
    });

// One axis of one RoI: where its R grid points fall in the padded crop (crop_and_resize's in_y) and
// whether each lies inside the GT box.
struct AxisGrid {
  float in[64];      // padded-crop index coordinate of grid point r
  bool inside[64];   // roi grid point r in [gt_start, gt_end)
};

// masks.py _grid_in_crop + crop_and_resize's coordinate formula + _grid_inside, float op by float op.
void ComputeAxis(float roi_start, float roi_end, float gt_start, float gt_end, int crop_size, int output_size,
                 AxisGrid* grid) {
  const float roi_length = roi_end - roi_start;
  const float half_cell = 0.5f * roi_length / static_cast<float>(output_size);
  const float cells_per_pixel = static_cast<float>(crop_size) / std::max(gt_end - gt_start, kMinExtent);
  auto to_crop = [&](float y) {
    return ((y - gt_start) * cells_per_pixel + 0.5f) / (static_cast<float>(crop_size) + 1.0f);
  };
  const float first = to_crop(roi_start + half_cell);
  const float last = to_crop(roi_start + roi_length - half_cell);
  const int image_size = crop_size + 2;  // the edge-padded crop
  // crop_and_resize mixes int and float operands exactly like this (see its CPU kernel).
  const float scale = output_size > 1 ? (last - first) * (image_size - 1) / (output_size - 1) : 0.0f;
  for (int r = 0; r < output_size; ++r) {
    grid->in[r] = output_size > 1 ? first * (image_size - 1) + r * scale
                                  : static_cast<float>(0.5 * (first + last) * (image_size - 1));
    const float step = (static_cast<float>(r) + 0.5f) / static_cast<float>(output_size);
    const float point = roi_start + step * roi_length;
    grid->inside[r] = point >= gt_start && point < gt_end;
  }
}

class MaskTargetsOp : public OpKernel {
 public:
  explicit MaskTargetsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("output_size", &output_size_));
    OP_REQUIRES(context, output_size_ <= 64, InvalidArgument("output_size must be <= 64"));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& rois = context->input(0);
    const Tensor& gt_boxes = context->input(1);
    const Tensor& crops = context->input(2);
    OP_REQUIRES(context, rois.dims() == 3 && rois.dim_size(2) == 4 && gt_boxes.shape() == rois.shape(),
                InvalidArgument("rois and gt_boxes must both be [B, F, 4], got ", rois.shape().DebugString(),
                                " and ", gt_boxes.shape().DebugString()));
    OP_REQUIRES(context, crops.dims() == 4 && crops.dim_size(0) == rois.dim_size(0) &&
                             crops.dim_size(1) == rois.dim_size(1) && crops.dim_size(2) == crops.dim_size(3) &&
                             crops.dim_size(2) >= 1,
                InvalidArgument("crops must be [B, F, M, M], got ", crops.shape().DebugString()));
    const int64_t batch = rois.dim_size(0), num_rois = rois.dim_size(1);
    const int M = crops.dim_size(2), R = output_size_;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch, num_rois, R, R}), &output));
    const float* roi_data = rois.flat<float>().data();
    const float* gt_data = gt_boxes.flat<float>().data();
    const float* crop_data = crops.flat<float>().data();
    float* out_data = output->flat<float>().data();

    auto work = [&](int64_t begin, int64_t end) {
      AxisGrid ys, xs;
      for (int64_t n = begin; n < end; ++n) {
        const float* roi = roi_data + 4 * n;
        const float* gt = gt_data + 4 * n;
        const float* crop = crop_data + n * M * M;
        float* out = out_data + n * R * R;
        // box_ops.is_padding: the largest coordinate is negative.
        const bool valid = std::max(std::max(roi[0], roi[1]), std::max(roi[2], roi[3])) >= 0.0f;
        ComputeAxis(roi[0], roi[2], gt[0], gt[2], M, R, &ys);
        ComputeAxis(roi[1], roi[3], gt[1], gt[3], M, R, &xs);
        // Cell k of the edge-padded crop is cell clamp(k - 1, 0, M - 1) of the crop.
        auto unpad = [&](int k) { return std::min(std::max(k - 1, 0), M - 1); };
        // crop_and_resize's taps, per column once: [left, right] crop columns and the lerp; ok false where
        // the point is outside the padded crop (extrapolation value 0) or outside the GT box (target 0).
        const float limit = static_cast<float>(M + 1);
        int left[64], right[64];
        float x_lerp[64];
        bool column_ok[64];
        for (int j = 0; j < R; ++j) {
          const float in_x = xs.in[j];
          column_ok[j] = xs.inside[j] && in_x >= 0.0f && in_x <= limit;
          const int floor_x = column_ok[j] ? static_cast<int>(std::floor(in_x)) : 0;
          x_lerp[j] = in_x - floor_x;
          left[j] = unpad(floor_x);
          right[j] = unpad(column_ok[j] ? static_cast<int>(std::ceil(in_x)) : 0);
        }
        for (int i = 0; i < R; ++i) {
          const float in_y = ys.in[i];
          float* out_row = out + i * R;
          if (!(valid && ys.inside[i] && in_y >= 0.0f && in_y <= limit)) {
            std::fill(out_row, out_row + R, 0.0f);
            continue;
          }
          const int floor_y = static_cast<int>(std::floor(in_y));
          const float y_lerp = in_y - floor_y;
          const float* top = crop + unpad(floor_y) * M;
          const float* bottom = crop + unpad(static_cast<int>(std::ceil(in_y))) * M;
          for (int j = 0; j < R; ++j) {
            float value = 0.0f;  // crop_and_resize's extrapolation value
            if (column_ok[j]) {
              const float top_left = top[left[j]], top_right = top[right[j]];
              const float bottom_left = bottom[left[j]], bottom_right = bottom[right[j]];
              const float upper = top_left + (top_right - top_left) * x_lerp[j];
              const float lower = bottom_left + (bottom_right - bottom_left) * x_lerp[j];
              value = upper + (lower - upper) * y_lerp;
            }
            out_row[j] = value >= 0.5f ? 1.0f : 0.0f;
          }
        }
      }
    };
    ParallelFor(context, batch * num_rois, int64_t(R) * R * 40 + 500, work);
  }

 private:
  int output_size_;
};

REGISTER_KERNEL_BUILDER(Name("MrcnnMaskTargets").Device(tensorflow::DEVICE_CPU), MaskTargetsOp);

}  // namespace
}  // namespace mrcnn
