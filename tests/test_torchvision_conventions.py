"""Three conventions of torchvision's Mask R-CNN, reproduced and checked against the installed torchvision:
its resize rule (GeneralizedRCNNTransform.resize), PIL's JPEG decoding (its reference scripts load images
with PIL) and its mask pasting (roi_heads.paste_masks_in_image).
"""
import io
import math
from fractions import Fraction

import numpy as np
import pytest
import tensorflow as tf
import torch
from PIL import Image, JpegImagePlugin
from pycocotools import mask as mask_utils
from torchvision.models.detection.roi_heads import paste_masks_in_image
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from mrcnn_tf2.data.preprocess import decode_image, resize
from mrcnn_tf2.ops import masks

# ------------------------------------------------------------------------------------------------- resize

# Large enough for any image under min_size 800, max_size 1333 in either orientation.
CANVAS = (1344, 1344)


def transform(min_size, max_size):
    """torchvision's GeneralizedRCNNTransform with mean 0 and std 1: resize only; in evaluation mode, so that
    min_size is not drawn at random."""
    return GeneralizedRCNNTransform(min_size, max_size, [0.0] * 3, [1.0] * 3).eval()


def torchvision_resized_sizes(sizes, min_size, max_size):
    """The (height, width) torchvision resizes each (h, w) image to; None where the output size is empty."""
    resizer = transform(min_size, max_size)
    resized = []
    for h, w in sizes:
        try:
            resized.append(tuple(resizer.resize(torch.zeros(1, h, w))[0].shape[-2:]))
        except RuntimeError:  # an empty output size
            resized.append(None)
    return resized


def torchvision_resize(image, min_size, max_size):
    """torchvision's resize of an [H, W, C] float32 image."""
    return transform(min_size, max_size).resize(torch.from_numpy(image).permute(2, 0, 1))[0].permute(1, 2, 0).numpy()


def test_resized_sizes_equal_torchvisions(rng):
    sizes = [(480, 640), (640, 480), (427, 640), (1, 1000), (1000, 1), (800, 1333), (1333, 800),
             (1000, 1000), (1, 1), (2, 2000), (1, 1999), (97, 130), (97, 97), (161, 300), (4000, 6000)]
    sizes += [tuple(int(v) for v in rng.integers(1, 2500, 2)) for _ in range(60)]
    want = torchvision_resized_sizes(sizes, 800, 1333)

    @tf.function(input_signature=[tf.TensorSpec([None, None, 1], tf.uint8)])
    def resized_info(image):  # graph mode, as in the input pipeline
        return resize(image, CANVAS, 800, 1333)[1:]

    quirks = 0
    for (h, w), expected in zip(sizes, want):
        info, scale = (t.numpy() for t in resized_info(tf.zeros((h, w, 1), tf.uint8)))
        torchvision_scale = min(800 / min(h, w), 1333 / max(h, w))  # GeneralizedRCNNTransform's, in float64
        if expected is None:  # torchvision fails on a side that floors to 0: ours keeps one pixel
            expected = tuple(max(1, math.floor(side * torchvision_scale)) for side in (h, w))
            assert min(expected) == 1, (h, w)
        assert tuple(info[:2]) == expected, (h, w)
        assert scale == np.float32(torchvision_scale)
        np.testing.assert_array_equal(info[2:], np.float32([1 / torchvision_scale, h, w]))
        quirks += min(expected) == 799  # e.g. 97 x 130: 97 * (800 / 97) < 800 in float64
    assert quirks > 0
    assert sum(size is None for size in want) > 0


def test_resized_pixels_equal_torchvisions(rng):
    # torchvision normalises, then resizes; bilinear weights sum to 1, so resizing the 0..255 image (mean 0,
    # std 1 in the reference) compares the same interpolation.
    cases = [((480, 640), 800, 1333), ((640, 480), 800, 1333), ((97, 130), 800, 1333), ((60, 80), 50, 70),
             ((123, 45), 40, 100), ((300, 200), 100, 1000), ((1, 100), 800, 1333)]
    images = [rng.uniform(0, 255, hw + (3,)).astype(np.float32) for hw, _, _ in cases]
    images[1] = np.round(images[1])  # also a uint8 image (below)
    want = [torchvision_resize(image, min_size, max_size) for image, (_, min_size, max_size) in zip(images, cases)]
    for index, (image, (hw, min_size, max_size), expected) in enumerate(zip(images, cases, want)):
        source = image.astype(np.uint8) if index == 1 else image
        got, info, _ = resize(tf.constant(source), CANVAS, min_size, max_size)
        assert got.dtype == tf.float32 and got.shape == expected.shape, hw
        np.testing.assert_array_equal(info.numpy()[:2], expected.shape[:2])
        np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-4, err_msg=str(hw))


def test_resize_rule_errors_name_the_sizes():
    portrait = tf.zeros((640, 480, 3), tf.uint8)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"resizes the \[640 480\] image to \[1066 800\], which does not fit image_size "
                             r"\[800 1333\]"):
        resize(portrait, (800, 1333), 800, 1333)
    graph_resize = tf.function(lambda image: resize(image, (800, 1333), 800, 1333)[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not fit image_size"):
        graph_resize(portrait)
    for kwargs in (dict(min_size=0), dict(min_size=800.0), dict(min_size=800, max_size=None)):
        with pytest.raises(ValueError, match="must be a positive int"):
            resize(portrait, CANVAS, **kwargs)


# -------------------------------------------------------------------------------------------------- JPEG

def photo_like(rng, h, w):
    """[h, w, 3] uint8: smooth colour gradients, noise and a saturated rectangle (sharp chroma edges)."""
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    image = np.stack([np.sin(6 * x + 1), np.cos(5 * y), np.sin(3 * (x + y))], axis=-1) * 100 + 128
    image += rng.normal(0, 25, (h, w, 3))
    image[h // 4:h // 2, w // 3:w // 2] = [250, 10, 30]
    return np.clip(image, 0, 255).astype(np.uint8)


# PIL's subsampling: 0 is 4:4:4, 1 is 4:2:2, 2 is 4:2:0.
JPEG_CASES = [
    dict(quality=30, subsampling=2), dict(quality=75, subsampling=0), dict(quality=75, subsampling=1),
    dict(quality=75, subsampling=2), dict(quality=95, subsampling=0), dict(quality=95, subsampling=1),
    dict(quality=95, subsampling=2), dict(quality=85, subsampling=2, progressive=True),
    dict(quality=85, subsampling=0, progressive=True), dict(quality=90, subsampling=2, optimize=True),
    dict(quality=50, grayscale=True), dict(quality=95, progressive=True, grayscale=True),
]


@pytest.mark.parametrize("options", JPEG_CASES, ids=lambda options: "-".join(f"{k}{v}" for k, v in options.items()))
def test_integer_accurate_jpeg_decoding_equals_pil(rng, options):
    options = dict(options)
    grayscale = options.pop("grayscale", False)
    for h, w in [(97, 131), (64, 64), (33, 250)]:  # odd sizes: partial blocks and chroma edges
        pixels = photo_like(rng, h, w)
        picture = Image.fromarray(pixels[..., 0] if grayscale else pixels)
        buffer = io.BytesIO()
        picture.save(buffer, "JPEG", **options)
        encoded = buffer.getvalue()
        written = Image.open(io.BytesIO(encoded))
        if not grayscale:
            assert JpegImagePlugin.get_sampling(written) == options["subsampling"]
        want = np.asarray(written.convert("RGB"))
        got = decode_image(tf.constant(encoded), "INTEGER_ACCURATE")
        assert got.dtype == tf.uint8
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{options} {h}x{w}")


def test_dct_method_leaves_other_formats_and_works_in_graph_mode(rng):
    pixels = rng.integers(0, 256, (30, 70, 3), dtype=np.uint8)
    png = tf.io.encode_png(pixels)
    np.testing.assert_array_equal(decode_image(png, "INTEGER_ACCURATE").numpy(), pixels)
    buffer = io.BytesIO()
    Image.fromarray(photo_like(rng, 40, 56)).save(buffer, "JPEG", quality=90)
    jpeg = tf.constant(buffer.getvalue())
    graph_decode = tf.function(lambda encoded: decode_image(encoded, "INTEGER_ACCURATE"))
    np.testing.assert_array_equal(graph_decode(png).numpy(), pixels)
    np.testing.assert_array_equal(graph_decode(jpeg).numpy(), np.asarray(Image.open(buffer).convert("RGB")))
    assert graph_decode(jpeg).shape.as_list() == [40, 56, 3]
    with pytest.raises(ValueError, match="dct_method must be one of"):
        decode_image(png, "ISLOW")


# ----------------------------------------------------------------------------------------------- pasting

def random_boxes(rng, count, image_hw):
    """[count, 4] float32 [ymin, xmin, ymax, xmax]: log-uniform sides from 0.1 to 400 px (some sub-pixel,
    some with widened size over and under ATen's 128 kernel switch), centres up to 30% past each border
    (negative coordinates, boxes partly and wholly outside), plus fixed boxes on the image edges."""
    hw = np.asarray(image_hw, np.float64)
    sides = np.exp(rng.uniform(np.log(0.1), np.log(400.0), (count, 2)))
    centres = rng.uniform(-0.3, 1.3, (count, 2)) * hw
    boxes = np.concatenate([centres - sides / 2, centres + sides / 2], axis=1)
    h, w = image_hw
    edges = [[0, 0, h, w], [0, 0, 0.4, 0.4], [h - 0.3, w - 0.3, h, w], [-0.99, -0.99, 3.5, 3.5],
             [-1.2, 2.0, 0.2, 5.0], [h - 1.0, -2.0, h + 1.0, w + 2.0], [0.5, 0.5, 0.5, 0.5]]
    return np.concatenate([boxes, edges]).astype(np.float32)


def torchvision_paste(probs, boxes, image_hw):
    """torchvision's paste_masks_in_image of each [M, M] mask into its [ymin, xmin, ymax, xmax] box, one box at a
    time: torchvision raises for some boxes outside the image (None here)."""
    pasted = []
    for mask, box in zip(probs, boxes):
        try:
            xyxy = torch.from_numpy(box[None, [1, 0, 3, 2]])
            pasted.append(paste_masks_in_image(torch.from_numpy(mask)[None, None], xyxy, image_hw)[0, 0].numpy())
        except RuntimeError:
            pasted.append(None)
    return pasted


def test_paste_masks_torchvision_equals_torchvision(rng):
    jobs = []
    for image_hw, size in [((1, 1), 28), ((7, 5), 28), ((64, 80), 28), ((200, 150), 14), ((480, 640), 28),
                           ((50, 60), 1)]:
        boxes = random_boxes(rng, 40, image_hw)
        jobs.append(dict(masks=rng.uniform(size=(len(boxes), size, size)).astype(np.float32),
                         boxes=boxes, image_hw=image_hw))
    want = [torchvision_paste(job["masks"], job["boxes"], job["image_hw"]) for job in jobs]
    # The fused multiply-adds of PyTorch's AVX2 / AVX-512 kernels are reproduced bit for bit; its baseline
    # kernels (no FMA) differ in the last bit.
    fused = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    pasted_pixels, raised, small, large = 0, 0, 0, 0
    for job, expected in zip(jobs, want):
        got = masks.paste_masks_torchvision(job["masks"], job["boxes"], job["image_hw"])
        binary = masks.paste_masks_torchvision(job["masks"], job["boxes"], job["image_hw"], threshold=0.5)
        assert got.dtype == np.float32 and binary.dtype == np.uint8
        assert got.shape == binary.shape == (len(job["boxes"]),) + job["image_hw"]
        for d, reference in enumerate(expected):
            message = f"image {job['image_hw']}, box {job['boxes'][d]}"
            if reference is None:  # torchvision's slicing fails for some boxes without a pixel in the image
                raised += 1
                assert not got[d].any() and not binary[d].any(), message
                continue
            if fused:
                np.testing.assert_array_equal(got[d], reference, err_msg=message)
            np.testing.assert_allclose(got[d], reference, rtol=0, atol=1e-5, err_msg=message)
            np.testing.assert_array_equal(binary[d], reference > 0.5, err_msg=message)
            pasted_pixels += np.count_nonzero(reference)
            ymin, xmin, ymax, xmax = job["boxes"][d]
            widened = (ymax - ymin + xmax - xmin) * (job["masks"].shape[1] + 2) / job["masks"].shape[1]
            small += 0 < widened < 120
            large += widened > 140
    assert raised > 0 and pasted_pixels > 0 and small > 20 and large > 20


def test_fused_multiply_add_rounds_once(rng):
    def exact(a, b, c):
        value = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        nearest = np.float32(float(value))  # within one float32 step of the answer
        candidates = [nearest, np.nextafter(nearest, np.float32(np.inf)), np.nextafter(nearest, np.float32(-np.inf))]
        # Nearest, ties to even.
        return min(candidates, key=lambda v: (abs(Fraction(float(v)) - value), int(v.view(np.int32)) & 1))

    # a * b = 1 + 2^-11 + 2^-24 is halfway between two float32: a tiny c decides, which rounding the float64
    # sum to float32 (double rounding) gets wrong for c = 2^-60.
    a = b = np.float32(1 + 2**-12)
    for c in [0.0, 2.0**-60, -2.0**-60, 2.0**-80, 2.0**-140]:
        assert masks._fma32(np.array([a]), np.array([b]), np.array([c], np.float32))[0] == exact(a, b, c)
    values = rng.standard_normal((3, 2000)).astype(np.float32)
    values[:, :500] *= np.float32(1e-20)  # products below float32's normal range
    got = masks._fma32(*values)
    for i in range(values.shape[1]):
        assert got[i] == exact(*values[:, i])


def test_encode_pasted_masks_torchvision_is_the_rle_of_the_paste(rng):
    image_hw = (48, 64)
    boxes = random_boxes(rng, 25, image_hw)
    probs = rng.uniform(size=(len(boxes), 28, 28)).astype(np.float32)
    for paste, paste_masks in [("torchvision", masks.paste_masks_torchvision), ("exact", masks.paste_masks)]:
        encoded = masks.encode_pasted_masks(probs, boxes, image_hw, 0.5, paste=paste)
        decoded = mask_utils.decode(encoded).transpose(2, 0, 1)
        np.testing.assert_array_equal(decoded, paste_masks(probs, boxes, image_hw, threshold=0.5), err_msg=paste)
    np.testing.assert_array_equal(mask_utils.decode(masks.encode_pasted_masks(probs, boxes, image_hw, 0.5)),
                                  mask_utils.decode(masks.encode_pasted_masks(probs, boxes, image_hw, 0.5, "exact")))
    # torchvision's users threshold with >, paste_masks with >=.
    half = np.full((1, 4, 4), 0.5, np.float32)
    box = np.array([[8.0, 8.0, 40.0, 40.0]], np.float32)
    assert not mask_utils.decode(masks.encode_pasted_masks(half, box, image_hw, 0.5, paste="torchvision")).any()
    assert mask_utils.decode(masks.encode_pasted_masks(half, box, image_hw, 0.5)).any()
    with pytest.raises(ValueError, match="paste must be one of"):
        masks.encode_pasted_masks(probs, boxes, image_hw, 0.5, paste="pixel_centres")


@pytest.mark.parametrize("args, match", [
    ((np.zeros((2, 4, 5)), np.zeros((2, 4)), (8, 8)), "masks"),
    ((np.zeros((2, 4, 4)), np.zeros((3, 4)), (8, 8)), "boxes"),
    ((np.zeros((2, 4, 4)), np.full((2, 4), np.nan), (8, 8)), "finite"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8,)), "image_hw"),
    ((np.zeros((2, 4, 4)), np.zeros((2, 4)), (8, 8), float("inf")), "threshold"),
])
def test_paste_masks_torchvision_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        masks.paste_masks_torchvision(*args)
