"""Tests of dataset/make_shapes_dataset.py: exact segmentations (pycocotools is the oracle), valid COCO files,
occlusion, the variety the demo relies on, determinism and atomic output."""

import filecmp
import os

import numpy as np
import pytest
from pycocotools import mask as mask_utils
from PIL import Image
from pycocotools.coco import COCO

from dataset import make_shapes_dataset as shapes


def rasterize_polygons(polygons, height, width):
    """pycocotools' rasterization of a COCO polygon list: [height, width] bool."""
    rle = mask_utils.merge(mask_utils.frPyObjects([list(map(float, p)) for p in polygons], height, width))
    return mask_utils.decode(rle).astype(bool)


def disc(height, width, cx, cy, radius):
    y, x = np.mgrid[0:height, 0:width] + 0.5
    return (x - cx) ** 2 + (y - cy) ** 2 <= radius**2


def awkward_masks(rng):
    """Masks that stress an outline tracer: holes, islands in holes, diagonal contacts, borders, noise."""
    ring = disc(40, 40, 20, 20, 18) & ~disc(40, 40, 20, 20, 9)
    ring_with_island = ring | disc(40, 40, 20, 20, 4)
    checker = (np.indices((6, 7)).sum(0) % 2).astype(bool)  # every pixel touches its neighbours at corners only
    full = np.ones((5, 9), bool)
    yield "ring", ring
    yield "ring_with_island", ring_with_island
    yield "checker", checker
    yield "full", full
    yield "single_pixel", np.pad(np.ones((1, 1), bool), ((2, 3), (4, 1)))
    for index in range(30):
        height, width = rng.integers(3, 30, size=2)
        yield f"noise{index}", rng.random((height, width)) < rng.uniform(0.2, 0.8)


def test_mask_to_polygons_rasterizes_to_the_mask_exactly(rng):
    for name, mask in awkward_masks(rng):
        polygons = shapes.mask_to_polygons(mask)
        assert all(len(p) >= 6 and len(p) % 2 == 0 for p in polygons), name
        np.testing.assert_array_equal(rasterize_polygons(polygons, *mask.shape), mask, err_msg=name)


def test_mask_to_polygons_one_polygon_per_four_connected_part():
    two_parts = np.zeros((8, 8), bool)
    two_parts[1:3, 1:3] = True
    two_parts[3:5, 3:5] = True  # touches the first part at one corner only
    assert len(shapes.mask_to_polygons(two_parts)) == 2
    ring = disc(30, 30, 15, 15, 12) & ~disc(30, 30, 15, 15, 6)
    assert len(shapes.mask_to_polygons(ring)) == 1  # the hole is cut into the one polygon
    assert shapes.mask_to_polygons(np.zeros((4, 4), bool)) == []
    with pytest.raises(ValueError, match=r"\[H, W\]"):
        shapes.mask_to_polygons(np.zeros((2, 2, 2), bool))


def test_uncompressed_rle_round_trips_through_pycocotools(rng):
    for name, mask in awkward_masks(rng):
        rle = shapes.encode_uncompressed_rle(mask)
        assert rle["size"] == list(mask.shape) and sum(rle["counts"]) == mask.size, name
        decoded = mask_utils.decode(mask_utils.frPyObjects(rle, *mask.shape))
        np.testing.assert_array_equal(decoded.astype(bool), mask, err_msg=name)


def test_occlusion_keeps_only_visible_pixels_and_drops_hidden_objects():
    height, width = 40, 40
    bottom = np.zeros((height, width), bool)
    bottom[5:25, 5:25] = True
    hidden = np.zeros((height, width), bool)
    hidden[10:14, 10:14] = True  # entirely under `middle`: removed
    middle = np.zeros((height, width), bool)
    middle[8:20, 8:20] = True
    top = np.zeros((height, width), bool)
    top[15:35, 15:35] = True
    objects = [(1, bottom, 0), (2, hidden, 0), (3, middle, 0), (4, top, 0)]
    layers = shapes._visible_layers(objects)
    assert [category for category, _, _, _ in layers] == [1, 3, 4]
    visible = {category: seen for category, _, seen, _ in layers}
    np.testing.assert_array_equal(visible[4], top)
    np.testing.assert_array_equal(visible[3], middle & ~top)
    np.testing.assert_array_equal(visible[1], bottom & ~middle & ~top)

    # An object that keeps less than MIN_VISIBLE_FRACTION of its pixels is removed and occludes nothing.
    mostly_covered = np.zeros((height, width), bool)
    mostly_covered[0:10, 0:10] = True
    cover = np.zeros((height, width), bool)
    cover[0:10, 0:8] = True
    layers = shapes._visible_layers([(1, mostly_covered, 0), (2, cover, 0)])
    assert [category for category, _, _, _ in layers] == [2]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """A sample large enough to show every kind of scene (the demo uses the same generator)."""
    root = str(tmp_path_factory.mktemp("shapes"))
    paths = shapes.make_shapes_dataset(root, num_train=80, num_val=6, seed=0, min_size=64, max_size=112)
    return root, paths


def test_files_are_valid_coco_with_ids_from_one(sample):
    root, paths = sample
    assert sorted(paths) == ["train", "val"]
    for split, path in paths.items():
        assert path == os.path.join(root, "annotations", f"instances_{split}.json")
        coco = COCO(path)
        images, annotations = coco.dataset["images"], coco.dataset["annotations"]
        assert [image["id"] for image in images] == list(range(1, len(images) + 1))
        assert [a["id"] for a in annotations] == list(range(1, len(annotations) + 1))
        assert [c["id"] for c in coco.dataset["categories"]] == list(range(1, len(shapes.CATEGORIES) + 1))
        assert [c["name"] for c in coco.dataset["categories"]] == list(shapes.CATEGORIES)
        for image in images:
            with Image.open(os.path.join(root, split, image["file_name"])) as decoded:
                assert (decoded.format, decoded.mode) == ("JPEG", "RGB")
                assert decoded.size == (image["width"], image["height"])
        leftovers = [f for _, _, files in os.walk(root) for f in files if ".tmp" in f]
        assert leftovers == []


def test_segmentations_area_and_boxes_are_exact_and_disjoint(sample):
    _, paths = sample
    coco = COCO(paths["train"])
    for image in coco.dataset["images"]:
        covered = np.zeros((image["height"], image["width"]), np.int32)
        annotations = coco.loadAnns(coco.getAnnIds(imgIds=image["id"], iscrowd=None))
        assert sum(1 for a in annotations if not a["iscrowd"]) <= shapes.MAX_OBJECTS
        for annotation in annotations:
            if annotation["iscrowd"]:
                assert isinstance(annotation["segmentation"], dict)
                assert isinstance(annotation["segmentation"]["counts"], list)  # uncompressed, as COCO's crowds
            else:
                assert isinstance(annotation["segmentation"], list)
            mask = coco.annToMask(annotation)
            covered += mask
            assert mask.sum() == annotation["area"]
            rows, cols = np.nonzero(mask)
            tight = [cols.min(), rows.min(), cols.max() + 1 - cols.min(), rows.max() + 1 - rows.min()]
            assert annotation["bbox"] == [float(v) for v in tight]
        assert covered.max() <= 1  # occlusion: a pixel belongs to at most one object


def test_sample_has_negatives_crowds_every_class_and_spread_sizes(sample):
    _, paths = sample
    coco = COCO(paths["train"])
    annotations = coco.dataset["annotations"]
    per_image = {image["id"]: 0 for image in coco.dataset["images"]}
    for annotation in annotations:
        per_image[annotation["image_id"]] += 1
    assert 0 < sum(1 for n in per_image.values() if n == 0) < len(per_image) / 3
    assert any(a["iscrowd"] for a in annotations)
    solid = [a for a in annotations if not a["iscrowd"]]
    assert {a["category_id"] for a in solid} == set(range(1, len(shapes.CATEGORIES) + 1))
    sides = np.array([max(a["bbox"][2:]) for a in solid])
    shortest_image_side = min(min(image["height"], image["width"]) for image in coco.dataset["images"])
    assert sides.min() <= 12 and sides.max() >= 0.4 * shortest_image_side


def _all_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def test_same_seed_gives_identical_files_and_splits_are_independent(tmp_path):
    first, second, other, more_train = (str(tmp_path / name) for name in ("a", "b", "c", "d"))
    shapes.make_shapes_dataset(first, num_train=4, num_val=3, seed=7, min_size=48, max_size=80)
    shapes.make_shapes_dataset(second, num_train=4, num_val=3, seed=7, min_size=48, max_size=80)
    shapes.make_shapes_dataset(other, num_train=4, num_val=3, seed=8, min_size=48, max_size=80)
    shapes.make_shapes_dataset(more_train, num_train=6, num_val=3, seed=7, min_size=48, max_size=80)
    files = _all_files(first)
    assert files == _all_files(second) and len(files) == 4 + 3 + 2
    _, mismatch, errors = filecmp.cmpfiles(first, second, files, shallow=False)
    assert mismatch == [] and errors == []
    _, mismatch, _ = filecmp.cmpfiles(first, other, files, shallow=False)
    assert mismatch
    val_files = [f for f in files if f.startswith("val") or f.endswith("instances_val.json")]
    _, mismatch, errors = filecmp.cmpfiles(first, more_train, val_files, shallow=False)
    assert mismatch == [] and errors == []


def test_interrupted_run_leaves_no_annotation_file(tmp_path, monkeypatch):
    root = str(tmp_path)
    shapes.make_shapes_dataset(root, num_train=3, num_val=0, seed=0, min_size=48, max_size=64)
    annotation_file = tmp_path / "annotations" / "instances_train.json"
    assert annotation_file.exists()
    real, calls = shapes.render_scene, []

    def interrupted_on_third(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(shapes, "render_scene", interrupted_on_third)
    with pytest.raises(KeyboardInterrupt):
        shapes.make_shapes_dataset(root, num_train=3, num_val=0, seed=1, min_size=48, max_size=64)
    # The old file would describe images the second run has already replaced: it must be gone too.
    assert not annotation_file.exists()
    assert [f for f in _all_files(root) if ".tmp" in f] == []


def test_fixed_image_size_and_cli(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--num_train", "3", "--num_val", "1", "--image_size", "40", "56"]
    assert shapes.main(argv) == 0
    coco = COCO(str(tmp_path / "annotations" / "instances_train.json"))
    assert {(image["height"], image["width"]) for image in coco.dataset["images"]} == {(40, 56)}
    with pytest.raises(SystemExit) as exit_info:
        shapes.main(["--output_dir", str(tmp_path), "--image_size", "16", "16"])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="min_size"):
        shapes.make_shapes_dataset(str(tmp_path), 1, 1, min_size=100, max_size=64)
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        shapes.make_shapes_dataset(str(tmp_path / "file"), 1, 1)
