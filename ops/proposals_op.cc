// Region proposals per image, fused: per-level top-k, decode, clip, size filter, greedy NMS, merge.
//
// Twin: mrcnn_tf2/ops/roi_ops.py multilevel_propose_rois (its docstring states the rules). The tie-breaks
// are the twin's: top_k keeps the lower index first among equal values, so candidates are ranked by
// (value descending, index ascending), and the final merge ranks by (score, concatenated slot). NMS
// uses the IoU formula of tf.image.non_max_suppression_padded (epsilon 1e-8 in the union) and suppresses
// at IoU >= threshold, which is what that tiled algorithm computes for sorted input.
//
// Glossary: B batch, L levels, M_l anchors of level l, k_l = min(pre_nms_topn, M_l) candidates,
// N_l = min(k_l, post_nms_topn) proposals kept per level, P = post_nms_topn outputs.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common.h"

namespace mrcnn {
namespace {

// box_ops.BBOX_XFORM_CLIP = log(1000 / 16), as the float32 constant TF uses.
const float kBoxXformClip = static_cast<float>(std::log(1000.0 / 16.0));
// roi_ops: score of dropped (too small or empty) candidates; padding values of the outputs.
constexpr float kDroppedScore = -1.0f;
constexpr float kPaddingBox = -1.0f;
constexpr float kPaddingScore = 0.0f;
// The epsilon tf.image.non_max_suppression_padded adds to the union.
constexpr float kNmsEpsilon = 1e-8f;

REGISTER_OP("MrcnnProposeRois")
    .Input("logits: num_levels * float")   // each [B, M_l] objectness logits
    .Input("deltas: num_levels * float")   // each [B, M_l, 4] (dy, dx, dh, dw)
    .Input("anchors: num_levels * float")  // each [M_l, 4] [ymin, xmin, ymax, xmax]
    .Input("image_hw: float")              // [B, 2] valid image height and width
    .Output("rois: float")                 // [B, P, 4]
    .Output("roi_scores: float")           // [B, P]
    .Attr("num_levels: int >= 1")
    .Attr("pre_nms_topn: int >= 1")
    .Attr("post_nms_topn: int >= 1")
    .Attr("nms_threshold: float")
    .Attr("min_size: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int num_levels, post_nms_topn;
      TF_RETURN_IF_ERROR(c->GetAttr("num_levels", &num_levels));
      TF_RETURN_IF_ERROR(c->GetAttr("post_nms_topn", &post_nms_topn));
      shape_inference::ShapeHandle image_hw;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3 * num_levels), 2, &image_hw));
      c->set_output(0, c->MakeShape({c->Dim(image_hw, 0), post_nms_topn, 4}));
      c->set_output(1, c->MakeShape({c->Dim(image_hw, 0), post_nms_topn}));
      return Status();
    });

struct Box {
  float ymin, xmin, ymax, xmax;
};

// The proposals one level keeps for one image, in descending score order.
struct LevelResult {
  std::vector<Box> boxes;
  std::vector<float> scores;
};

// box_ops.decode_boxes with RPN_BOX_WEIGHTS (all 1), float op by float op.
inline Box Decode(const float* delta, const float* anchor) {
  const float dy = delta[0] / 1.0f, dx = delta[1] / 1.0f;
  const float dh = std::min(delta[2] / 1.0f, kBoxXformClip), dw = std::min(delta[3] / 1.0f, kBoxXformClip);
  const float ha = anchor[2] - anchor[0], wa = anchor[3] - anchor[1];
  const float yca = anchor[0] + 0.5f * ha, xca = anchor[1] + 0.5f * wa;
  const float yc = dy * ha + yca, xc = dx * wa + xca;
  const float h = std::exp(dh) * ha, w = std::exp(dw) * wa;
  return {yc - 0.5f * h, xc - 0.5f * w, yc + 0.5f * h, xc + 0.5f * w};
}

class ProposeRoisOp : public OpKernel {
 public:
  explicit ProposeRoisOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("pre_nms_topn", &pre_nms_topn_));
    OP_REQUIRES_OK(context, context->GetAttr("post_nms_topn", &post_nms_topn_));
    OP_REQUIRES_OK(context, context->GetAttr("nms_threshold", &nms_threshold_));
    OP_REQUIRES_OK(context, context->GetAttr("min_size", &min_size_));
  }

  void Compute(OpKernelContext* context) override {
    OpInputList logits, deltas, anchors;
    OP_REQUIRES_OK(context, context->input_list("logits", &logits));
    OP_REQUIRES_OK(context, context->input_list("deltas", &deltas));
    OP_REQUIRES_OK(context, context->input_list("anchors", &anchors));
    const int num_levels = logits.size();
    const Tensor& image_hw = context->input(3 * num_levels);
    OP_REQUIRES(context, image_hw.dims() == 2 && image_hw.dim_size(1) == 2,
                InvalidArgument("image_hw must be [B, 2], got ", image_hw.shape().DebugString()));
    const int64_t batch = image_hw.dim_size(0);
    for (int l = 0; l < num_levels; ++l) {
      const int64_t count = anchors[l].dim_size(0);
      OP_REQUIRES(context, anchors[l].dims() == 2 && anchors[l].dim_size(1) == 4 && logits[l].dims() == 2 &&
                               logits[l].dim_size(0) == batch && logits[l].dim_size(1) == count &&
                               deltas[l].dims() == 3 && deltas[l].dim_size(0) == batch &&
                               deltas[l].dim_size(1) == count && deltas[l].dim_size(2) == 4,
                  InvalidArgument("level ", l, ": logits [B, M], deltas [B, M, 4] and anchors [M, 4] disagree"));
    }

    // Stage 1, one unit per (image, level): independent, each writes its own LevelResult.
    std::vector<LevelResult> results(batch * num_levels);
    const float* hw = image_hw.flat<float>().data();
    auto level_work = [&](int64_t begin, int64_t end) {
      std::vector<int32_t> order;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / num_levels;
        const int l = unit % num_levels;
        ProposeLevel(logits[l].flat<float>().data() + b * logits[l].dim_size(1),
                     deltas[l].flat<float>().data() + b * logits[l].dim_size(1) * 4,
                     anchors[l].flat<float>().data(), logits[l].dim_size(1), hw[2 * b], hw[2 * b + 1], &order,
                     &results[unit]);
      }
    };
    ParallelFor(context, batch * num_levels, 200000, level_work);

    // Stage 2, per image: the best post_nms_topn over all levels; the rest is padding.
    Tensor *rois = nullptr, *roi_scores = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({batch, post_nms_topn_, 4}), &rois));
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({batch, post_nms_topn_}), &roi_scores));
    float* roi_data = rois->flat<float>().data();
    float* score_data = roi_scores->flat<float>().data();
    for (int64_t b = 0; b < batch; ++b) {
      // (level, slot) of every kept proposal in concatenation order, then a stable sort by score.
      std::vector<std::pair<int, int>> slots;
      for (int l = 0; l < num_levels; ++l) {
        for (int i = 0; i < results[b * num_levels + l].scores.size(); ++i) slots.emplace_back(l, i);
      }
      auto score = [&](const std::pair<int, int>& s) { return results[b * num_levels + s.first].scores[s.second]; };
      std::stable_sort(slots.begin(), slots.end(), [&](const auto& x, const auto& y) { return score(x) > score(y); });
      float* out_boxes = roi_data + b * post_nms_topn_ * 4;
      float* out_scores = score_data + b * post_nms_topn_;
      for (int n = 0; n < post_nms_topn_; ++n) {
        if (n < slots.size()) {
          const Box& box = results[b * num_levels + slots[n].first].boxes[slots[n].second];
          out_boxes[4 * n] = box.ymin;
          out_boxes[4 * n + 1] = box.xmin;
          out_boxes[4 * n + 2] = box.ymax;
          out_boxes[4 * n + 3] = box.xmax;
          out_scores[n] = score(slots[n]);
        } else {
          std::fill(out_boxes + 4 * n, out_boxes + 4 * n + 4, kPaddingBox);
          out_scores[n] = kPaddingScore;
        }
      }
    }
  }

 private:
  // roi_ops._propose_level for one image: top-k, decode, clip, size filter, greedy NMS.
  void ProposeLevel(const float* logits, const float* deltas, const float* anchors, int64_t count, float height,
                    float width, std::vector<int32_t>* order, LevelResult* result) const {
    const int64_t k = std::min<int64_t>(pre_nms_topn_, count);
    const int64_t num_kept = std::min<int64_t>(k, post_nms_topn_);
    order->resize(count);
    std::iota(order->begin(), order->end(), 0);
    auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(order->begin(), order->begin() + k, order->end(), better);

    std::vector<Box> candidates(k);
    std::vector<char> alive(k);
    for (int64_t i = 0; i < k; ++i) {
      const int32_t a = (*order)[i];
      Box box = Decode(deltas + 4 * a, anchors + 4 * a);
      // box_ops.clip_boxes: min(max(v, 0), limit).
      box.ymin = std::min(std::max(box.ymin, 0.0f), height);
      box.xmin = std::min(std::max(box.xmin, 0.0f), width);
      box.ymax = std::min(std::max(box.ymax, 0.0f), height);
      box.xmax = std::min(std::max(box.xmax, 0.0f), width);
      const float side = std::min(box.ymax - box.ymin, box.xmax - box.xmin);
      alive[i] = side >= min_size_ && side > 0.0f;
      candidates[i] = box;
    }
    // Greedy NMS in score order; dropped candidates neither get selected nor suppress. The selected boxes
    // are kept as columns so that the IoU test against all of them vectorises; a candidate stops at the
    // first block of selected boxes that suppresses it.
    std::vector<float> sel_ymin, sel_xmin, sel_ymax, sel_xmax, sel_area;
    for (auto* column : {&sel_ymin, &sel_xmin, &sel_ymax, &sel_xmax, &sel_area}) column->reserve(num_kept);
    constexpr int kBlock = 32;
    for (int64_t i = 0; i < k && result->boxes.size() < num_kept; ++i) {
      if (!alive[i]) continue;
      const Box& c = candidates[i];
      const float area = (c.ymax - c.ymin) * (c.xmax - c.xmin);
      const int64_t count = sel_area.size();
      bool suppressed = false;
      for (int64_t start = 0; start < count && !suppressed; start += kBlock) {
        const int64_t stop = std::min<int64_t>(count, start + kBlock);
        int hits = 0;
        for (int64_t j = start; j < stop; ++j) {
          // NmsIou(selected j, candidate), spelled out on the columns.
          const float ymin = std::max(sel_ymin[j], c.ymin), xmin = std::max(sel_xmin[j], c.xmin);
          const float ymax = std::min(sel_ymax[j], c.ymax), xmax = std::min(sel_xmax[j], c.xmax);
          const float intersection = std::max(xmax - xmin, 0.0f) * std::max(ymax - ymin, 0.0f);
          const float iou = intersection / (sel_area[j] + area - intersection + kNmsEpsilon);
          hits += iou >= nms_threshold_;
        }
        suppressed = hits > 0;
      }
      if (suppressed) continue;
      result->boxes.push_back(c);
      sel_ymin.push_back(c.ymin);
      sel_xmin.push_back(c.xmin);
      sel_ymax.push_back(c.ymax);
      sel_xmax.push_back(c.xmax);
      sel_area.push_back(area);
      const float logit = logits[(*order)[i]];
      result->scores.push_back(1.0f / (1.0f + std::exp(-logit)));
    }
  }

  int pre_nms_topn_, post_nms_topn_;
  float nms_threshold_, min_size_;
};

REGISTER_KERNEL_BUILDER(Name("MrcnnProposeRois").Device(tensorflow::DEVICE_CPU), ProposeRoisOp);

}  // namespace
}  // namespace mrcnn
