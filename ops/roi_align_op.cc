// Multilevel RoIAlign (torchvision's, aligned=True or False) and its gradient, fused.
//
// Twin: mrcnn_tf2/ops/roi_align.py multilevel_roi_align, which states the sampling rules. The Python
// wrapper (mrcnn_tf2/ops/fused.py) assigns each box its level with the twin's own assign_levels and casts
// the features to float32, so the kernels only sample; they see float32 only.
//
// Glossary: B batch, N boxes, L levels, C channels, R output side, s sampling ratio, S = R * s.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"

namespace mrcnn {
namespace {

REGISTER_OP("MrcnnRoiAlign")
    .Input("features: num_levels * float")  // each [B, H_l, W_l, C]
    .Input("boxes: float")                  // [B, N, 4] pixels [ymin, xmin, ymax, xmax]
    .Input("levels: int32")                 // [B, N] index into features (level - min_level)
    .Output("output: float")                // [B, N, R, R, C]
    .Attr("num_levels: int >= 1")
    .Attr("min_level: int")
    .Attr("output_size: int >= 1")
    .Attr("sampling_ratio: int >= 1")
    .Attr("aligned: bool = true")  // torchvision's aligned: see ComputeBoxTaps
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_levels, output_size;
      TF_RETURN_IF_ERROR(c->GetAttr("num_levels", &num_levels));
      TF_RETURN_IF_ERROR(c->GetAttr("output_size", &output_size));
      shape_inference::ShapeHandle feature, boxes;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &feature));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num_levels), 3, &boxes));
      c->set_output(0, c->MakeShape({c->Dim(boxes, 0), c->Dim(boxes, 1), output_size, output_size,
                                     c->Dim(feature, 3)}));
      return Status();
    });

REGISTER_OP("MrcnnRoiAlignGrad")
    .Input("grad: float")          // [B, N, R, R, C] gradient of the output
    .Input("boxes: float")         // [B, N, 4]
    .Input("levels: int32")        // [B, N]
    .Input("level_sizes: int32")   // [L, 2] (H_l, W_l) of each level
    // None, or one [B, H_l, W_l, C] per level that the gradient is added to (another RoIAlign's gradient of
    // the same features), in place when its buffer is this op's alone.
    .Input("base: num_base * float")
    .Output("features_grad: num_levels * float")  // each [B, H_l, W_l, C]
    .Attr("num_levels: int >= 1")
    .Attr("num_base: int >= 0 = 0")  // 0 or num_levels
    .Attr("min_level: int")
    .Attr("sampling_ratio: int >= 1")
    .Attr("aligned: bool = true")  // the forward op's
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_levels;
      TF_RETURN_IF_ERROR(c->GetAttr("num_levels", &num_levels));
      shape_inference::ShapeHandle grad;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 5, &grad));
      // H_l and W_l are values of level_sizes: the Python gradient sets them from the features' shapes.
      for (int i = 0; i < num_levels; ++i) {
        c->set_output(i, c->MakeShape({c->Dim(grad, 0), c->UnknownDim(), c->UnknownDim(), c->Dim(grad, 4)}));
      }
      return Status();
    });

// The bilinear taps of the S samples along one axis of one box, with the twin's (and torchvision's) float
// arithmetic: sample iy of bin i sits at start + i * bin_size + (iy + 0.5) * bin_size / s; outside
// [-1, size] it weighs 0, inside it is clamped to [0, size - 1] and split between its lower and upper cell.
// Weights include the 1 / s of the bin mean.
struct AxisTaps {
  std::vector<int> low, high;
  std::vector<float> w_low, w_high;

  void Compute(float start, float length, int size, int output_size, int sampling_ratio) {
    const int num_samples = output_size * sampling_ratio;
    low.resize(num_samples);
    high.resize(num_samples);
    w_low.resize(num_samples);
    w_high.resize(num_samples);
    const float fsize = static_cast<float>(size);
    const float bin_size = length / static_cast<float>(output_size);
    for (int m = 0; m < num_samples; ++m) {
      const float bin_index = static_cast<float>(m / sampling_ratio);
      const float in_bin = static_cast<float>(m % sampling_ratio) + 0.5f;
      float coord = start + bin_index * bin_size + in_bin * bin_size / static_cast<float>(sampling_ratio);
      const float inside = (coord >= -1.0f && coord <= fsize) ? 1.0f : 0.0f;
      coord = std::min(std::max(coord, 0.0f), fsize - 1.0f);
      const float lo = std::floor(coord);
      const float frac = coord - lo;
      low[m] = static_cast<int>(lo);
      high[m] = std::min(low[m] + 1, size - 1);
      w_low[m] = (1.0f - frac) * inside / static_cast<float>(sampling_ratio);
      w_high[m] = frac * inside / static_cast<float>(sampling_ratio);
    }
  }
};

// Level index, level extents and taps of box (b, n): shared by the forward and backward kernels.
struct BoxTaps {
  int level = 0;
  AxisTaps y, x;
};

// aligned shifts the box by -0.5 cell (cell centres at integer coordinates); otherwise the box is not
// shifted and its height and width are at least 1 cell, as in torchvision's aligned=False. The extents are
// taken after the shift, as torchvision (and the twin) take them, so that they round alike.
inline bool ComputeBoxTaps(const float* box, int level, int min_level, int height, int width, int output_size,
                           int sampling_ratio, bool aligned, BoxTaps* taps) {
  if (height <= 0 || width <= 0) return false;
  const float scale = std::ldexp(1.0f, -(level + min_level));
  const float offset = aligned ? 0.5f : 0.0f;
  const float ymin = box[0] * scale - offset, xmin = box[1] * scale - offset;
  float box_height = (box[2] * scale - offset) - ymin, box_width = (box[3] * scale - offset) - xmin;
  if (!aligned) {
    box_height = std::max(box_height, 1.0f);
    box_width = std::max(box_width, 1.0f);
  }
  taps->level = level;
  taps->y.Compute(ymin, box_height, height, output_size, sampling_ratio);
  taps->x.Compute(xmin, box_width, width, output_size, sampling_ratio);
  return true;
}

// Validates boxes [B, N, 4] and levels [B, N] against the level count; sets batch and num_boxes.
Status CheckBoxes(const Tensor& boxes, const Tensor& levels, int num_levels, int64_t* batch, int64_t* num_boxes) {
  if (boxes.dims() != 3 || boxes.dim_size(2) != 4) {
    return InvalidArgument("boxes must be [B, N, 4], got ", boxes.shape().DebugString());
  }
  if (levels.dims() != 2 || levels.dim_size(0) != boxes.dim_size(0) || levels.dim_size(1) != boxes.dim_size(1)) {
    return InvalidArgument("levels must be [B, N] like boxes, got ", levels.shape().DebugString());
  }
  const auto flat = levels.flat<int32_t>();
  for (int64_t i = 0; i < flat.size(); ++i) {
    if (flat(i) < 0 || flat(i) >= num_levels) return InvalidArgument("level index ", flat(i), " out of range");
  }
  *batch = boxes.dim_size(0);
  *num_boxes = boxes.dim_size(1);
  return Status();
}

class RoiAlignOp : public OpKernel {
 public:
  explicit RoiAlignOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("min_level", &min_level_));
    OP_REQUIRES_OK(context, context->GetAttr("output_size", &output_size_));
    OP_REQUIRES_OK(context, context->GetAttr("sampling_ratio", &sampling_ratio_));
    OP_REQUIRES_OK(context, context->GetAttr("aligned", &aligned_));
  }

  void Compute(OpKernelContext* context) override {
    OpInputList features;
    OP_REQUIRES_OK(context, context->input_list("features", &features));
    const Tensor& boxes = context->input(features.size());
    const Tensor& levels = context->input(features.size() + 1);
    int64_t batch, num_boxes;
    OP_REQUIRES_OK(context, CheckBoxes(boxes, levels, features.size(), &batch, &num_boxes));
    const int64_t channels = features[0].dim_size(3);
    for (int l = 0; l < features.size(); ++l) {
      OP_REQUIRES(context, features[l].dims() == 4 && features[l].dim_size(0) == batch &&
                               features[l].dim_size(3) == channels,
                  InvalidArgument("features must be [B, H, W, C] with the boxes' B and one C"));
    }
    const int R = output_size_, s = sampling_ratio_;
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch, num_boxes, R, R, channels}), &output));
    const float* box_data = boxes.flat<float>().data();
    const int32_t* level_data = levels.flat<int32_t>().data();
    float* out_data = output->flat<float>().data();

    // Boxes are independent: each unit writes only its own [R, R, C] slab.
    auto work = [&](int64_t begin, int64_t end) {
      BoxTaps taps;
      for (int64_t bn = begin; bn < end; ++bn) {
        const int64_t b = bn / num_boxes;
        const Tensor& feature = features[level_data[bn]];
        const int height = feature.dim_size(1), width = feature.dim_size(2);
        float* out = out_data + bn * R * R * channels;
        if (!ComputeBoxTaps(box_data + 4 * bn, level_data[bn], min_level_, height, width, R, s, aligned_, &taps)) {
          std::fill(out, out + R * R * channels, 0.0f);
          continue;
        }
        const float* image = feature.flat<float>().data() + b * height * width * channels;
        for (int i = 0; i < R; ++i) {
          for (int j = 0; j < R; ++j) {
            float* acc = out + (i * R + j) * channels;
            std::fill(acc, acc + channels, 0.0f);
            for (int iy = 0; iy < s; ++iy) {
              const int m = i * s + iy;
              const float* row_low = image + int64_t(taps.y.low[m]) * width * channels;
              const float* row_high = image + int64_t(taps.y.high[m]) * width * channels;
              for (int ix = 0; ix < s; ++ix) {
                const int q = j * s + ix;
                const float w1 = taps.y.w_low[m] * taps.x.w_low[q], w2 = taps.y.w_low[m] * taps.x.w_high[q];
                const float w3 = taps.y.w_high[m] * taps.x.w_low[q], w4 = taps.y.w_high[m] * taps.x.w_high[q];
                if (w1 == 0.0f && w2 == 0.0f && w3 == 0.0f && w4 == 0.0f) continue;
                const float* p1 = row_low + taps.x.low[q] * channels;
                const float* p2 = row_low + taps.x.high[q] * channels;
                const float* p3 = row_high + taps.x.low[q] * channels;
                const float* p4 = row_high + taps.x.high[q] * channels;
                for (int64_t c = 0; c < channels; ++c) {
                  acc[c] += w1 * p1[c] + w2 * p2[c] + w3 * p3[c] + w4 * p4[c];
                }
              }
            }
          }
        }
      }
    };
    ParallelFor(context, batch * num_boxes, int64_t(R) * R * s * s * 8 * channels + 1000, work);
  }

 private:
  int min_level_, output_size_, sampling_ratio_;
  bool aligned_;
};

class RoiAlignGradOp : public OpKernel {
 public:
  explicit RoiAlignGradOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("num_levels", &num_levels_));
    OP_REQUIRES_OK(context, context->GetAttr("num_base", &num_base_));
    OP_REQUIRES(context, num_base_ == 0 || num_base_ == num_levels_,
                InvalidArgument("num_base must be 0 or num_levels (", num_levels_, "), got ", num_base_));
    OP_REQUIRES_OK(context, context->GetAttr("min_level", &min_level_));
    OP_REQUIRES_OK(context, context->GetAttr("sampling_ratio", &sampling_ratio_));
    OP_REQUIRES_OK(context, context->GetAttr("aligned", &aligned_));
  }

  void Compute(OpKernelContext* context) override {
    constexpr int kFirstBase = 4;  // inputs: grad, boxes, levels, level_sizes, base...
    const Tensor& grad = context->input(0);
    const Tensor& boxes = context->input(1);
    const Tensor& levels = context->input(2);
    const Tensor& level_sizes = context->input(3);
    int64_t batch, num_boxes;
    OP_REQUIRES_OK(context, CheckBoxes(boxes, levels, num_levels_, &batch, &num_boxes));
    OP_REQUIRES(context, grad.dims() == 5 && grad.dim_size(0) == batch && grad.dim_size(1) == num_boxes &&
                             grad.dim_size(2) == grad.dim_size(3),
                InvalidArgument("grad must be [B, N, R, R, C], got ", grad.shape().DebugString()));
    OP_REQUIRES(context, level_sizes.dims() == 2 && level_sizes.dim_size(0) == num_levels_ &&
                             level_sizes.dim_size(1) == 2,
                InvalidArgument("level_sizes must be [L, 2], got ", level_sizes.shape().DebugString()));
    const int R = grad.dim_size(2), s = sampling_ratio_;
    const int64_t channels = grad.dim_size(4);
    const auto sizes = level_sizes.matrix<int32_t>();

    std::vector<float*> grad_data(num_levels_);
    std::vector<const float*> base_data(num_levels_, nullptr);  // a base not forwarded: copied, not zeroed
    std::vector<int64_t> cells(num_levels_);  // B * H_l * W_l
    for (int l = 0; l < num_levels_; ++l) {
      OP_REQUIRES(context, sizes(l, 0) >= 0 && sizes(l, 1) >= 0, InvalidArgument("negative level size"));
      const TensorShape shape({batch, sizes(l, 0), sizes(l, 1), channels});
      Tensor* out = nullptr;
      if (num_base_ > 0) {
        const Tensor& base = context->input(kFirstBase + l);
        OP_REQUIRES(context, base.shape() == shape,
                    InvalidArgument("base ", l, " must be the level's gradient ", shape.DebugString(), ", got ",
                                    base.shape().DebugString()));
        OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({kFirstBase + l}, l, shape, &out));
        if (out->flat<float>().data() != base.flat<float>().data()) base_data[l] = base.flat<float>().data();
      } else {
        OP_REQUIRES_OK(context, context->allocate_output(l, shape, &out));
      }
      grad_data[l] = out->flat<float>().data();
      cells[l] = batch * sizes(l, 0) * sizes(l, 1);
    }
    // Start the (large, dense) gradients from zeros or from a base not forwarded, in parallel, one level at a
    // time; a forwarded base is already in place.
    for (int l = 0; l < num_levels_; ++l) {
      if (num_base_ > 0 && base_data[l] == nullptr) continue;
      float* data = grad_data[l];
      const float* from = base_data[l];
      ParallelFor(context, cells[l], channels, [&](int64_t begin, int64_t end) {
        if (from == nullptr) {
          std::memset(data + begin * channels, 0, (end - begin) * channels * sizeof(float));
        } else {
          std::memcpy(data + begin * channels, from + begin * channels, (end - begin) * channels * sizeof(float));
        }
      });
    }

    // Taps of every box, computed once and read by all threads.
    std::vector<BoxTaps> taps(batch * num_boxes);
    std::vector<char> usable(batch * num_boxes);
    const float* box_data = boxes.flat<float>().data();
    const int32_t* level_data = levels.flat<int32_t>().data();
    for (int64_t bn = 0; bn < batch * num_boxes; ++bn) {
      const int l = level_data[bn];
      usable[bn] = ComputeBoxTaps(box_data + 4 * bn, l, min_level_, sizes(l, 0), sizes(l, 1), R, s, aligned_,
                                  &taps[bn]);
    }

    // Boxes overlap, so partitioning by box would race on the scatter-add. Each unit instead owns a block
    // of channels across every box and level: no two threads ever write the same element, and with C in
    // the hundreds there are enough blocks for every core.
    constexpr int64_t kBlock = 16;
    const int64_t num_blocks = (channels + kBlock - 1) / kBlock;
    const float* grad_data_in = grad.flat<float>().data();
    auto work = [&](int64_t block_begin, int64_t block_end) {
      const int64_t c0 = block_begin * kBlock, c1 = std::min(channels, block_end * kBlock);
      const int64_t width_c = c1 - c0;
      for (int64_t bn = 0; bn < batch * num_boxes; ++bn) {
        if (!usable[bn]) continue;
        const BoxTaps& t = taps[bn];
        const int64_t b = bn / num_boxes;
        const int64_t width = sizes(t.level, 1);
        float* image = grad_data[t.level] + b * sizes(t.level, 0) * width * channels + c0;
        for (int i = 0; i < R; ++i) {
          for (int j = 0; j < R; ++j) {
            const float* g = grad_data_in + ((bn * R + i) * R + j) * channels + c0;
            for (int iy = 0; iy < s; ++iy) {
              const int m = i * s + iy;
              float* row_low = image + t.y.low[m] * width * channels;
              float* row_high = image + t.y.high[m] * width * channels;
              for (int ix = 0; ix < s; ++ix) {
                const int q = j * s + ix;
                const float w[4] = {t.y.w_low[m] * t.x.w_low[q], t.y.w_low[m] * t.x.w_high[q],
                                    t.y.w_high[m] * t.x.w_low[q], t.y.w_high[m] * t.x.w_high[q]};
                float* p[4] = {row_low + t.x.low[q] * channels, row_low + t.x.high[q] * channels,
                               row_high + t.x.low[q] * channels, row_high + t.x.high[q] * channels};
                for (int k = 0; k < 4; ++k) {
                  if (w[k] == 0.0f) continue;
                  float* dst = p[k];
                  const float wk = w[k];
                  for (int64_t c = 0; c < width_c; ++c) dst[c] += wk * g[c];
                }
              }
            }
          }
        }
      }
    };
    ParallelFor(context, num_blocks, batch * num_boxes * R * R * s * s * 8 * kBlock + 1000, work);
  }

 private:
  int num_levels_, num_base_, min_level_, sampling_ratio_;
  bool aligned_;
};

REGISTER_KERNEL_BUILDER(Name("MrcnnRoiAlign").Device(tensorflow::DEVICE_CPU), RoiAlignOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnRoiAlignGrad").Device(tensorflow::DEVICE_CPU), RoiAlignGradOp);

}  // namespace
}  // namespace mrcnn
