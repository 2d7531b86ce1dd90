"""Generates the synthetic shapes dataset: the embedded default data of the demo and the tests.

    python dataset/make_shapes_dataset.py --output_dir D --num_train 400 --num_val 50 --seed 0

writes D/train/*.jpg, D/val/*.jpg and COCO annotation files D/annotations/instances_train.json and
D/annotations/instances_val.json, ready for dataset/create_coco_tf_record.py.

A scene is a textured background (linear gradient, smooth blotches or soft stripes, plus pixel noise)
with 0 to MAX_OBJECTS shapes of the classes in CATEGORIES, in random colours that contrast with what lies
beneath them, sized from about 8 px to half the shorter image side (log-uniform, so small objects are
common), some overlapping. About EMPTY_IMAGE_PROBABILITY of the images have no object at all (negatives),
and about CROWD_PROBABILITY of the others have one crowd region: a cluster of small shapes of one class
annotated as a single iscrowd=1 instance.

Annotations describe what is visible. Shapes are stacked in generation order, later ones on top: the
mask of an object is its own pixels minus those of every object above it, and an object left with less
than MIN_VISIBLE_FRACTION of its pixels (or fewer than MIN_VISIBLE_PIXELS) is removed from the scene
before painting, so no unlabelled fragment remains in the image. bbox is [x, y, width, height], tight
around the visible mask; area is the visible mask's pixel count.

Segmentations are exact, not approximations: a non-crowd object is a list of polygons whose vertices
are integer pixel corners (pixel (row r, column c) is the square [c, c + 1] x [r, r + 1]), one polygon per
connected part of the visible mask, tracing the pixel boundary. A part with holes (a ring, or an object
with a smaller one on top of it) stays one polygon: each hole's outline is joined to the outer outline by
a zero-width cut, walked there and back. pycocotools fills polygons by the even-odd rule, so the cut
cancels and its rasterization equals the visible mask pixel for pixel (tests/test_make_shapes_dataset.py
checks this); a viewer that draws outlines shows the cut as a line. Crowd regions are uncompressed RLE,
as in COCO.

Ids (images, annotations, categories) start at 1 in each split; image files are named after their split and
id (val_000001.jpg), so that records and an annotation file of different splits never agree on a file name
(`main.py eval` refuses such a pair: the records' file names are its check). Image i of a split depends only on
(seed, split, i): the same seed gives byte-identical files, and changing --num_train does not change
the validation images. Every file is written under a temporary name and renamed when complete; a split's
annotation file is removed before its images are (re)written and written last, so an interrupted run never
leaves an annotation file that looks complete.

This module generates data only: it must not depend on TensorFlow; of the package it imports
mrcnn_tf2.data.coco_io, mrcnn_tf2.files and mrcnn_tf2.status alone.
"""

import argparse
import math
import os
import sys

import numpy as np
from PIL import Image

from mrcnn_tf2 import files, status
from mrcnn_tf2.data.coco_io import encode_jpeg

# Category names; the category id of CATEGORIES[i] is i + 1.
CATEGORIES = ("circle", "square", "triangle", "star", "ring")
# Smallest size (diameter of the enclosing circle, px) at which each shape is still recognisable.
MIN_SHAPE_SIZE = {"circle": 8, "square": 8, "triangle": 10, "star": 14, "ring": 14}
# Points of the star and the ratio of its inner to its outer radius.
STAR_POINTS, STAR_INNER_RATIO = 5, 0.45
# Range of a ring's inner to outer radius: thick enough to stay a ring when small.
RING_INNER_RATIO = (0.45, 0.6)
# Circumradius of a square relative to the enclosing circle, so squares look as big as circles.
SQUARE_RADIUS_RATIO = 0.9
# Objects per image (crowd regions not counted): 0 with EMPTY_IMAGE_PROBABILITY, else 1..MAX_OBJECTS.
MAX_OBJECTS = 6
EMPTY_IMAGE_PROBABILITY = 0.1
# Chance that a non-empty image also has one crowd region, and that region's make-up.
CROWD_PROBABILITY = 0.15
CROWD_MEMBERS = (5, 10)
CROWD_MEMBER_SIZE = (5, 8)
CROWD_MIN_RADIUS = 10
# An object keeping less than this share of its pixels (or fewer pixels) under the ones above is removed.
MIN_VISIBLE_FRACTION = 0.4
MIN_VISIBLE_PIXELS = 16
# Smallest RGB distance wanted between an object's colour and the mean colour beneath it.
MIN_CONTRAST = 100.0
COLOUR_ATTEMPTS = 8
# Largest colour difference between the two tones of a background: texture, not a second object.
BACKGROUND_CONTRAST = 70.0
# Smallest image side: objects up to half of it must fit the largest minimum shape size.
MIN_IMAGE_SIDE = 32
DEFAULT_MIN_SIZE, DEFAULT_MAX_SIZE = 128, 256
SPLITS = ("train", "val")


# ----------------------------------------------------------------------------------------------------
# Masks to COCO segmentations


def _trace_boundaries(mask):
    """Closed outlines of a binary mask along pixel edges.

    Each outline is walked with the foreground on its right (in image coordinates, y down), so outer
    outlines have positive shoelace area and holes negative. Where two foreground pixels touch only at a
    corner the walk turns right, keeping them in separate outlines (4-connected parts).

    Args:
      mask: [H, W] bool.

    Returns:
      list of [V, 2] int64 arrays of (x, y) pixel corners, collinear vertices removed.
    """
    height, width = mask.shape
    padded = np.pad(mask, 1)
    stride = width + 1  # corner (x, y) has index y * stride + x
    above, below = padded[:-1, 1:-1], padded[1:, 1:-1]  # the pixels on either side of each horizontal edge
    left, right = padded[1:-1, :-1], padded[1:-1, 1:]  # ... and of each vertical edge
    starts, ends, headings = [], [], []  # heading: 0 +x, 1 +y, 2 -x, 3 -y

    def add(start, end, heading):
        starts.append(start)
        ends.append(end)
        headings.append(np.full(len(start), heading))

    y, x = np.nonzero(below & ~above)  # top edge of a foreground pixel
    add(y * stride + x, y * stride + x + 1, 0)
    y, x = np.nonzero(above & ~below)  # bottom edge
    add(y * stride + x + 1, y * stride + x, 2)
    y, x = np.nonzero(right & ~left)  # left edge
    add((y + 1) * stride + x, y * stride + x, 3)
    y, x = np.nonzero(left & ~right)  # right edge
    add(y * stride + x, (y + 1) * stride + x, 1)
    starts = np.concatenate(starts).tolist()
    ends = np.concatenate(ends).tolist()
    headings = np.concatenate(headings).tolist()

    leaving = {}
    for edge, corner in enumerate(starts):
        leaving.setdefault(corner, []).append(edge)
    used = [False] * len(starts)
    outlines = []
    for first in range(len(starts)):
        if used[first]:
            continue
        loop, edge = [], first
        while not used[edge]:
            used[edge] = True
            loop.append(edge)
            choices = [e for e in leaving[ends[edge]] if not used[e] or e == first]
            if len(choices) == 1:
                edge = choices[0]
            else:  # a corner shared by two diagonal pixels: keep hugging the pixel on the right
                edge = next(e for e in choices if headings[e] == (headings[edge] + 1) % 4)
        corners = np.array([starts[e] for i, e in enumerate(loop) if headings[e] != headings[loop[i - 1]]])
        outlines.append(np.stack([corners % stride, corners // stride], axis=1))
    return outlines


def _shoelace_area(outline):
    """Signed area of a closed outline: [V, 2] (x, y) -> float, positive for outer outlines."""
    x, y = outline[:, 0].astype(np.float64), outline[:, 1].astype(np.float64)
    return 0.5 * float(np.sum(x * np.roll(y, -1) - np.roll(x, -1) * y))


def _inside_polygon(x, y, vertices):
    """Even-odd point-in-polygon test.

    Args:
      x, y: float arrays of one shape, the points.
      vertices: [V, 2] float (x, y), the closed polygon.

    Returns:
      bool array of the points' shape.
    """
    inside = np.zeros(np.shape(x), bool)
    for (x0, y0), (x1, y1) in zip(vertices, np.roll(vertices, -1, axis=0)):
        if y0 == y1:  # a horizontal edge is never crossed by a horizontal ray
            continue
        inside ^= ((y0 > y) != (y1 > y)) & (x < (x1 - x0) * (y - y0) / (y1 - y0) + x0)
    return inside


def mask_to_polygons(mask):
    """COCO polygons whose pycocotools rasterization is exactly `mask`.

    One polygon per 4-connected part, its holes joined to it by zero-width cuts (see the module
    docstring); vertices are integer pixel corners.

    Args:
      mask: [H, W] bool or {0, 1}.

    Returns:
      list of flat [x0, y0, x1, y1, ...] int lists; empty when the mask is empty.
    """
    mask = np.asarray(mask, bool)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [H, W], got shape {mask.shape}")
    outlines = _trace_boundaries(mask)
    areas = [_shoelace_area(o) for o in outlines]
    outers = [i for i, a in enumerate(areas) if a > 0]
    holes_of = {i: [] for i in outers}
    for hole in (i for i, a in enumerate(areas) if a < 0):
        # The centre of the pixel beside the hole's first edge belongs to the part that owns the hole: of
        # the outer outlines around that point, the part's own is the smallest.
        first, second = outlines[hole][0], outlines[hole][1]
        heading = np.sign(second - first)
        probe = first + 0.5 * heading + 0.5 * np.array([-heading[1], heading[0]])
        owner = min(
            (areas[o], o) for o in outers if _inside_polygon(probe[0], probe[1], outlines[o].astype(float))
        )[1]
        holes_of[owner].append(hole)
    polygons = []
    for outer in outers:
        polygon = outlines[outer]
        for hole in holes_of[outer]:
            ring = outlines[hole]
            # Cut between the closest pair of vertices: the shortest, least distracting line in a viewer.
            distances = ((polygon[:, None, :] - ring[None, :, :]) ** 2).sum(-1)
            i, j = np.unravel_index(np.argmin(distances), distances.shape)
            polygon = np.concatenate([polygon[: i + 1], np.roll(ring, -j, axis=0), ring[j : j + 1], polygon[i:]])
        polygons.append(polygon.ravel().tolist())
    return polygons


def encode_uncompressed_rle(mask):
    """COCO uncompressed RLE of a mask: runs over the column-major pixels, starting with a 0-run.

    Args:
      mask: [H, W] bool or {0, 1}.

    Returns:
      {"size": [H, W], "counts": [int, ...]}, counts summing to H * W.
    """
    mask = np.asarray(mask, bool)
    flat = mask.T.ravel()  # column-major order, as COCO's RLE
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate([[0], changes, [flat.size]])).tolist()
    if flat.size and flat[0]:
        counts = [0] + counts
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": counts}


# ----------------------------------------------------------------------------------------------------
# Scenes


def _shape_mask(name, centre, size, angle, inner_ratio, height, width):
    """Pixels of one whole shape (before occlusion), sampled at pixel centres.

    Args:
      name: one of CATEGORIES.
      centre: (x, y) in pixels.
      size: diameter of the enclosing circle, pixels.
      angle: rotation, radians.
      inner_ratio: a ring's inner to outer radius (ignored by other shapes).
      height, width: image size.

    Returns:
      [height, width] bool.
    """
    radius = size / 2.0
    cx, cy = centre
    x0, x1 = max(int(cx - radius) - 1, 0), min(int(cx + radius) + 2, width)
    y0, y1 = max(int(cy - radius) - 1, 0), min(int(cy + radius) + 2, height)
    mask = np.zeros((height, width), bool)
    if x0 >= x1 or y0 >= y1:
        return mask
    dy, dx = np.mgrid[y0:y1, x0:x1] + 0.5
    dx, dy = dx - cx, dy - cy
    squared = dx * dx + dy * dy
    if name == "circle":
        inside = squared <= radius * radius
    elif name == "ring":
        inside = (squared <= radius * radius) & (squared >= (inner_ratio * radius) ** 2)
    else:
        if name == "square":
            radii, turns = np.full(4, SQUARE_RADIUS_RATIO * radius), np.arange(4) / 4.0
        elif name == "triangle":
            radii, turns = np.full(3, radius), np.arange(3) / 3.0
        elif name == "star":
            radii = np.tile([radius, STAR_INNER_RATIO * radius], STAR_POINTS)
            turns = np.arange(2 * STAR_POINTS) / (2.0 * STAR_POINTS)
        else:
            raise ValueError(f"unknown shape {name!r}; expected one of {CATEGORIES}")
        theta = angle + 2.0 * np.pi * turns
        vertices = np.stack([radii * np.cos(theta), radii * np.sin(theta)], axis=1)
        inside = _inside_polygon(dx, dy, vertices)
    mask[y0:y1, x0:x1] = inside
    return mask


def _sample_objects(rng, height, width):
    """Whole shapes of one scene, bottom first.

    Returns:
      list of (category_id, [height, width] bool mask, iscrowd).
    """
    if rng.random() < EMPTY_IMAGE_PROBABILITY:
        return []
    largest = min(height, width) / 2.0
    objects = []
    for _ in range(int(rng.integers(1, MAX_OBJECTS + 1))):
        label = int(rng.integers(len(CATEGORIES)))
        name = CATEGORIES[label]
        smallest = min(MIN_SHAPE_SIZE[name], largest)
        size = math.exp(rng.uniform(math.log(smallest), math.log(largest)))
        # Centres keep at least about half of every object inside the image.
        centre = (rng.uniform(size / 4, width - size / 4), rng.uniform(size / 4, height - size / 4))
        mask = _shape_mask(
            name, centre, size, rng.uniform(0, 2 * np.pi), rng.uniform(*RING_INNER_RATIO), height, width
        )
        objects.append((label + 1, mask, 0))
    if rng.random() < CROWD_PROBABILITY:
        label = int(rng.integers(len(CATEGORIES)))
        spread = rng.uniform(CROWD_MIN_RADIUS, max(CROWD_MIN_RADIUS, min(height, width) / 5.0))
        cx, cy = rng.uniform(spread, width - spread), rng.uniform(spread, height - spread)
        mask = np.zeros((height, width), bool)
        for _ in range(int(rng.integers(CROWD_MEMBERS[0], CROWD_MEMBERS[1] + 1))):
            r, phi = spread * math.sqrt(rng.random()), rng.uniform(0, 2 * np.pi)
            centre = (cx + r * math.cos(phi), cy + r * math.sin(phi))
            size = rng.uniform(*CROWD_MEMBER_SIZE)
            mask |= _shape_mask(
                CATEGORIES[label], centre, size, rng.uniform(0, 2 * np.pi), RING_INNER_RATIO[0], height, width
            )
        objects.insert(int(rng.integers(len(objects) + 1)), (label + 1, mask, 1))
    return objects


def _visible_layers(objects):
    """Keeps the objects that stay visible enough under those above them.

    Args:
      objects: list of (category_id, [H, W] bool whole mask, iscrowd), bottom first.

    Returns:
      list of (category_id, whole mask, visible mask, iscrowd), bottom first: the kept objects only, each
      visible mask being its whole mask minus the whole masks of the kept objects above it.
    """
    if not objects:
        return []
    kept = []
    covered = np.zeros_like(objects[0][1])
    for category_id, mask, iscrowd in reversed(objects):
        visible = mask & ~covered
        seen = int(visible.sum())
        if seen >= MIN_VISIBLE_PIXELS and seen >= MIN_VISIBLE_FRACTION * mask.sum():
            kept.append((category_id, mask, visible, iscrowd))
            covered = covered | mask
    return kept[::-1]


def _blend(tone, first, second):
    """[H, W] float weights in [0, 1] -> [H, W, 3] float mix of two RGB colours."""
    return first + tone[..., None] * (second - first)


def _background(rng, height, width):
    """A textured background, [height, width, 3] float32 in 0..255."""
    first = rng.uniform(0, 255, 3)
    second = np.clip(first + rng.uniform(-BACKGROUND_CONTRAST, BACKGROUND_CONTRAST, 3), 0, 255)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    along = x * math.cos(angle) + y * math.sin(angle)
    kind = int(rng.integers(3))
    if kind == 0:  # linear gradient
        tone = (along - along.min()) / max(float(along.max() - along.min()), 1.0)
    elif kind == 1:  # smooth blotches: a coarse random grid, bilinearly upsampled
        coarse = rng.random((int(rng.integers(2, 7)), int(rng.integers(2, 7)))).astype(np.float32)
        tone = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))
    else:  # soft stripes
        tone = 0.5 + 0.5 * np.sin(2 * np.pi * along / rng.uniform(6, 32))
    return _blend(tone, first, second).astype(np.float32)


def _pick_colour(rng, beneath):
    """An RGB colour (3 floats) at least MIN_CONTRAST from `beneath`, else the farthest of the tries."""
    best, best_distance = None, -1.0
    for _ in range(COLOUR_ATTEMPTS):
        colour = rng.uniform(0, 255, 3)
        distance = float(np.linalg.norm(colour - beneath))
        if distance >= MIN_CONTRAST:
            return colour
        if distance > best_distance:
            best, best_distance = colour, distance
    return best


def render_scene(rng, height, width):
    """Draws one scene.

    Args:
      rng: numpy Generator, the only source of randomness.
      height, width: image size in pixels.

    Returns:
      image: [height, width, 3] uint8 RGB.
      objects: list of (category_id, [height, width] bool visible mask, iscrowd), bottom first; the visible
        masks are disjoint.
    """
    canvas = _background(rng, height, width)
    layers = _visible_layers(_sample_objects(rng, height, width))
    for _, mask, _, _ in layers:
        colour = _pick_colour(rng, canvas[mask].mean(axis=0))
        # A gentle shading across the object, so that shapes are not flat stickers.
        slope = rng.uniform(-0.15, 0.15, 2)
        y, x = np.nonzero(mask)
        shade = 1.0 + slope[0] * (x - x.mean()) / width + slope[1] * (y - y.mean()) / height
        canvas[y, x] = colour[None, :] * shade[:, None]
    canvas += rng.normal(0.0, rng.uniform(2.0, 8.0), canvas.shape).astype(np.float32)
    image = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    return image, [(category_id, visible, iscrowd) for category_id, _, visible, iscrowd in layers]


def annotate(visible_mask, category_id, iscrowd, image_id, annotation_id):
    """The COCO annotation of one visible object.

    Args:
      visible_mask: [H, W] bool, not empty.
      category_id, iscrowd, image_id, annotation_id: ints.

    Returns:
      dict with id, image_id, category_id, iscrowd, bbox [x, y, w, h] (tight around the mask, pixels),
      area (the mask's pixel count) and segmentation (polygons, or uncompressed RLE for a crowd).
    """
    rows, cols = np.nonzero(visible_mask)
    if rows.size == 0:
        raise ValueError(f"annotation {annotation_id}: empty mask")
    x0, y0 = int(cols.min()), int(rows.min())
    segmentation = encode_uncompressed_rle(visible_mask) if iscrowd else mask_to_polygons(visible_mask)
    return {
        "id": annotation_id,
        "image_id": image_id,
        "category_id": category_id,
        "iscrowd": iscrowd,
        "bbox": [float(x0), float(y0), float(cols.max() + 1 - x0), float(rows.max() + 1 - y0)],
        "area": float(rows.size),
        "segmentation": segmentation,
    }


def _image_size(rng, min_size, max_size, image_size):
    """(height, width) of one image: image_size when given, else each side uniform in [min_size, max_size]."""
    if image_size is not None:
        return tuple(image_size)
    return int(rng.integers(min_size, max_size + 1)), int(rng.integers(min_size, max_size + 1))


def make_split(output_dir, split, num_images, seed, min_size, max_size, image_size=None):
    """Writes the images and the annotation file of one split.

    Returns:
      path of the annotation file, output_dir/annotations/instances_<split>.json.
    """
    image_dir = os.path.join(output_dir, split)
    annotation_dir = os.path.join(output_dir, "annotations")
    os.makedirs(image_dir, exist_ok=True)
    os.makedirs(annotation_dir, exist_ok=True)
    path = os.path.join(annotation_dir, f"instances_{split}.json")
    files.remove(path)  # it would describe images about to be overwritten until the new one is complete
    images, annotations = [], []
    for index in range(num_images):
        rng = np.random.default_rng([seed, SPLITS.index(split), index])
        height, width = _image_size(rng, min_size, max_size, image_size)
        pixels, objects = render_scene(rng, height, width)
        image_id = index + 1
        file_name = f"{split}_{image_id:06d}.jpg"
        files.write_bytes(os.path.join(image_dir, file_name), encode_jpeg(Image.fromarray(pixels)))
        images.append({"id": image_id, "file_name": file_name, "height": height, "width": width})
        for category_id, mask, iscrowd in objects:
            annotations.append(annotate(mask, category_id, iscrowd, image_id, len(annotations) + 1))
    dataset = {
        "info": {"description": "synthetic shapes (dataset/make_shapes_dataset.py)", "seed": seed, "split": split},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(CATEGORIES)],
    }
    files.write_json(path, dataset)
    return path


def make_shapes_dataset(
    output_dir, num_train, num_val, seed=0, min_size=DEFAULT_MIN_SIZE, max_size=DEFAULT_MAX_SIZE, image_size=None
):
    """Writes the train and val splits under output_dir (see the module docstring for the layout).

    Args:
      output_dir: destination directory, created if needed.
      num_train, num_val: images per split (>= 0).
      seed: non-negative int; the same seed gives the same files.
      min_size, max_size: range of each image side when image_size is None.
      image_size: (height, width) of every image, or None.

    Returns:
      dict split -> path of its annotation file.
    """
    if num_train < 0 or num_val < 0:
        raise ValueError(f"image counts must be >= 0, got num_train={num_train}, num_val={num_val}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    sides = tuple(image_size) if image_size is not None else (min_size, max_size)
    if len(sides) != 2 or min(sides) < MIN_IMAGE_SIDE:
        raise ValueError(f"image sides must be >= {MIN_IMAGE_SIDE} px, got {sides}")
    if image_size is None and min_size > max_size:
        raise ValueError(f"min_size ({min_size}) must not exceed max_size ({max_size})")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir} is a file, not a directory")
    counts = {"train": num_train, "val": num_val}
    return {
        split: make_split(output_dir, split, counts[split], seed, min_size, max_size, image_size)
        for split in SPLITS
    }


def build_parser():
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="destination: train/, val/, annotations/")
    parser.add_argument("--num_train", type=int, default=400, help="training images")
    parser.add_argument("--num_val", type=int, default=50, help="validation images")
    parser.add_argument("--seed", type=int, default=0, help="random seed (>= 0); same seed, same files")
    parser.add_argument("--min_size", type=int, default=DEFAULT_MIN_SIZE, help="smallest image side, px")
    parser.add_argument("--max_size", type=int, default=DEFAULT_MAX_SIZE, help="largest image side, px")
    parser.add_argument(
        "--image_size", type=int, nargs=2, metavar=("H", "W"), help="fixed image size (overrides min/max_size)"
    )
    return parser


def main(argv=None):
    """Command-line entry; returns the exit status (status.BAD_INPUT for bad arguments, from argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        paths = make_shapes_dataset(
            args.output_dir, args.num_train, args.num_val, args.seed, args.min_size, args.max_size, args.image_size
        )
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.num_train} train and {args.num_val} val images: {', '.join(paths.values())}")
    return status.OK


if __name__ == "__main__":
    sys.exit(main())
