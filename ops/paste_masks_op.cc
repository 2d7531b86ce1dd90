// Mask pasting for evaluation, fused with COCO run-length encoding: each detection's mask resampled over
// the pixels of its box, thresholded, and emitted as the uncompressed RLE of the full-image mask.
//
// Twin: mrcnn_tf2/evaluation/coco_metrics.py encode_pasted_masks, i.e. mrcnn_tf2/ops/masks.py paste_masks
// (NumPy) of the transposed problem, then pycocotools' encode. This repeats the twin's rules and float
// operations (its pixel ranges in double, as Python computes them; the bilinear weights and products in
// float32, interpolated along x first, then y, as the transposed paste does), so the pixels and hence the
// runs are bit for bit the twin's. Only the box region is visited: the zeros around it are counted, not
// written, so a detection costs its box's area, not h * w.
//
// COCO RLE (pycocotools): the mask read in column-major (Fortran) order as alternating run lengths,
// starting with a run of 0s (of length 0 when the first pixel is 1).
//
// Glossary: D detections, R mask side, h x w image.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace mrcnn {
namespace {

// masks.py _MIN_EXTENT.
constexpr double kMinExtent = 1e-6;

REGISTER_OP("MrcnnPasteMasksRle")
    .Input("masks: float")       // [D, R, R] probabilities relative to their box
    .Input("boxes: float")       // [D, 4] [ymin, xmin, ymax, xmax] in target-image pixels
    .Output("counts: uint32")    // [total runs] every detection's run lengths, one after another
    .Output("row_splits: int64")  // [D + 1] detection d's runs are counts[row_splits[d]:row_splits[d + 1]]
    .Attr("height: int >= 0")
    .Attr("width: int >= 0")
    .Attr("threshold: float")  // a pixel is 1 where its probability >= threshold
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      shape_inference::DimensionHandle splits;
      TF_RETURN_IF_ERROR(c->Add(c->Dim(c->input(1), 0), 1, &splits));
      c->set_output(1, c->Vector(splits));
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
      w_low[p] = 1.0f - frac;
      w_high[p] = frac;
    }
  }
};

// Appends the run lengths of a 0/1 pixel sequence fed to it in order, in COCO's form.
class RunWriter {
 public:
  explicit RunWriter(std::vector<uint32_t>* counts) : counts_(counts) {}

  // Appends `length` pixels of value `bit`.
  void Push(bool bit, int64_t length) {
    if (length == 0) return;
    if (bit != value_) Flip();
    run_ += length;
  }

  // Appends the pixels bits[0 .. n) (each 0 or 1). memchr (vectorised) finds where each run ends.
  void Push(const uint8_t* bits, int64_t n) {
    int64_t p = 0;
    while (p < n) {
      const void* other = std::memchr(bits + p, value_ ? 0 : 1, n - p);
      const int64_t stop = other == nullptr ? n : static_cast<const uint8_t*>(other) - bits;
      run_ += stop - p;
      if (stop < n) Flip();
      p = stop;
    }
  }

  // Ends the last run (a mask of 0 pixels gives the single run 0, as pycocotools does).
  void Finish() { counts_->push_back(static_cast<uint32_t>(run_)); }

 private:
  // Ends the current run (of length 0 when the mask starts with a 1) and starts one of the other value.
  void Flip() {
    counts_->push_back(static_cast<uint32_t>(run_));
    run_ = 0;
    value_ = !value_;
  }

  std::vector<uint32_t>* counts_;
  bool value_ = false;  // runs start with 0s
  int64_t run_ = 0;
};

class PasteMasksRleOp : public OpKernel {
 public:
  explicit PasteMasksRleOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("height", &height_));
    OP_REQUIRES_OK(context, context->GetAttr("width", &width_));
    OP_REQUIRES_OK(context, context->GetAttr("threshold", &threshold_));
    // pycocotools holds run lengths as 32-bit unsigned ints.
    OP_REQUIRES(context, width_ == 0 || height_ <= std::numeric_limits<uint32_t>::max() / width_,
                InvalidArgument("COCO RLE needs height x width < 2^32, got ", height_, " x ", width_));
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

    // Pixel ranges first (cheap, serial): the regions' mean area sizes the shards.
    std::vector<AxisWeights> ys(num), xs(num);
    int64_t total_area = 0;
    for (int64_t d = 0; d < num; ++d) {
      ys[d].Compute(box(d, 0), box(d, 2), R, height_);
      xs[d].Compute(box(d, 1), box(d, 3), R, width_);
      total_area += ys[d].count * xs[d].count;
    }
    const float* mask_data = masks.flat<float>().data();
    std::vector<std::vector<uint32_t>> runs(num);

    auto work = [&](int64_t begin, int64_t end) {
      std::vector<float> cols_by_mask;  // the mask interpolated at each box column: [cols, R]
      std::vector<uint8_t> bits;        // one box column, thresholded: [rows]
      for (int64_t d = begin; d < end; ++d) {
        const AxisWeights &y = ys[d], &x = xs[d];
        const float* mask = mask_data + d * R * R;
        cols_by_mask.resize(x.count * R);
        for (int64_t q = 0; q < x.count; ++q) {
          float* col = cols_by_mask.data() + q * R;
          for (int k = 0; k < R; ++k) {
            col[k] = mask[k * R + x.low[q]] * x.w_low[q] + mask[k * R + x.high[q]] * x.w_high[q];
          }
        }
        bits.resize(y.count);
        // Plain pointers and locals: stores through uint8_t* may alias anything, so the compiler would
        // otherwise reload the vectors' data pointers and the threshold for every pixel.
        const int *low = y.low.data(), *high = y.high.data();
        const float *w_low = y.w_low.data(), *w_high = y.w_high.data();
        const float threshold = threshold_;
        uint8_t* column_bits = bits.data();
        // An empty box (no rows or no columns) comes out as the twin's all-zero mask: one run of h * w.
        const int64_t below = height_ - y.first - y.count;
        RunWriter writer(&runs[d]);
        writer.Push(false, x.first * height_);  // the columns left of the box
        for (int64_t q = 0; q < x.count; ++q) {
          const float* col = cols_by_mask.data() + q * R;
          for (int64_t p = 0; p < y.count; ++p) {
            column_bits[p] = col[low[p]] * w_low[p] + col[high[p]] * w_high[p] >= threshold;
          }
          writer.Push(false, y.first);
          writer.Push(column_bits, y.count);
          writer.Push(false, below);
        }
        writer.Push(false, (width_ - x.first - x.count) * height_);  // the columns right of the box
        writer.Finish();
      }
    };
    ParallelFor(context, num, 20 * (total_area / std::max<int64_t>(num, 1)) + 1000, work);

    Tensor* row_splits = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({num + 1}), &row_splits));
    auto splits = row_splits->vec<int64_t>();
    splits(0) = 0;
    for (int64_t d = 0; d < num; ++d) splits(d + 1) = splits(d) + static_cast<int64_t>(runs[d].size());
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({splits(num)}), &counts));
    uint32_t* out = counts->flat<uint32_t>().data();
    for (int64_t d = 0; d < num; ++d) std::copy(runs[d].begin(), runs[d].end(), out + splits(d));
  }

 private:
  int64_t height_, width_;
  float threshold_;
};

REGISTER_KERNEL_BUILDER(Name("MrcnnPasteMasksRle").Device(tensorflow::DEVICE_CPU), PasteMasksRleOp);

}  // namespace
}  // namespace mrcnn
