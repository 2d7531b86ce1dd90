"""Repeat factor sampling (data.repeat_threshold): training shows the images of rare categories more often, as
detectron2's RepeatFactorTrainingSampler does after the LVIS paper (Gupta et al., 2019).

A category c in a fraction f(c) of the training images gets the factor r(c) = max(1, sqrt(t / f(c))) for the
threshold t; an image gets the largest factor of its categories (1 without objects), and each pass over the
records repeats it floor(r) or floor(r) + 1 times, the latter with probability r - floor(r), so that it comes r
times per pass on average. The records are repeated before the shuffle, and each repeat is augmented on its own.
Crowd regions, which training leaves out, do not count.
"""

import dataclasses

import numpy as np
import tensorflow as tf

# The features of a record that the factors need, parsed alone (the image is not decoded).
_LABEL_FEATURES = {
    "image/object/class/label": tf.io.VarLenFeature(tf.int64),
    "image/object/is_crowd": tf.io.VarLenFeature(tf.int64),
}
# Uniform draws from the integers of tf.data.Dataset.random.
_DRAW_RANGE = 2 ** 24


def _presence(serialized, num_classes):
    """[num_classes] float32: 1 for each category with a non-crowd object in the record, else 0 (labels outside
    [0, num_classes) count for none: the decoder reports such records)."""
    parsed = tf.io.parse_single_example(serialized, _LABEL_FEATURES)
    labels = tf.sparse.to_dense(parsed["image/object/class/label"])
    crowd = tf.sparse.to_dense(parsed["image/object/is_crowd"])
    # A record without is_crowd has no crowd region.
    crowd = tf.pad(crowd, [[0, tf.maximum(tf.size(labels) - tf.size(crowd), 0)]])[:tf.size(labels)]
    labels = tf.boolean_mask(labels, tf.equal(crowd, 0))
    # A sum, not a max: an image without objects has no row to take the max of.
    return tf.minimum(tf.reduce_sum(tf.one_hot(labels, num_classes), axis=0), 1.0)


@dataclasses.dataclass
class RepeatFactors:
    """The factors of a training set (`from_records`)."""

    # [num_classes] float32: r(c), 1 for categories in no image.
    categories: np.ndarray
    # Images read, and the mean and largest of their factors (the images a pass shows per record, on average).
    num_images: int
    mean_image_factor: float
    max_image_factor: float

    @classmethod
    def from_records(cls, paths, threshold, num_classes):
        """The factors of every record of the TFRecord files `paths` (one pass over them) for threshold t > 0."""
        presence = tf.data.TFRecordDataset(paths).map(lambda s: _presence(s, num_classes),
                                                      num_parallel_calls=tf.data.AUTOTUNE)
        rows = [batch.numpy().astype(bool) for batch in presence.batch(4096)]
        present = np.concatenate(rows) if rows else np.zeros([0, num_classes], bool)
        num_images = len(present)
        fraction = present.sum(axis=0) / max(num_images, 1)
        with np.errstate(divide="ignore"):
            factors = np.where(fraction > 0, np.maximum(1.0, np.sqrt(threshold / fraction)), 1.0)
        per_image = np.max(np.where(present, factors, 1.0), axis=1, initial=1.0)
        return cls(factors.astype(np.float32), num_images, float(per_image.mean()) if num_images else 1.0,
                   float(per_image.max(initial=1.0)))

    def describe(self, threshold):
        """One line for the run's start."""
        rare = int(np.sum(self.categories > 1))  # category 0, the background, is in no image
        return (f"repeat factor sampling (data.repeat_threshold {threshold:g}): {rare} of {len(self.categories) - 1} "
                f"categories are in fewer than that fraction of the {self.num_images} training images; their "
                f"images come up to {self.max_image_factor:.2f} times per pass over the records, "
                f"{self.mean_image_factor:.3f} times on average")

    def repeat(self, records, seed=None):
        """`records` (serialized examples) with each one repeated by its image's factor, rounded at random
        (`seed`: the draws' seed; None: random)."""
        table = tf.constant(self.categories)

        def repeated(serialized, draw):
            presence = _presence(serialized, len(self.categories))
            factor = tf.reduce_max(tf.concat([[1.0], presence * table], axis=0))
            whole = tf.floor(factor)
            uniform = tf.cast(tf.math.floormod(draw, _DRAW_RANGE), tf.float32) / _DRAW_RANGE
            count = tf.cast(whole, tf.int64) + tf.cast(uniform < factor - whole, tf.int64)
            return tf.data.Dataset.from_tensors(serialized).repeat(count)

        return tf.data.Dataset.zip((records, tf.data.Dataset.random(seed=seed))).flat_map(repeated)
