"""The model for runtimes other than TensorFlow: ONNX (onnxruntime), TFLite (LiteRT) and OpenVINO.

Each artefact holds `MaskRCNN.detect` of one image, built for export (`factory.choose_ops(export=True)`: plain
convolutions, the pure-TF stages, per-image NonMaxSuppressionV5; in the OpenVINO formats RoIAlign is OpenVINO's
own op), so it is the same graph whichever machine exports it, and the same detections as the SavedModel. Inputs:
  images      float32 [1, H, W, 3]  the image resized, normalised and padded by `mrcnn_tf2.data.preprocess` (as
                                    `main.py infer` does): H x W is data.image_size, or with data.pad_to_multiple
                                    the image's own padded size. The graph takes any H and W: OpenVINO 2026.4's
                                    CPU plugin crashed in the NMS of a graph of static size
  image_info  float32 [1, 5]        [scaled_h, scaled_w, 1 / scale, original_h, original_w]
Outputs, in this order (TFLite names them by position only):
  detection_boxes [1, D, 4] float32 (original pixels, [ymin, xmin, ymax, xmax]), detection_classes [1, D] int32,
  detection_masks [1, D, R, R] float32 (only with the mask branch), detection_scores [1, D] float32,
  num_detections [1] int32.
One image per call: the batch axis is 1, so a photo's detections never depend on other photos.

openvino_int8 is the OpenVINO model quantized to 8 bits by NNCF, calibrated on images the user gives.

The converters and runtimes are optional extras (`pip install mrcnn-tf2[onnx]`, `[tflite]`, `[openvino]`),
imported here only when a format asks for them.
"""
import contextlib
import importlib
import os
import re
import threading

import numpy as np
import tensorflow as tf

from mrcnn_tf2 import console
from mrcnn_tf2.config import EXPORT_FILES, ConfigError
from mrcnn_tf2.model.stages import RoIAligner
from mrcnn_tf2.ops import fused as fused_ops

# format -> (the optional extra it needs, the modules that extra provides)
_EXTRAS = {
    "onnx": ("onnx", ("tf2onnx", "onnxruntime")),
    "tflite": ("tflite", ("ai_edge_litert",)),
    "tflite_fp16": ("tflite", ("ai_edge_litert",)),
    "openvino": ("openvino", ("openvino",)),
    "openvino_int8": ("openvino", ("openvino", "nncf")),
}
# format -> (artefact file inside the export directory, optional extra, modules the extra provides)
ARTEFACTS = {fmt: (EXPORT_FILES[fmt], *extra) for fmt, extra in _EXTRAS.items()}
# The lines LiteRT's C++ prints to standard error at INFO level, once per process (at its first allocation of tensors).
LITERT_INFO = ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU.",)
OUTPUTS = ("detection_boxes", "detection_classes", "detection_masks", "detection_scores", "num_detections")
ONNX_OPSET = 17


def _cpp_info_hidden():
    """Whether TensorFlow hides its C++ INFO lines (TF_CPP_MIN_LOG_LEVEL 1 or more; main.py sets 2 unless
    --verbose): LiteRT's, which no setting of its own reaches, follow it."""
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
    return level.isdigit() and int(level) >= 1


def require_extra(fmt):
    """Imports what `fmt` needs; raises ConfigError('--format', ...) naming the extra when it is missing."""
    _, extra, modules = ARTEFACTS[fmt]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError("--format", f"{fmt} needs the optional extra '{extra}' ({err}): "
                                          f"pip install 'mrcnn-tf2[{extra}]'") from None


def fused_roi_align(fmt):
    """Whether `fmt`'s graph holds RoIAlign as the fused op (when the ops library loads): the OpenVINO formats,
    whose converter maps it to OpenVINO's own ROIAlign (`_openvino_roi_align`), where the pure-TF RoIAlign's
    gather of every box's taps is bound by memory (docs/PERFORMANCE.md#runtimes)."""
    return ARTEFACTS[fmt][1] == "openvino" and fused_ops.use_fused("auto")


@contextlib.contextmanager
def _fused_roi_aligners(model):
    """The model's two RoIAligners replaced by fused ones of the same geometry, for the duration of a trace."""
    names = ("box_roi_aligner", "mask_roi_aligner")
    kept = [getattr(model, name) for name in names]
    try:
        for name, aligner in zip(names, kept):
            setattr(model, name, RoIAligner(aligner.output_size, aligner.sampling_ratio, aligner.aligned, fused=True))
        yield
    finally:
        for name, aligner in zip(names, kept):
            setattr(model, name, aligner)


def detect_function(model, fused_roi_align=False):
    """`model.detect` of one image as a tf.function with the inputs of the module docstring.

    Args:
      model: a built MaskRCNN made for export.
      fused_roi_align: trace RoIAlign as the fused op (see `fused_roi_align`); the model is unchanged after.
    """

    @tf.function(input_signature=[tf.TensorSpec([1, None, None, 3], tf.float32, name="images"),
                                  tf.TensorSpec([1, 5], tf.float32, name="image_info")], autograph=False)
    def detect(images, image_info):
        with _fused_roi_aligners(model) if fused_roi_align else contextlib.nullcontext():
            detections = model.detect({"images": images, "image_info": image_info})
        return {key: detections[key] for key in OUTPUTS if key in detections}

    return detect


def _to_onnx(function, path):
    """tf2onnx's conversion of `function` to `path`, first without its safety copies: it copies the whole graph
    before each of its optimizer passes, to keep the graph as it was if a pass fails, which was 10 s of the
    33 s of the test model's export. If a pass fails without them, the conversion runs again with them."""
    import tf2onnx

    def run():
        tf2onnx.convert.from_function(function, input_signature=function.input_signature, opset=ONNX_OPSET,
                                      output_path=path)

    try:
        with _environment(tf2onnx.constants.ENV_TF2ONNX_CATCH_ERRORS, "FALSE"):
            run()
    except Exception:  # a pass failed: again as tf2onnx would run it by itself, skipping a failing pass
        run()


@contextlib.contextmanager
def _environment(name, value):
    """os.environ[name] = value inside the block, restored after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def convert(fmt, function, path, calibration=None):
    """Writes `function` (from `detect_function`) as the artefact of `fmt` at `path`.

    `calibration` (openvino_int8 only): list of {"images", "image_info"} NumPy inputs of the function, the
    images NNCF measures activation ranges on (static post-training quantization: 8-bit weights and inputs of
    the convolutions; the rest stays float32).
    """
    if fmt == "onnx":
        _to_onnx(function, path)
    elif fmt in ("tflite", "tflite_fp16"):
        concrete = function.get_concrete_function()
        # The function as its own trackable object: TensorFlow converts it by the same concrete-function route as
        # with none, and does not print that giving none is deprecated.
        converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], trackable_obj=concrete)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]  # LiteRT runs no Flex ops
        if fmt == "tflite_fp16":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            converter.target_spec.supported_types = [tf.float16]
        with open(path, "wb") as f:
            f.write(converter.convert())
    elif fmt in ("openvino", "openvino_int8"):
        import openvino
        from openvino.frontend.tensorflow import ConversionExtension

        model = openvino.convert_model(function, extension=[ConversionExtension("MrcnnRoiAlign", _openvino_roi_align)])
        unstable_top_k(model)
        if fmt == "openvino_int8":
            import nncf

            # The convolutions and the box head's hidden layers only: NNCF's default also quantizes the box
            # arithmetic (Add, Multiply of pixel coordinates), which cost the demo model 15 points of box AP and
            # 43 of mask AP, and RoIAlign's interpolation products.
            ops = model.get_ordered_ops()
            quantized = {"Convolution", "ConvolutionBackpropData", "MatMul"}
            others = sorted({op.get_type_name() for op in ops} - quantized)
            products = [op.get_friendly_name() for op in ops if op.get_type_name() == "MatMul"
                        and not re.search(r"/fc[67]_?\d*/MatMul$", op.get_friendly_name())]
            model = nncf.quantize(model, nncf.Dataset(calibration), subset_size=len(calibration),
                                  ignored_scope=nncf.IgnoredScope(names=products, types=others, validate=False))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # compress_to_fp16 (its default) would round the float weights to float16: scores moved by 6e-3.
        openvino.save_model(model, path, compress_to_fp16=False)
    else:
        raise ValueError(f"unknown format {fmt}")


def unstable_top_k(model):
    """Replaces the TopK ops of the OpenVINO `model` (an openvino.Model, changed in place) by TopK ops that may
    order exactly equal values either way.

    The converter keeps TensorFlow's order of ties (stable=True), and the CPU plugin's stable kernel took 0.85 s
    of the 2.0 s of a ResNet-50 model at 800x1088 (the top 1000 of P2's 163 200 anchor scores); without it the
    outputs stayed identical. Only scores equal to the last bit can change places.
    """
    import openvino.opset13 as opset

    for op in model.get_ordered_ops():
        attributes = op.get_attributes()
        if op.get_type_name() == "TopK" and attributes.get("stable"):
            fast = opset.topk(op.input_value(0), op.input_value(1), attributes["axis"], attributes["mode"],
                              attributes["sort"], attributes["index_element_type"], stable=False)
            fast.set_friendly_name(op.get_friendly_name())
            for index in range(2):
                for target in list(op.output(index).get_target_inputs()):
                    target.replace_source_output(fast.output(index))
    model.validate_nodes_and_infer_types()


def _openvino_roi_align(node):
    """OpenVINO's conversion of the fused RoIAlign op (`ops/roi_align_op.cc`): one ROIAlign per FPN level.

    Inputs of `node`: num_levels features [B, H_l, W_l, C], boxes [B, N, 4] pixels [ymin, xmin, ymax, xmax],
    levels [B, N] int32 (level - min_level). Each level's ROIAlign pools the boxes assigned to it; the pooled rows,
    in level order, are put back in box order. Output [B, N, R, R, C], torchvision's sampling as the twin's:
    aligned_mode half_pixel_for_nn is `aligned=True` (box * scale - 0.5, no minimum size), asymmetric is
    `aligned=False` (boxes at least 1 x 1 cell).
    """
    import openvino.opset13 as opset

    num_levels, min_level = node.get_attribute("num_levels"), node.get_attribute("min_level")
    size, ratio = node.get_attribute("output_size"), node.get_attribute("sampling_ratio")
    mode = "half_pixel_for_nn" if node.get_attribute("aligned") else "asymmetric"
    boxes, levels = node.get_input(num_levels), node.get_input(num_levels + 1)

    def ints(values):
        return opset.constant(np.array(values, np.int32))

    batch_and_boxes = opset.gather(opset.shape_of(boxes, "i32"), ints([0, 1]), ints(0))
    total = opset.reduce_prod(batch_and_boxes, ints(0))
    box_index = opset.range(ints(0), total, ints(1), "i32")  # [B * N]
    image_index = opset.divide(box_index, opset.gather(batch_and_boxes, ints(1), ints(0)))
    # [x1, y1, x2, y2] rows, ROIAlign's order.
    rois = opset.gather(opset.reshape(boxes, ints([-1, 4]), False), ints([1, 0, 3, 2]), ints(1))
    levels = opset.reshape(levels, ints([-1]), False)
    pooled, order = [], []
    for level in range(num_levels):
        chosen = opset.reshape(opset.non_zero(opset.equal(levels, ints(level)), "i32"), ints([-1]), False)
        features = opset.transpose(node.get_input(level), ints([0, 3, 1, 2]))  # NCHW, ROIAlign's layout
        pooled.append(opset.roi_align(features, opset.gather(rois, chosen, ints(0)),
                                      opset.gather(image_index, chosen, ints(0)), size, size, ratio,
                                      2.0 ** -(min_level + level), "avg", mode))  # [K_l, C, R, R]
        order.append(chosen)
    # position[i]: where box i's row is among the level-ordered rows.
    position = opset.scatter_update(opset.broadcast(ints(0), opset.unsqueeze(total, ints(0))),
                                    opset.concat(order, 0), box_index, ints(0))
    pooled = opset.transpose(opset.gather(opset.concat(pooled, 0), position, ints(0)), ints([0, 2, 3, 1]))
    shape = opset.concat([batch_and_boxes, opset.gather(opset.shape_of(pooled, "i32"), ints([1, 2, 3]), ints(0))], 0)
    return [opset.reshape(pooled, shape, False).output(0)]


def format_of(path):
    """The runtime an artefact file needs, by its suffix ("onnx", "tflite" or "openvino"), or ConfigError naming
    it."""
    formats = {".onnx": "onnx", ".tflite": "tflite", ".xml": "openvino"}
    suffix = os.path.splitext(path)[1]
    if suffix in formats:
        return formats[suffix]
    raise ConfigError("--exported", f"{path}: not an exported artefact (.onnx, .tflite or OpenVINO .xml)")


def box_iou(a, b):
    """[N, 4] x [M, 4] boxes [ymin, xmin, ymax, xmax] -> [N, M] IoU (NumPy)."""
    low, high = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(high - low, 0, None), axis=-1)
    area_a, area_b = (np.prod(boxes[:, 2:] - boxes[:, :2], axis=-1) for boxes in (a, b))
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-12)


def matched_fraction(found, expected, min_iou=0.9, score_tolerance=0.01):
    """How many of one image's `expected` detections `found` holds too, as a fraction: each of the first
    n = min(both num_detections) expected ones matched once by one of the first n found ones of its class, its
    box at IoU >= `min_iou` and its score within `score_tolerance` (None: any score). 1.0 when n is 0.

    found, expected: outputs of a batch of one (`Runner`, a backend of runtime.predictor): detection_boxes
      [1, K, 4], detection_classes [1, K], detection_scores [1, K], num_detections [1].
    """
    count = min(int(found["num_detections"][0]), int(expected["num_detections"][0]))
    if count == 0:
        return 1.0
    overlap = box_iou(expected["detection_boxes"][0, :count], found["detection_boxes"][0, :count])
    free, matched = set(range(count)), 0
    for i in range(count):
        for j in sorted(free, key=lambda j: -overlap[i, j]):
            score_gap = abs(found["detection_scores"][0, j] - expected["detection_scores"][0, i])
            if (overlap[i, j] >= min_iou and found["detection_classes"][0, j] == expected["detection_classes"][0, i]
                    and (score_tolerance is None or score_gap <= score_tolerance)):
                free.remove(j)
                matched += 1
                break
    return matched / count


class Runner:
    """An exported artefact in its runtime: `runner(images, image_info)` -> {output name: NumPy array}, with the
    inputs and outputs of the module docstring. Threads may share one: their calls run one at a time."""

    def __init__(self, path):
        self.path = path
        self.format = format_of(path)
        require_extra(self.format)
        try:
            self._run = getattr(self, f"_load_{self.format}")(path)
        except Exception as err:  # each runtime has its own exception types for a file it cannot read
            raise ConfigError("--exported", f"{path}: not a readable {self.format} model ({err})") from None
        # LiteRT's interpreter and OpenVINO's infer request hold one call's tensors: calls from two threads (a
        # Predictor behind a web server) fail ("Infer Request is busy") or read each other's tensors. Each call
        # already uses every core, so running them in turn costs no throughput.
        self._lock = threading.Lock()

    def __call__(self, images, image_info):
        with self._lock:
            return self._run(np.asarray(images, np.float32), np.asarray(image_info, np.float32))

    @staticmethod
    def _load_onnx(path):
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [output.name for output in session.get_outputs()]
        return lambda images, image_info: dict(zip(names, session.run(None, {"images": images,
                                                                              "image_info": image_info})))

    @staticmethod
    def _load_tflite(path):
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path)
        inputs = {detail["name"]: detail["index"] for detail in interpreter.get_input_details()}
        # TFLite names the outputs Identity, Identity_1, ...: they are the function's outputs in order.
        outputs = [detail["index"] for detail in interpreter.get_output_details()]
        names = [key for key in OUTPUTS if len(outputs) == len(OUTPUTS) or key != "detection_masks"]
        shape = {}

        def run(images, image_info):
            if shape.get("images") != images.shape:
                interpreter.resize_tensor_input(inputs["images"], images.shape)
                with (console.stderr_without(lambda line: line.rstrip("\r\n") in LITERT_INFO)
                      if _cpp_info_hidden() else contextlib.nullcontext()):
                    interpreter.allocate_tensors()  # the first one applies the XNNPACK delegate
                shape["images"] = images.shape
            interpreter.set_tensor(inputs["images"], images)
            interpreter.set_tensor(inputs["image_info"], image_info)
            interpreter.invoke()
            return {name: interpreter.get_tensor(index) for name, index in zip(names, outputs)}

        return run

    @staticmethod
    def _load_openvino(path):
        import openvino
        import openvino.properties.hint as hints

        # float32: the CPU plugin's default on a CPU with bfloat16 instructions is bfloat16 (detections lost).
        compiled = openvino.Core().compile_model(path, "CPU", {hints.inference_precision: openvino.Type.f32})

        def run(images, image_info):
            result = compiled({"images": images, "image_info": image_info})
            return {next(key for key in OUTPUTS if key in output.get_any_name()): value
                    for output, value in result.items()}

        return run
