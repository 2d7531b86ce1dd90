"""Decoding of one serialized COCO TFRecord example (the keys written by dataset/create_coco_tf_record.py).

Boxes come out in pixels of the original image, [ymin, xmin, ymax, xmax] float32; instance masks as
full-image uint8 {0, 1}. Nothing here resizes, augments or pads: that is the pipeline's job.

Glossary: K instances in the example, h x w the original image size.
"""

import tensorflow as tf

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/source_id": tf.io.FixedLenFeature([], tf.string),
    "image/height": tf.io.FixedLenFeature([], tf.int64),
    "image/width": tf.io.FixedLenFeature([], tf.int64),
    "image/object/bbox/xmin": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/xmax": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/ymin": tf.io.VarLenFeature(tf.float32),
    "image/object/bbox/ymax": tf.io.VarLenFeature(tf.float32),
    "image/object/class/label": tf.io.VarLenFeature(tf.int64),
    "image/object/is_crowd": tf.io.VarLenFeature(tf.int64),
}
MASK_FEATURE = {"image/object/mask": tf.io.VarLenFeature(tf.string)}


def decode_example(serialized, include_masks=True, dct_method=""):
    """Decodes one example.

    Args:
      serialized: scalar tf.string, a serialized tf.train.Example.
      include_masks: decode the per-instance PNG masks.
      dct_method: tf.io.decode_jpeg's ("" TensorFlow's default, "INTEGER_ACCURATE" as PIL decodes).

    Returns:
      dict with
        image: [h, w, 3] uint8 RGB;
        source_id: scalar int64, the COCO image id;
        gt_boxes: [K, 4] float32 [ymin, xmin, ymax, xmax] in original-image pixels;
        gt_classes: [K] int32 category ids of the annotation file;
        gt_is_crowd: [K] bool;
        gt_masks (with include_masks): [K, h, w] uint8 in {0, 1}.
    """
    features = dict(FEATURES, **MASK_FEATURE) if include_masks else FEATURES
    parsed = tf.io.parse_single_example(serialized, features)
    dense = {
        key: tf.sparse.to_dense(value) if isinstance(value, tf.SparseTensor) else value
        for key, value in parsed.items()
    }
    image = tf.io.decode_jpeg(dense["image/encoded"], channels=3, dct_method=dct_method)
    size = tf.cast(tf.shape(image)[:2], tf.float32)
    boxes = tf.stack(
        [
            dense["image/object/bbox/ymin"] * size[0],
            dense["image/object/bbox/xmin"] * size[1],
            dense["image/object/bbox/ymax"] * size[0],
            dense["image/object/bbox/xmax"] * size[1],
        ],
        axis=-1,
    )
    decoded = {
        "image": image,
        "source_id": tf.strings.to_number(dense["image/source_id"], tf.int64),
        "gt_boxes": tf.reshape(boxes, [-1, 4]),
        "gt_classes": tf.cast(dense["image/object/class/label"], tf.int32),
        "gt_is_crowd": tf.cast(dense["image/object/is_crowd"], tf.bool),
    }
    if include_masks:
        height, width = tf.shape(image)[0], tf.shape(image)[1]
        pngs = dense["image/object/mask"]
        # map_fn cannot stack an empty list of unknown shape: images without objects take the other branch.
        masks = tf.cond(
            tf.size(pngs) > 0,
            lambda: tf.map_fn(
                lambda png: tf.io.decode_png(png, channels=1)[:, :, 0],
                pngs,
                fn_output_signature=tf.TensorSpec([None, None], tf.uint8),
            ),
            lambda: tf.zeros([0, height, width], tf.uint8),
        )
        decoded["gt_masks"] = tf.reshape(masks, [-1, height, width])
    return decoded
