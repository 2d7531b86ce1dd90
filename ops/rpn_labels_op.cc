// RPN anchor labels of one image, fused: anchor/GT IoU, max and forced matches, and the subsampling.
//
// Twin: the matching and sampling of mrcnn_tf2/ops/anchors.py rpn_targets. The randomness stays in
// TensorFlow: the wrapper draws the same per-anchor keys as the twin (tf.random.stateless_uniform with
// the example's seed) and passes them in, and the sampling here picks the candidates with the largest
// keys, ties to the lower index like top_k, so the same seed gives the same labels. The IoU repeats
// anchors._grid_iou's float operations (anchor area from the grid's first row and column) so that the
// threshold comparisons decide exactly as the twin's.
//
// Glossary: M anchors of all levels, K ground-truth boxes, A anchors per location.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace mrcnn {
namespace {

// anchors.RPN_POSITIVE / RPN_NEGATIVE / RPN_IGNORE.
constexpr int32_t kPositive = 1, kNegative = 0, kIgnore = -1;

REGISTER_OP("MrcnnRpnLabels")
    .Input("anchors: num_levels * float")  // each [H_l * W_l * A, 4] from anchors.generate_anchors
    .Input("gt_boxes: float")              // [K, 4], padded rows all -1 (anywhere)
    .Input("keys: float")                  // [M] uniform random sampling keys in [0, 1)
    .Output("labels: int32")               // [M] RPN_POSITIVE / RPN_NEGATIVE / RPN_IGNORE
    .Output("positive_indices: int32")     // [P] sampled positives, by descending key
    .Attr("num_levels: int >= 1")
    .Attr("grid_heights: list(int)")
    .Attr("grid_widths: list(int)")
    .Attr("positive_overlap: float")
    .Attr("negative_overlap: float")
    .Attr("max_positives: int >= 0")
    .Attr("batch_size_per_im: int >= 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(c->num_inputs() - 1));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return Status();
    });

class RpnLabelsOp : public OpKernel {
 public:
  explicit RpnLabelsOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("grid_heights", &grid_heights_));
    OP_REQUIRES_OK(context, context->GetAttr("grid_widths", &grid_widths_));
    OP_REQUIRES_OK(context, context->GetAttr("positive_overlap", &positive_overlap_));
    OP_REQUIRES_OK(context, context->GetAttr("negative_overlap", &negative_overlap_));
    OP_REQUIRES_OK(context, context->GetAttr("max_positives", &max_positives_));
    OP_REQUIRES_OK(context, context->GetAttr("batch_size_per_im", &batch_size_per_im_));
  }

  void Compute(OpKernelContext* context) override {
    OpInputList anchors;
    OP_REQUIRES_OK(context, context->input_list("anchors", &anchors));
    const int num_levels = anchors.size();
    const Tensor& gt_boxes = context->input(num_levels);
    const Tensor& keys = context->input(num_levels + 1);
    OP_REQUIRES(context, grid_heights_.size() == num_levels && grid_widths_.size() == num_levels,
                InvalidArgument("grid_heights and grid_widths need one entry per level"));
    OP_REQUIRES(context, gt_boxes.dims() == 2 && gt_boxes.dim_size(1) == 4,
                InvalidArgument("gt_boxes must be [K, 4], got ", gt_boxes.shape().DebugString()));
    // Level offsets in the concatenated anchor order, and each level's per-location anchor count.
    std::vector<int64_t> offsets(num_levels + 1, 0);
    std::vector<int64_t> per_location(num_levels);
    for (int l = 0; l < num_levels; ++l) {
      const int64_t cells = int64_t(grid_heights_[l]) * grid_widths_[l];
      OP_REQUIRES(context, anchors[l].dims() == 2 && anchors[l].dim_size(1) == 4 && cells > 0 &&
                               anchors[l].dim_size(0) % cells == 0 && anchors[l].dim_size(0) > 0,
                  InvalidArgument("anchors of level ", l, " do not form its ", grid_heights_[l], "x",
                                  grid_widths_[l], " grid"));
      per_location[l] = anchors[l].dim_size(0) / cells;
      offsets[l + 1] = offsets[l] + anchors[l].dim_size(0);
    }
    const int64_t num_anchors = offsets[num_levels];
    OP_REQUIRES(context, keys.dims() == 1 && keys.dim_size(0) == num_anchors,
                InvalidArgument("keys must be [M] with M = ", num_anchors, ", got ", keys.shape().DebugString()));

    // Real ground truth only (box_ops.is_padding: largest coordinate < 0), as columns; area as box_area.
    std::vector<float> g_ymin, g_xmin, g_ymax, g_xmax, g_area;
    const auto gt = gt_boxes.matrix<float>();
    for (int64_t k = 0; k < gt_boxes.dim_size(0); ++k) {
      if (std::max(std::max(gt(k, 0), gt(k, 1)), std::max(gt(k, 2), gt(k, 3))) < 0.0f) continue;
      g_ymin.push_back(gt(k, 0));
      g_xmin.push_back(gt(k, 1));
      g_ymax.push_back(gt(k, 2));
      g_xmax.push_back(gt(k, 3));
      g_area.push_back(std::max(gt(k, 2) - gt(k, 0), 0.0f) * std::max(gt(k, 3) - gt(k, 1), 0.0f));
    }
    const int64_t K = g_area.size();

    // anchors._grid_iou's factorisation: an anchor's y-extent depends on its row and anchor index only
    // (taken from column 0), its x-extent on its column and anchor index (from row 0), and its area is
    // the grid's first cell's. Per level: inter_h [H, A, K], inter_w [W, A, K], area_sum [A, K].
    struct LevelTables {
      std::vector<float> inter_h, inter_w, area_sum;
    };
    std::vector<LevelTables> tables(num_levels);
    for (int l = 0; l < num_levels; ++l) {
      const int64_t H = grid_heights_[l], W = grid_widths_[l], A = per_location[l];
      const auto box = anchors[l].matrix<float>();  // row (i * W + j) * A + a
      LevelTables& t = tables[l];
      t.inter_h.resize(H * A * K);
      t.inter_w.resize(W * A * K);
      t.area_sum.resize(A * K);
      for (int64_t i = 0; i < H; ++i) {
        for (int64_t a = 0; a < A; ++a) {
          const int64_t row = i * W * A + a;
          for (int64_t k = 0; k < K; ++k) {
            t.inter_h[(i * A + a) * K + k] =
                std::max(std::min(box(row, 2), g_ymax[k]) - std::max(box(row, 0), g_ymin[k]), 0.0f);
          }
        }
      }
      for (int64_t j = 0; j < W; ++j) {
        for (int64_t a = 0; a < A; ++a) {
          const int64_t row = j * A + a;
          for (int64_t k = 0; k < K; ++k) {
            t.inter_w[(j * A + a) * K + k] =
                std::max(std::min(box(row, 3), g_xmax[k]) - std::max(box(row, 1), g_xmin[k]), 0.0f);
          }
        }
      }
      for (int64_t a = 0; a < A; ++a) {
        const float anchor_area = (box(a, 2) - box(a, 0)) * (box(a, 3) - box(a, 1));
        for (int64_t k = 0; k < K; ++k) t.area_sum[a * K + k] = anchor_area + g_area[k];
      }
    }
    // Work units are grid rows of every level, (level, i), in anchor order.
    std::vector<std::pair<int, int64_t>> rows;
    for (int l = 0; l < num_levels; ++l) {
      for (int64_t i = 0; i < grid_heights_[l]; ++i) rows.emplace_back(l, i);
    }
    const int64_t num_rows = rows.size();
    // Most anchor/GT pairs do not intersect and have IoU exactly 0, which changes neither a maximum
    // (all IoUs are >= 0) nor a forced match (its threshold is > 0). So each grid row visits only the GT
    // boxes its y-extents overlap ("active", from inter_h), and for each only the columns its x-extents
    // overlap (a contiguous range per level and GT, from inter_w).
    std::vector<std::vector<int32_t>> active(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int l = rows[r].first;
      const int64_t i = rows[r].second, A = per_location[l];
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t a = 0; a < A; ++a) {
          if (tables[l].inter_h[(i * A + a) * K + k] > 0.0f) {
            active[r].push_back(k);
            break;
          }
        }
      }
    }
    std::vector<std::vector<std::pair<int64_t, int64_t>>> columns(num_levels);  // [l][k] = [first, end)
    for (int l = 0; l < num_levels; ++l) {
      const int64_t W = grid_widths_[l], A = per_location[l];
      columns[l].assign(K, {0, 0});
      for (int64_t k = 0; k < K; ++k) {
        int64_t first = W, end = 0;
        for (int64_t j = 0; j < W; ++j) {
          for (int64_t a = 0; a < A; ++a) {
            if (tables[l].inter_w[(j * A + a) * K + k] > 0.0f) {
              first = std::min(first, j);
              end = j + 1;
            }
          }
        }
        if (first < end) columns[l][k] = {first, end};
      }
    }
    // IoU of anchor (i, j, a) of level l with GT k: divide_no_nan(intersection, area_sum - intersection).
    auto iou = [&](const LevelTables& t, int64_t i, int64_t j, int64_t a, int64_t A, int64_t k) {
      const float intersection = t.inter_h[(i * A + a) * K + k] * t.inter_w[(j * A + a) * K + k];
      const float denominator = t.area_sum[a * K + k] - intersection;
      return denominator == 0.0f ? 0.0f : intersection / denominator;
    };
    const int64_t cost = 100 * (1 + K);  // per row; only a guide for how finely Shard splits

    // Pass 1: each GT's best IoU over all anchors. Each row reduces into its own slot, then the slots
    // are combined: no shared writes.
    std::vector<float> row_best(num_rows * K, 0.0f);
    ParallelFor(context, num_rows, cost, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int l = rows[r].first;
        const int64_t i = rows[r].second, A = per_location[l];
        for (int32_t k : active[r]) {
          float best = 0.0f;
          for (int64_t j = columns[l][k].first; j < columns[l][k].second; ++j) {
            for (int64_t a = 0; a < A; ++a) best = std::max(best, iou(tables[l], i, j, a, A, k));
          }
          row_best[r * K + k] = best;
        }
      }
    });
    // GT that overlaps no anchor forces nothing: its threshold is unreachable.
    std::vector<float> force_threshold(K, std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < K; ++k) {
      float best = 0.0f;
      for (int64_t r = 0; r < num_rows; ++r) best = std::max(best, row_best[r * K + k]);
      if (best > 0.0f) force_threshold[k] = best;
    }

    // Pass 2: per anchor, positive (max IoU >= positive_overlap or a forced best match) or negative.
    // A row's anchors are contiguous in the global order; the twin's appended empty GT box gives every
    // anchor a max IoU of at least 0.
    std::vector<char> positive(num_anchors), negative(num_anchors);
    ParallelFor(context, num_rows, cost, [&](int64_t begin, int64_t end) {
      std::vector<float> max_iou;
      std::vector<char> forced;
      for (int64_t r = begin; r < end; ++r) {
        const int l = rows[r].first;
        const int64_t i = rows[r].second, A = per_location[l], W = grid_widths_[l];
        max_iou.assign(W * A, 0.0f);
        forced.assign(W * A, 0);
        for (int32_t k : active[r]) {
          for (int64_t j = columns[l][k].first; j < columns[l][k].second; ++j) {
            for (int64_t a = 0; a < A; ++a) {
              const float value = iou(tables[l], i, j, a, A, k);
              max_iou[j * A + a] = std::max(max_iou[j * A + a], value);
              forced[j * A + a] |= value >= force_threshold[k];
            }
          }
        }
        const int64_t row_start = offsets[l] + i * W * A;
        for (int64_t n = 0; n < W * A; ++n) {
          const bool is_positive = max_iou[n] >= positive_overlap_ || forced[n];
          positive[row_start + n] = is_positive;
          negative[row_start + n] = max_iou[n] < negative_overlap_ && !is_positive;
        }
      }
    });

    // anchors._sample: the candidates with the largest keys, ties to the lower index (top_k's order).
    const float* key = keys.flat<float>().data();
    auto sample = [&](const std::vector<char>& candidates, int64_t count) {
      std::vector<int32_t> chosen;
      for (int64_t m = 0; m < num_anchors; ++m) {
        if (candidates[m]) chosen.push_back(m);
      }
      count = std::min<int64_t>(count, chosen.size());
      auto before = [&](int32_t a, int32_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); };
      std::partial_sort(chosen.begin(), chosen.begin() + count, chosen.end(), before);
      chosen.resize(count);
      return chosen;
    };
    const std::vector<int32_t> positives = sample(positive, max_positives_);
    const int64_t num_negatives = std::max<int64_t>(batch_size_per_im_ - int64_t(positives.size()), 0);
    const std::vector<int32_t> negatives = sample(negative, num_negatives);

    Tensor *labels = nullptr, *positive_indices = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({num_anchors}), &labels));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({int64_t(positives.size())}), &positive_indices));
    auto label = labels->flat<int32_t>();
    for (int64_t m = 0; m < num_anchors; ++m) label(m) = kIgnore;
    for (int32_t m : negatives) label(m) = kNegative;
    for (int32_t m : positives) label(m) = kPositive;
    std::copy(positives.begin(), positives.end(), positive_indices->flat<int32_t>().data());
  }

 private:
  std::vector<int32_t> grid_heights_, grid_widths_;
  float positive_overlap_, negative_overlap_;
  int max_positives_, batch_size_per_im_;
};

REGISTER_KERNEL_BUILDER(Name("MrcnnRpnLabels").Device(tensorflow::DEVICE_CPU), RpnLabelsOp);

}  // namespace
}  // namespace mrcnn
