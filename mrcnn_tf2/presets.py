"""Named presets: sets of config values that `--preset NAME` applies on every `main.py` command.

A preset is applied over the defaults and under a saved run's config (<model_dir>/config.json), the
explicit flags and `--config_override`, which win: a run keeps what it chose when later commands name the
preset again, and the preset still gives the settings of one command that a saved config does not carry.
`--print_config` names the preset as the source of each value it set. Keys are dotted config paths
(mrcnn_tf2.config); values are Python values of the field's type.

This module must not import TensorFlow.
"""

# torchvision's maskrcnn_resnet50_fpn conventions (the torchvision preset); torchvision_v2 adds its model options.
TORCHVISION_VALUES = {
    # The weights' own backbone and classes come with them (the converter's config.json; ResNet-50 and
    # 91 COCO ids are the defaults). Shorter side 800, longer at most 1333; evaluation and inference batches
    # hold images of one padded shape, each padded to a multiple of 32. Training pads to the 1344x1344 canvas,
    # which holds any image of the rule in either orientation.
    "data.resize_min_size": 800,
    "data.resize_max_size": 1333,
    "data.pad_to_multiple": 32,
    "data.image_size": (1344, 1344),
    # PIL, with which torchvision's reference scripts load images, decodes JPEG with ISLOW.
    "data.jpeg_dct_method": "INTEGER_ACCURATE",
    # AnchorGenerator(sizes 32..512, aspect ratios h/w 0.5, 1, 2): (x, y) multipliers in that order,
    # corners rounded, centres on the stride grid without a half-stride offset.
    "model.anchors.anchor_scale": 8.0,
    "model.anchors.num_scales": 1,
    "model.anchors.aspect_ratios": ((2 ** 0.5, 2 ** -0.5), (1.0, 1.0), (2 ** -0.5, 2 ** 0.5)),
    "model.anchors.anchor_offset": 0.0,
    "model.anchors.round_base_anchors": True,
    "model.roi_align_aligned": False,
    "model.rpn.rpn_min_size": 1e-3,
    "model.rpn.train_rpn_pre_nms_topn": 2000,
    "model.rpn.train_rpn_post_nms_topn": 2000,
    "model.rpn.test_rpn_pre_nms_topn": 1000,
    "model.rpn.test_rpn_post_nms_topn": 1000,
    "model.test.test_score_threshold": 0.05,
    "model.test.test_min_box_size": 1e-2,
    "model.test.test_nms": 0.5,
    "model.test.test_detections_per_image": 100,
    "model.test.mask_paste": "torchvision",
}

PRESETS = {
    "demo": dict(
        description="the README's demo: ResNet-18 from scratch on the generated 128x128 shapes (5 classes), "
                    "sized for a 2-core CPU",
        values={
            # 128x128 scenes with objects of 8 to 64 px, trained at that size, 5 shape classes + background.
            "data.image_size": (128, 128),
            "model.num_classes": 6,
            "data.max_num_instances": 32,
            # ResNet-18 from scratch (batch norm trains, nothing frozen: the default without pretrained
            # weights); FPN and the box head narrowed, the mask head most (it costs most of a step at 128).
            "model.backbone": "resnet18",
            "model.fpn_num_filters": 128,
            "model.fast_rcnn_mlp_head_dim": 512,
            "model.mrcnn_head_num_filters": 64,
            # Anchors of 16 px on P2 for the small objects.
            "model.anchors.anchor_scale": 4.0,
            # Second-stage budgets sized to a few objects per image.
            "model.roi.batch_size_per_im": 64,
            "model.rpn.train_rpn_pre_nms_topn": 500,
            "model.rpn.train_rpn_post_nms_topn": 200,
            "model.rpn.test_rpn_pre_nms_topn": 500,
            "model.rpn.test_rpn_post_nms_topn": 200,
            # 850 steps of 8 images: 2 epochs of 3400 scenes; a 21-step warm-up (no floor in steps) from
            # 8e-4 to 0.02, then 0.002 from epoch 1.4. Scenes cost about 6 ms each to generate and convert,
            # so the demo sees each one twice rather than six times as many fewer ones (CHANGELOG.md).
            "train.train_batch_size": 8,
            "train.epochs": 2,
            "train.init_learning_rate": 8e-4,
            "train.learning_rate_values": (2e-2, 2e-3),
            "train.learning_rate_boundaries": (0.05, 1.4),
            "train.warmup_min_steps": 0,
            "train.seed": 0,
            "eval.eval_batch_size": 8,
            "runtime.log_every": 25,
            "runtime.log_warmup_steps": 5,
            "runtime.checkpoint_every": 100,
        },
    ),
    "torchvision": dict(
        description="torchvision's maskrcnn_resnet50_fpn conventions, for its weights converted with "
                    "weights/convert_torchvision.py (ResNet-50, 91 COCO ids, shorter side 800)",
        values=TORCHVISION_VALUES,
    ),
    "torchvision_v2": dict(
        description="torchvision's maskrcnn_resnet50_fpn_v2, for its weights converted with "
                    "weights/convert_torchvision.py: the torchvision preset with batch norm in the FPN and heads, "
                    "two RPN convs and a box head of four convs and one fully connected layer",
        values={
            **TORCHVISION_VALUES,
            "model.fpn_norm": "batch",
            "model.rpn_head_num_convs": 2,
            "model.fast_rcnn_num_convs": 4,
            "model.fast_rcnn_conv_dim": 256,
            "model.fast_rcnn_norm": "batch",
            "model.fast_rcnn_num_fcs": 1,
            "model.mrcnn_head_norm": "batch",
        },
    ),
}


def names() -> tuple:
    """The preset names, in the order `--help` lists them."""
    return tuple(PRESETS)


def describe() -> str:
    """'NAME: description' of every preset, for `--help`."""
    return "; ".join(f"{name}: {preset['description']}" for name, preset in PRESETS.items())


def values(name: str) -> dict:
    """{dotted config path: value} of the preset `name` (a KeyError names an unknown preset)."""
    return dict(PRESETS[name]["values"])
