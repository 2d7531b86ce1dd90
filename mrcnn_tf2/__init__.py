"""TensorFlow 2 / Keras 3 Mask R-CNN (ResNet-FPN) for instance segmentation."""

import os

# oneDNN's CPU kernels: TensorFlow enables them by default only on CPUs with AVX-512 class instructions,
# yet on an AVX2 CPU they also make the train step faster (the demo's: 1.09 vs 1.49 s, mostly the
# convolutions' gradients; see the README's Results). The variable is read when TensorFlow is imported,
# so this package must be imported first; TF_ENABLE_ONEDNN_OPTS=0 keeps TensorFlow's own kernels.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
