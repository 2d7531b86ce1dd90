"""The package's configuration: typed, nested dataclasses with NVIDIA TF2 Mask R-CNN's defaults.

One `Config` holds every setting of a run. Leaf names are those of NVIDIA's `config.py` and of the
command-line flags, so a key reads the same in `--help`, `--print_config`, `--config_override` and
NVIDIA's documentation. The sub-configs mirror the package: `data` for the input pipeline, `model` (with
`anchors`, `rpn`, `roi`, `loss`, `test`) for the network, `train`, `eval`, `infer`, `export` and `runtime`
for the loops.

Only the factories and the runtime read this module; layers and ops take plain keyword arguments.
This module must not import TensorFlow: `--help` and `--print_config` stay fast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Optional

from mrcnn_tf2 import files

# The file in model_dir that holds a training run's resolved config; eval, infer, export and a resumed
# train start from it.
SAVED_CONFIG_FILE = "config.json"
# The file of a SavedModel directory (an export directory holds one).
SAVED_MODEL_FILE = "saved_model.pb"


def exported_files(directory: str) -> list:
    """The files of EXPORT_FILES that `directory` holds when it is an export directory (its config.json beside
    at least one of them, and no training checkpoint, ckpt-N.index), in EXPORT_FILES' order; else []."""
    if not os.path.isdir(directory):
        return []
    entries = os.listdir(directory)
    if SAVED_CONFIG_FILE not in entries or any(name.endswith(".index") for name in entries):
        return []
    return [name for name in EXPORT_FILES.values() if os.path.isfile(os.path.join(directory, name))]


# The 12 statistics of COCOeval.summarize(), in its order, of each of its iou types (evaluation/coco_metrics.py).
COCO_STATISTICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
COCO_IOU_TYPES = ("bbox", "segm")


class ConfigError(ValueError):
    """A setting is invalid. `key` names the flag or config key at fault, `message` what is wrong."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass
class DataConfig:
    """Input pipeline settings."""

    # Where the TFRecords live; the file patterns below default to files in it.
    data_dir: str = "/data"
    # Training / validation TFRecord globs; None means <data_dir>/train*.tfrecord, <data_dir>/val*.tfrecord.
    training_file_pattern: Optional[str] = None
    validation_file_pattern: Optional[str] = None
    # (height, width) of the padded network input; aspect-preserving resize fits the image inside it.
    image_size: tuple[int, int] = (832, 1344)
    # Random horizontal flip during training.
    augment_input_data: bool = True
    # Scale jitter in training (TF Model Garden's names): each image is resized by the resize rule's scale times
    # a factor drawn uniformly from [aug_scale_min, aug_scale_max], then cut at a random place to image_size
    # where it is larger; the objects cut off are left out. 1.0 and 1.0: none.
    aug_scale_min: float = 1.0
    aug_scale_max: float = 1.0
    # Repeat factor sampling (data/repeat_factors.py; detectron2's REPEAT_THRESHOLD, 0.001 for LVIS): the images of
    # categories in fewer than this fraction of the training images are repeated in training. None: none.
    repeat_threshold: Optional[float] = None
    # Side of the per-instance GT mask crop the pipeline hands to the mask-target op.
    gt_mask_size: int = 112
    # Ground truth is padded (with -1) to this many instances per image: TAO's default.
    max_num_instances: int = 200
    # Crowd regions carry no instance boundaries: they are dropped from training targets.
    skip_crowd_during_training: bool = True
    # Keep the category labels (False trains class-agnostic, every object class 1).
    use_category: bool = True
    # Repeat one real batch forever: measures the model without the input pipeline.
    use_synthetic_data: bool = False
    # Resize rule. None: the largest aspect-preserving size that fits image_size. An int: torchvision's rule,
    # shorter side to this, unless the longer side would exceed resize_max_size (then that binds).
    resize_min_size: Optional[int] = None
    resize_max_size: int = 1333
    # Padding of evaluation and inference batches. None: to image_size. An int: each batch to its largest
    # image, rounded up to a multiple of this (torchvision's size_divisible); the anchors then follow the
    # actual feature shapes. Training always pads to image_size (the input pipeline labels the anchors).
    pad_to_multiple: Optional[int] = None
    # JPEG decoding (tf.io.decode_jpeg's dct_method): "" TensorFlow's default, "INTEGER_ACCURATE" the
    # libjpeg-turbo ISLOW path that PIL (and so torchvision's data loading) decodes with.
    jpeg_dct_method: str = ""

    def resolved_training_pattern(self) -> str:
        return self.training_file_pattern or f"{self.data_dir.rstrip('/')}/train*.tfrecord"

    def resolved_validation_pattern(self) -> str:
        return self.validation_file_pattern or f"{self.data_dir.rstrip('/')}/val*.tfrecord"


@dataclass
class AnchorConfig:
    """Anchor grid over the FPN levels."""

    # FPN levels P2..P6 (strides 4..64).
    min_level: int = 2
    max_level: int = 6
    # Anchor sizes per level: anchor_scale * stride * 2**(i / num_scales), i < num_scales.
    num_scales: int = 1
    # (x, y) multipliers of the base size: square, wide and tall anchors.
    aspect_ratios: tuple[tuple[float, float], ...] = ((1.0, 1.0), (1.4, 0.7), (0.7, 1.4))
    # Base anchor side in units of the level's stride: 32 px on P2 up to 512 px on P6.
    anchor_scale: float = 8.0
    # Anchor centres at (i + anchor_offset) * stride; torchvision's are at i * stride (offset 0).
    anchor_offset: float = 0.5
    # Round the base anchors' corners to whole pixels, as torchvision's AnchorGenerator does.
    round_base_anchors: bool = False


@dataclass
class RPNConfig:
    """Region proposal network: anchor labelling and proposal generation."""

    # Anchors with IoU >= this to some GT are positive, < negative_overlap negative (Faster R-CNN).
    rpn_positive_overlap: float = 0.7
    rpn_negative_overlap: float = 0.3
    # Anchors sampled per image for the RPN loss, at most half of them positive.
    rpn_batch_size_per_im: int = 256
    rpn_fg_fraction: float = 0.5
    # Proposals smaller than this (pixels) are dropped; 0 keeps all.
    rpn_min_size: float = 0.0
    # Training: top-k per level before NMS, total kept after NMS, NMS IoU.
    train_rpn_pre_nms_topn: int = 2000
    train_rpn_post_nms_topn: int = 1000
    train_rpn_nms_threshold: float = 0.7
    # Inference counterparts (fewer proposals are enough at test time).
    test_rpn_pre_nms_topn: int = 1000
    test_rpn_post_nms_topn: int = 1000
    test_rpn_nms_thresh: float = 0.7


@dataclass
class RoIConfig:
    """Sampling of RoIs for the box and mask heads during training."""

    # RoIs per image fed to the heads, at most a quarter of them foreground.
    batch_size_per_im: int = 512
    fg_fraction: float = 0.25
    # Foreground: IoU >= fg_thresh; background: bg_thresh_lo <= IoU < bg_thresh_hi.
    fg_thresh: float = 0.5
    bg_thresh_hi: float = 0.5
    bg_thresh_lo: float = 0.0


@dataclass
class LossConfig:
    """Weights of the loss terms (the classification terms have weight 1)."""

    rpn_box_loss_weight: float = 1.0
    fast_rcnn_box_loss_weight: float = 1.0
    mrcnn_weight_loss_mask: float = 1.0


@dataclass
class TestConfig:
    """Detection post-processing at inference."""

    # Detections kept per image after per-class NMS at test_nms IoU.
    test_detections_per_image: int = 100
    test_nms: float = 0.5
    # Candidates scoring <= this are dropped before NMS.
    test_score_threshold: float = 0.05
    # Detections (in input pixels) narrower or lower than this are dropped before NMS; 0 drops empty ones.
    test_min_box_size: float = 0.0
    # How a 28x28 mask becomes an image mask: "exact" resamples it over its box (pixel centres, >= 0.5);
    # "torchvision" as torchvision's paste_masks_in_image (28 -> 30 padding, integer box, > 0.5).
    mask_paste: str = "exact"


@dataclass
class ModelConfig:
    """The network and its non-learned stages."""

    backbone: str = "resnet50"
    # COCO's 90 category ids plus background, as NVIDIA trains it.
    num_classes: int = 91
    # Batch norm uses its moving statistics and fixed affine in training (small per-device batches).
    # None: frozen when pretrained weights are loaded, trained (batch statistics) from scratch, where a
    # frozen batch norm is the identity and a deep ResNet's activations explode (Config.resolved).
    freeze_bn: Optional[bool] = None
    # Block groups whose weights stay fixed: 0 = stem, 1 = first residual group (conv2_x).
    # None: (0, 1) when pretrained weights are loaded, none from scratch (random features are no prior).
    freeze_blocks: Optional[tuple[int, ...]] = None
    # ResNet v1 (stride in the first 1x1 conv of a block, as keras.applications' ImageNet weights) instead
    # of v1.5 (stride in the 3x3); a converted pretrained backbone sets what it needs (see weights/).
    stride_in_1x1: bool = False
    # Build the mask branch (False gives Faster R-CNN).
    include_mask: bool = True
    # Width of the FPN maps (and so of the RPN head and the RoI features); a CPU-sized model may narrow it.
    fpn_num_filters: int = 256
    # Normalisation after the FPN's convs, "none" or "batch" (torchvision's maskrcnn_resnet50_fpn_v2). Batch
    # norm in the FPN and heads trains with batch statistics, per Horovod rank, whatever freeze_bn says (which
    # is the backbone's), as torchvision's v2 trains them (model.backbone.conv_layer).
    fpn_norm: str = "none"
    # 3x3 convs of the RPN head: 1 as in Mask R-CNN, 2 in torchvision's v2.
    rpn_head_num_convs: int = 1
    # Width of the box head's fully connected layers.
    fast_rcnn_mlp_head_dim: int = 1024
    # Fully connected layers of the box head, 1 or 2: Mask R-CNN's two, torchvision's v2 one after its convs.
    fast_rcnn_num_fcs: int = 2
    # 3x3 convs of the box head before its fully connected layers, and their width: none in Mask R-CNN, four
    # of 256 in torchvision's v2.
    fast_rcnn_num_convs: int = 0
    fast_rcnn_conv_dim: int = 256
    # Normalisation after the box head's convs, "none" or "batch" (torchvision's v2).
    fast_rcnn_norm: str = "none"
    # Width of the mask head's 3x3 convs and its transposed conv.
    mrcnn_head_num_filters: int = 256
    # Normalisation after the mask head's 3x3 convs, "none" or "batch" (torchvision's v2).
    mrcnn_head_norm: str = "none"
    # Side of the predicted masks.
    mrcnn_resolution: int = 28
    # RoIAlign's sampling grid: True shifts boxes by half a cell (Detectron2 / torchvision aligned=True);
    # False is the original Mask R-CNN's (torchvision's Mask R-CNN weights are trained with it).
    roi_align_aligned: bool = True
    # Scales of the (dy, dx, dh, dw) targets of the box head.
    bbox_reg_weights: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    rpn: RPNConfig = field(default_factory=RPNConfig)
    roi: RoIConfig = field(default_factory=RoIConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    test: TestConfig = field(default_factory=TestConfig)

    @property
    def num_anchors(self) -> int:
        """Anchors per feature-map cell."""
        return self.anchors.num_scales * len(self.anchors.aspect_ratios)


@dataclass
class TrainConfig:
    """Optimisation: schedule, batch, regularisation, initialisation."""

    epochs: int = 12
    # None: counted from the records in the training files.
    steps_per_epoch: Optional[int] = None
    # Images per device and step.
    train_batch_size: int = 4
    # Batches whose gradients are summed before one optimizer update.
    accumulate_steps: int = 1
    # Linear warm-up from init_learning_rate to learning_rate_values[0] until learning_rate_boundaries[0]
    # epochs (but at least warmup_min_steps updates), then learning_rate_values[i] from
    # learning_rate_boundaries[i] epochs on. The rates are those of a global batch (images per update over
    # all workers and accumulated batches) of learning_rate_batch_size images and scale linearly with it:
    # NVIDIA's 1e-2 at 8 images is their 0.04 at 8 GPUs x 4 images, and detectron2's and torchvision's 0.02
    # at 16 (runtime/schedule.py).
    init_learning_rate: float = 0.0
    learning_rate_values: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
    learning_rate_boundaries: tuple[float, ...] = (0.3, 8.0, 10.0)
    learning_rate_batch_size: int = 8
    # One of LEARNING_RATE_SCHEDULES. piecewise: the above. cosine: the same warm-up, then half a cosine from
    # learning_rate_values[0] down to learning_rate_values[-1] at the run's last update (epochs); the other
    # boundaries and values are unused.
    learning_rate_schedule: str = "piecewise"
    # A floor on the warm-up in updates, so that a small data set (or a benchmark's short epoch) still
    # ramps up gently from random weights; later boundaries still apply at their epochs.
    warmup_min_steps: int = 500
    # Keep an exponential moving average of the weights, of this decay (e.g. 0.9998), which evaluation, inference,
    # export and --init_checkpoint then use (runtime/weight_average.py); None: none.
    ema_decay: Optional[float] = None
    # Clip the gradients to this global norm (after averaging over workers, unscaled); None: no clipping.
    clip_grad_norm: Optional[float] = None
    momentum: float = 0.9
    # L2 penalty on convolution and dense kernels (not batch norm, not biases).
    l2_weight_decay: float = 1e-4
    # ImageNet-pretrained backbone checkpoint (see weights/); None trains from scratch.
    backbone_checkpoint: Optional[str] = None
    # A training checkpoint (a model_dir, meaning its newest one, or a checkpoint prefix) whose model weights
    # a new run starts from: fine-tuning, where the optimizer, the step and the schedule start fresh and the
    # class layers are reinitialised when num_classes differs. A run that resumes ignores it. None: unused.
    init_checkpoint: Optional[str] = None
    # Seeds Python, NumPy and TF; None leaves runs non-deterministic.
    seed: Optional[int] = None


@dataclass
class EvalConfig:
    """Evaluation and early stopping."""

    # COCO annotation JSON of the validation images.
    eval_file: Optional[str] = None
    eval_batch_size: int = 8
    # Number of validation images to evaluate; None evaluates all.
    eval_samples: Optional[int] = None
    # Training evaluates every this many epochs (and after its last step whenever eval_file is given);
    # None: only after the last step, or every epoch when a min_*_map asks to stop early.
    eval_every_epochs: Optional[int] = None
    # Training stops once every given COCO AP is reached, checked at each evaluation (None: no target).
    min_bbox_map: Optional[float] = None
    min_mask_map: Optional[float] = None
    # Training keeps the checkpoint whose evaluation scored highest on this statistic in <model_dir>/best, a model
    # directory of its own ('<bbox or segm>/<one of COCO_STATISTICS>'; None: none kept).
    best_metric: Optional[str] = "bbox/AP"
    # Where training keeps a moving average of the weights (train.ema_decay): evaluation, inference and export
    # read it (True), or the last step's weights (False: what the average gains, measured on one checkpoint);
    # training's own evaluations, and so best/, follow it. --init_checkpoint reads the average either way.
    use_ema: bool = True

    def resolved_eval_every_epochs(self) -> Optional[int]:
        """Epochs between evaluations during training; None evaluates only after the last step."""
        if self.eval_every_epochs is None and (self.min_bbox_map is not None or self.min_mask_map is not None):
            return 1  # an early stop needs evaluations before the end
        return self.eval_every_epochs


@dataclass
class InferConfig:
    """`main.py infer`: what to run on, where the predictions and pictures go."""

    # An image file, a folder or a glob of image files (infer.IMAGE_EXTENSIONS); None: the validation TFRecords.
    input: Optional[str] = None
    # Where predictions.json (and the PNGs) go; None: <model_dir>/inference.
    output_dir: Optional[str] = None
    # Also draw masks, boxes, class names and scores on each image, as PNGs in output_dir.
    visualize: bool = False
    # JSON {"category id": "name"} naming the classes in the pictures; None: eval_file's category names
    # when given, else the ids.
    label_map: Optional[str] = None
    # Detections scoring below this are not drawn (all are written to predictions.json).
    visualize_score_threshold: float = 0.5
    # A TrueType / OpenType font file for the pictures' labels; None: Pillow's built-in font, whose glyphs are
    # ASCII only (class names in other scripts need a font that has them, e.g. Noto Sans CJK).
    visualize_font: Optional[str] = None
    # An exported artefact (model.onnx, model.tflite, openvino/model.xml, or an export directory's SavedModel) that
    # infer and eval run in its runtime instead of model_dir's newest checkpoint; model_dir defaults to its
    # directory.
    exported: Optional[str] = None
    # A training checkpoint that eval, infer and export read instead of model_dir's newest: its prefix (e.g.
    # runs/m/ckpt-600; model_dir defaults to its directory) or a step number of model_dir's checkpoints.
    checkpoint: Optional[str] = None

    def resolved_output_dir(self, model_dir: str) -> str:
        return self.output_dir or f"{model_dir.rstrip('/')}/inference"

    def resolved_checkpoint(self, model_dir: str) -> Optional[str]:
        """The prefix of `checkpoint` (a step number N is model_dir's ckpt-N); None when none is chosen."""
        if self.checkpoint is None:
            return None
        return os.path.join(model_dir, f"ckpt-{self.checkpoint}") if self.checkpoint.isdigit() else self.checkpoint


@dataclass
class ExportConfig:
    """`main.py export`: which artefacts, and the directory they go to."""

    # None: <model_dir>/saved_model.
    export_dir: Optional[str] = None
    # Any of EXPORT_FORMATS (mrcnn_tf2.runtime.deploy tells what each writes).
    formats: tuple[str, ...] = ("saved_model",)
    # openvino_int8's calibration images: an image file, folder or glob of image files; None: the validation
    # TFRecords (data.validation_file_pattern).
    calibration: Optional[str] = None
    # How many of them (at most).
    calibration_images: int = 100

    def resolved_export_dir(self, model_dir: str) -> str:
        return self.export_dir or f"{model_dir.rstrip('/')}/saved_model"


@dataclass
class RuntimeConfig:
    """Where outputs go, how the step is compiled, what is logged and measured."""

    model_dir: str = "/results"
    # Mixed precision in the dtype of amp_dtype.
    amp: bool = False
    # auto: float16 (loss-scaled) on a GPU; bfloat16 on a CPU with bfloat16 instructions, else float32 (warned).
    amp_dtype: str = "auto"
    # XLA-compile the learned layers (backbone, FPN, heads); the non-learned stages and custom ops run between.
    # Also under eagerly: each layer is its own compiled function, not part of the traced step.
    xla: bool = False
    # Debugging: the train and predict steps run op by op, without tf.function (the xla layers stay compiled).
    eagerly: bool = False
    # Fused C++ ops (CPU kernels only): auto uses them when built, on requires them, off uses the pure-TF
    # twins. On a GPU, auto keeps them out of the model (cuDNN convs, pure-TF stages) and uses them only in
    # the input pipeline and the mask encoding, which run on the host; on is an error there
    # (model.factory.choose_ops, which also picks the convs' CPU routes on a CPU).
    custom_ops: str = "auto"
    # JSON-lines log; None writes <model_dir>/log.jsonl.
    log_file: Optional[str] = None
    log_every: int = 100
    # Steps excluded from throughput figures (tracing, allocator warm-up).
    log_warmup_steps: int = 100
    # Training writes the traced update step's graph to log_tensorboard (None: <model_dir>/tensorboard) before
    # the first step; under eagerly there is no traced step, and a warning says so.
    log_graph: bool = False
    # Directory for TensorBoard summaries; None writes none.
    log_tensorboard: Optional[str] = None
    # TensorFlow's own log shown: C++ INFO/WARNING (TF_CPP_MIN_LOG_LEVEL=0 unless set), start-up lines, Python
    # logger at INFO (cli.import_tensorflow).
    verbose: bool = False
    # Steps between checkpoints (one is also written at each epoch end and when training ends).
    checkpoint_every: int = 1000
    # Checkpoints kept in model_dir; older ones are deleted.
    keep_checkpoints: int = 5
    # Measure throughput for benchmark_steps steps after log_warmup_steps, then stop.
    benchmark: bool = False
    benchmark_steps: int = 100
    # Train even though <model_dir>/train.lock names a trainer on another host (which this one cannot see
    # running), or is not a lock; never breaks the lock of a live trainer of this host (runtime.model_dir_lock).
    break_lock: bool = False


@dataclass
class Config:
    """Every setting of a run, resolved from defaults, flags and overrides (in that order), then the rules of
    the settings left to None (`resolved`)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    infer: InferConfig = field(default_factory=InferConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def pretrained(self) -> bool:
        """True when a run starts from pretrained weights: an ImageNet backbone (--backbone_checkpoint) or
        the model weights of a training checkpoint (--init_checkpoint)."""
        return self.train.backbone_checkpoint is not None or self.train.init_checkpoint is not None

    def resolved(self) -> "Config":
        """A copy with every setting left to its rule (None) filled in; resolved configs are unchanged.

        freeze_bn and freeze_blocks follow whether pretrained weights are loaded: with them NVIDIA's
        defaults for a pretrained backbone (batch norm frozen, the stem and the first residual stage frozen),
        without them everything trained.
        """
        config = copy.deepcopy(self)
        model, pretrained = config.model, config.pretrained()
        if model.freeze_bn is None:
            model.freeze_bn = pretrained
        if model.freeze_blocks is None:
            model.freeze_blocks = (0, 1) if pretrained else ()
        return config

    def to_dict(self) -> dict:
        """Nested plain dict (tuples become lists), ready for JSON."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def save(self, model_dir: str) -> str:
        """Writes the config to <model_dir>/config.json, atomically; returns the path."""
        path = os.path.join(model_dir, SAVED_CONFIG_FILE)
        os.makedirs(model_dir, exist_ok=True)
        files.write_json(path, self.to_dict(), indent=2)
        return path

    def get(self, path: str):
        """The value at dotted `path`, e.g. 'model.rpn.rpn_min_size'."""
        obj = self
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def set(self, path: str, value) -> None:
        """Sets the leaf at dotted `path` to `value`, coerced to the field's type (lists become tuples).
        Raises ValueError when the value does not fit the type."""
        *parents, leaf = path.split(".")
        owner = self
        for part in parents:
            owner = getattr(owner, part)
        setattr(owner, leaf, coerce_value(value, typing.get_type_hints(type(owner))[leaf]))

    def override(self, key: str, value: str) -> None:
        """Sets the field at dotted `key` (e.g. 'model.rpn.rpn_min_size') from its text `value`.

        The text is parsed for the field's declared type: numbers, booleans (true/false/1/0), `none`
        for optional fields, and lists as JSON ('[832, 1344]') or comma-separated ('832,1344').
        Raises ConfigError naming the key when it does not exist or the value does not fit.
        """
        owner, name = self, None
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(owner) or part not in {f.name for f in dataclasses.fields(owner)}:
                raise ConfigError("--config_override", f"unknown config key '{key}'" + _suggest(self, part))
            if i < len(parts) - 1:
                owner = getattr(owner, part)
            name = part
        hint = typing.get_type_hints(type(owner))[name]
        if dataclasses.is_dataclass(getattr(owner, name)):
            raise ConfigError("--config_override", f"'{key}' is a section; name one of its fields")
        try:
            setattr(owner, name, parse_value(value, hint))
        except ValueError as err:
            raise ConfigError("--config_override", f"{key}={value}: {err}") from None

    def validate(self) -> None:
        """Raises ConfigError naming the first inconsistent setting."""
        # The backbone's levels must halve exactly up to C5 (the FPN adds each to the next one upsampled 2x);
        # the levels above subsample with rounding up, and their anchors follow (anchors.level_strides).
        stride = 2 ** min(self.model.anchors.max_level, 5)
        height, width = self.data.image_size
        if height % stride or width % stride:
            raise ConfigError(
                "--image_size",
                f"{height} {width} is not a multiple of {stride} (the backbone's stride) in both sides",
            )
        values, boundaries = self.train.learning_rate_values, self.train.learning_rate_boundaries
        if len(values) != len(boundaries):
            raise ConfigError(
                "--learning_rate_values",
                f"{len(values)} values but {len(boundaries)} --learning_rate_boundaries: they pair up",
            )
        if any(b <= a for a, b in zip(boundaries, boundaries[1:])) or (boundaries and boundaries[0] < 0):
            raise ConfigError("--learning_rate_boundaries", f"{list(boundaries)} must be increasing and >= 0")
        if self.train.learning_rate_schedule not in LEARNING_RATE_SCHEDULES:
            raise ConfigError("train.learning_rate_schedule",
                              f"'{self.train.learning_rate_schedule}' is not one of {LEARNING_RATE_SCHEDULES}")
        if self.train.learning_rate_schedule == "cosine" and len(values) < 2:
            raise ConfigError("train.learning_rate_schedule", "cosine decays from the first --learning_rate_values to "
                                                              f"the last: {list(values)} has one; give two")
        if self.model.backbone not in BACKBONES:
            raise ConfigError("--backbone", f"'{self.model.backbone}' is not one of {', '.join(BACKBONES)}")
        if self.runtime.amp_dtype not in AMP_DTYPES:
            raise ConfigError("--amp_dtype", f"'{self.runtime.amp_dtype}' is not one of {AMP_DTYPES}")
        if self.runtime.custom_ops not in CUSTOM_OPS_MODES:
            raise ConfigError("--custom_ops", f"'{self.runtime.custom_ops}' is not one of {CUSTOM_OPS_MODES}")
        unknown = [name for name in self.export.formats if name not in EXPORT_FORMATS]
        if unknown or not self.export.formats:
            raise ConfigError("--format", f"{', '.join(unknown) or 'nothing'}: name one or more of "
                                          f"{', '.join(EXPORT_FORMATS)}")
        train = self.train
        if train.backbone_checkpoint is not None and train.init_checkpoint is not None:
            # The init checkpoint's backbone would replace the pretrained one: one of them is a mistake.
            raise ConfigError("--init_checkpoint", f"{train.init_checkpoint} and --backbone_checkpoint "
                                                   f"{train.backbone_checkpoint} both give the backbone's weights: "
                                                   "give one of them")
        if self.model.test.mask_paste not in MASK_PASTES:
            raise ConfigError("model.test.mask_paste", f"'{self.model.test.mask_paste}' is not one of {MASK_PASTES}")
        if self.data.jpeg_dct_method not in JPEG_DCT_METHODS:
            raise ConfigError("data.jpeg_dct_method",
                              f"'{self.data.jpeg_dct_method}' is not one of {JPEG_DCT_METHODS}")
        for key, low, high in RANGES:
            value = self.get(key)
            if any(not (low <= item and (high is None or item <= high)) for item in _items(value)):
                bound = f"lie in [{low}, {high}]" if high is not None else f"be >= {low}"
                raise ConfigError(key, f"{show_value(value)} must {bound}")
        rpn, roi = self.model.rpn, self.model.roi
        if rpn.rpn_negative_overlap > rpn.rpn_positive_overlap:
            raise ConfigError("model.rpn.rpn_negative_overlap", f"{rpn.rpn_negative_overlap} exceeds "
                              f"model.rpn.rpn_positive_overlap {rpn.rpn_positive_overlap}")
        if self.data.aug_scale_min > self.data.aug_scale_max:
            raise ConfigError("data.aug_scale_min", f"{self.data.aug_scale_min} exceeds data.aug_scale_max "
                              f"{self.data.aug_scale_max}")
        if roi.bg_thresh_lo > roi.bg_thresh_hi:
            raise ConfigError("model.roi.bg_thresh_lo", f"{roi.bg_thresh_lo} exceeds model.roi.bg_thresh_hi "
                              f"{roi.bg_thresh_hi}")
        for key in POSITIVE:
            value = self.get(key)
            if any(item <= 0 for item in _items(value)):
                raise ConfigError(key, f"{show_value(value)} must be > 0")
        if self.model.num_classes < 2:
            raise ConfigError("--num_classes", f"{self.model.num_classes}: need background and >= 1 class")
        for key in ("model.fpn_norm", "model.fast_rcnn_norm", "model.mrcnn_head_norm"):
            if self.get(key) not in NORMS:
                raise ConfigError(key, f"'{self.get(key)}' is not one of {NORMS}")
        if self.model.fast_rcnn_num_fcs not in (1, 2):
            raise ConfigError("model.fast_rcnn_num_fcs", f"{self.model.fast_rcnn_num_fcs} must be 1 or 2")
        anchors = self.model.anchors
        if not 2 <= anchors.min_level <= anchors.max_level:
            raise ConfigError("model.anchors.min_level", f"levels {anchors.min_level}..{anchors.max_level} invalid")
        for key, value in (("--min_bbox_map", self.eval.min_bbox_map), ("--min_mask_map", self.eval.min_mask_map)):
            if value is not None and not self.eval.eval_file:
                raise ConfigError(key, "stopping at a target AP needs --eval_file (the validation annotations)")
        best, masks = self.eval.best_metric, self.model.include_mask
        kinds = COCO_IOU_TYPES if masks else COCO_IOU_TYPES[:1]
        if best is not None and best not in {f"{kind}/{name}" for kind in kinds for name in COCO_STATISTICS}:
            choices = f"({'|'.join(kinds)})/({'|'.join(COCO_STATISTICS)})"
            raise ConfigError("eval.best_metric", f"'{best}' is not one of {choices}"
                                                  + ("" if masks else " (the model has no mask branch)"))
        if self.eval.min_mask_map is not None and not self.model.include_mask:
            raise ConfigError("--min_mask_map", "the model has no mask branch (model.include_mask=false)")


# The bounds of each numeric setting, checked by Config.validate before anything runs, inclusive (None: no upper
# bound; each item of a tuple is checked; a setting whose default is None may be None). Out of range, a setting failed
# deep in TensorFlow or NumPy (a gather of no masks at data.max_num_instances=0, a crop at data.gt_mask_size=0,
# the seeding at --seed -1) or trained something else without a word (no RPN sample at
# model.rpn.rpn_batch_size_per_im=0, no positive anchor past an overlap of 1).
_COUNTS = ("train.train_batch_size", "train.learning_rate_batch_size", "eval.eval_batch_size", "train.accumulate_steps",
           "train.epochs", "runtime.log_every", "runtime.benchmark_steps", "runtime.checkpoint_every",
           "runtime.keep_checkpoints", "data.gt_mask_size", "data.max_num_instances", "data.resize_max_size",
           "model.fpn_num_filters", "model.rpn_head_num_convs", "model.fast_rcnn_mlp_head_dim",
           "model.fast_rcnn_conv_dim", "model.mrcnn_head_num_filters", "model.mrcnn_resolution",
           "model.anchors.num_scales", "model.rpn.rpn_batch_size_per_im", "model.rpn.train_rpn_pre_nms_topn",
           "model.rpn.train_rpn_post_nms_topn", "model.rpn.test_rpn_pre_nms_topn", "model.rpn.test_rpn_post_nms_topn",
           "model.roi.batch_size_per_im", "model.test.test_detections_per_image", "export.calibration_images",
           "train.steps_per_epoch", "eval.eval_samples", "eval.eval_every_epochs", "data.resize_min_size",
           "data.pad_to_multiple", "data.image_size")
_NON_NEGATIVE = ("model.fast_rcnn_num_convs", "train.warmup_min_steps", "runtime.log_warmup_steps",
                 "model.rpn.rpn_min_size", "model.test.test_min_box_size", "train.init_learning_rate",
                 "train.learning_rate_values", "train.l2_weight_decay",
                 "model.loss.rpn_box_loss_weight", "model.loss.fast_rcnn_box_loss_weight",
                 "model.loss.mrcnn_weight_loss_mask")
_FRACTIONS = ("model.rpn.rpn_positive_overlap", "model.rpn.rpn_negative_overlap", "model.rpn.rpn_fg_fraction",
              "model.rpn.train_rpn_nms_threshold", "model.rpn.test_rpn_nms_thresh", "model.roi.fg_fraction",
              "model.roi.fg_thresh", "model.roi.bg_thresh_hi", "model.roi.bg_thresh_lo", "model.test.test_nms",
              "model.test.test_score_threshold", "model.anchors.anchor_offset", "eval.min_bbox_map",
              "eval.min_mask_map", "infer.visualize_score_threshold",
              "train.ema_decay", "data.repeat_threshold",
              "train.momentum")  # above 1 the velocity grows at every step: training diverges
RANGES = tuple((key, low, high) for keys, low, high in (
    (_COUNTS, 1, None), (_NON_NEGATIVE, 0, None), (_FRACTIONS, 0, 1),
    (("train.seed",), 0, 2 ** 32 - 1),  # NumPy's and Keras's seeds
    # The stem (0) and ResNet's four residual groups (model.backbone.STEM_GROUP .. NUM_GROUPS).
    (("model.freeze_blocks",), 0, 4),
) for key in keys)
# The settings that must be above 0 (None allowed where it is the default).
POSITIVE = ("model.anchors.anchor_scale", "model.bbox_reg_weights", "train.clip_grad_norm", "data.aug_scale_min",
            "data.aug_scale_max", "data.repeat_threshold")

# The values a checkpoint's weights are tied to: a saved run's value of one of these cannot be changed by
# a later command on the same model_dir (the weights would not fit, or would mean something else).
MODEL_DEFINING_KEYS = (
    "model.backbone", "model.num_classes", "data.image_size", "model.stride_in_1x1", "model.include_mask",
    "model.fpn_num_filters", "model.fast_rcnn_mlp_head_dim", "model.mrcnn_head_num_filters",
    "model.fpn_norm", "model.rpn_head_num_convs", "model.fast_rcnn_num_fcs", "model.fast_rcnn_num_convs",
    "model.fast_rcnn_conv_dim", "model.fast_rcnn_norm", "model.mrcnn_head_norm", "model.mrcnn_resolution",
    "model.anchors.min_level", "model.anchors.max_level", "model.anchors.num_scales",
    "model.anchors.aspect_ratios", "model.anchors.anchor_scale", "model.anchors.anchor_offset",
    "model.anchors.round_base_anchors",
)
# Settings of one invocation rather than of the run: a saved config does not carry them to the next command.
PER_COMMAND_KEYS = (
    "runtime.model_dir", "runtime.benchmark", "runtime.benchmark_steps", "runtime.log_warmup_steps",
    "runtime.log_file", "runtime.eagerly", "runtime.verbose", "runtime.log_graph", "data.use_synthetic_data",
    "runtime.break_lock",
)
PER_COMMAND_SECTIONS = ("infer.", "export.")

BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101")
CUSTOM_OPS_MODES = ("auto", "on", "off")
# `main.py export --format` -> the file it writes in the export directory: TensorFlow's SavedModel, and one graph
# per image for each other runtime (TFLite at float32 and with float16 weights, OpenVINO at float32 and quantized
# to 8 bits; runtime/deploy.py converts to them).
EXPORT_FILES = {
    "saved_model": SAVED_MODEL_FILE,
    "onnx": "model.onnx",
    "tflite": "model.tflite",
    "tflite_fp16": "model_fp16.tflite",
    "openvino": "openvino/model.xml",
    "openvino_int8": "openvino_int8/model.xml",
}
EXPORT_FORMATS = tuple(EXPORT_FILES)
AMP_DTYPES = ("auto", "float16", "bfloat16")
MASK_PASTES = ("exact", "torchvision")
LEARNING_RATE_SCHEDULES = ("piecewise", "cosine")
NORMS = ("none", "batch")
JPEG_DCT_METHODS = ("", "INTEGER_FAST", "INTEGER_ACCURATE")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _items(value):
    """The numbers of a setting's value: the items of a tuple, a number alone, none of None."""
    return value if isinstance(value, tuple) else () if value is None else (value,)


def show_value(value) -> str:
    """A setting's value as a flag takes it: (832, 1344) -> '832 1344'."""
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def parse_value(text: str, hint):
    """Parses `text` as a value of the type annotation `hint` (int, float, bool, str, Optional, tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if text.strip().lower() in ("none", "null"):
            return None
        return parse_value(text, next(a for a in args if a is not type(None)))
    if origin is tuple:
        items = _split_list(text)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_item(item, args[0]) for item in items)
        if len(items) != len(args):
            raise ValueError(f"expected {len(args)} values, got {len(items)}")
        return tuple(_parse_item(item, arg) for item, arg in zip(items, args))
    if hint is bool:
        lowered = text.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise ValueError(f"'{text}' is not a boolean (true/false)")
        return lowered in _TRUE
    if hint in (int, float, str):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"'{text}' is not a valid {hint.__name__}") from None
    raise ValueError(f"unsupported field type {hint}")


def coerce_value(value, hint):
    """`value` (a Python or JSON value) as the type annotation `hint` says: lists become tuples, ints
    become floats where a float is declared. Raises ValueError when it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        return None if value is None else coerce_value(value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{value!r} is not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce_value(item, args[0]) for item in value)
        if len(value) != len(args):
            raise ValueError(f"expected {len(args)} values, got {len(value)}")
        return tuple(coerce_value(item, arg) for item, arg in zip(value, args))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{value!r} is not of type {hint.__name__}")
    return value


def load_saved_config(model_dir: str) -> Optional[dict]:
    """{dotted path: value of the field's type} of the config saved in <model_dir>/config.json; None when
    there is none.

    Raises ConfigError naming the file and the key when the file is not a config this package wrote.
    """
    path = os.path.join(model_dir, SAVED_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError("--model_dir", f"{path} is not readable JSON: {err}") from None
    values, known = {}, set(field_paths(Config()))

    def walk(node, prefix):
        if not isinstance(node, dict):
            raise ConfigError("--model_dir", f"{path}: '{prefix.rstrip('.') or '<top>'}' is not a section")
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif f"{prefix}{key}" in known:
                values[f"{prefix}{key}"] = value
            else:
                raise ConfigError("--model_dir", f"{path}: unknown config key '{prefix}{key}'")

    walk(saved, "")
    probe = Config()
    for key, value in values.items():
        try:
            probe.set(key, value)
        except ValueError as err:
            raise ConfigError("--model_dir", f"{path}: {key}: {err}") from None
    return {key: probe.get(key) for key in values}


def _split_list(text: str) -> list:
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"'{text}' is not a JSON list ({err.msg})") from None
        if not isinstance(items, list):
            raise ValueError(f"'{text}' is not a list")
        return items
    return [item for item in text.split(",") if item.strip()]


def _parse_item(item, hint):
    # JSON lists give numbers and nested lists; comma-separated text gives strings.
    if isinstance(item, list):
        return parse_value(json.dumps(item), hint)
    return parse_value(str(item), hint)


def _suggest(config: Config, name: str) -> str:
    """' (did you mean ...?)' listing the dotted paths whose leaf is `name`, if any."""
    matches = [path for path in field_paths(config) if path.rsplit(".", 1)[-1] == name]
    return f" (did you mean {' or '.join(matches)}?)" if matches else ""


def field_paths(obj, prefix: str = "") -> list:
    """Dotted paths of every leaf field of the dataclass `obj`, e.g. 'model.rpn.rpn_min_size'."""
    paths = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            paths += field_paths(value, f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths
