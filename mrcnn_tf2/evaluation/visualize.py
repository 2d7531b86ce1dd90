"""Pictures of detections for people to look at: masks, boxes, class names and scores over the image.

A picture is drawn at the original image's size, where the detections are (they are mapped to original-image
pixels for the COCO results too), and a small image is first scaled up so that its shorter side is
MIN_DRAWN_SIDE (its longer side at most MAX_UPSCALED_SIDE): the labels' text then stays legible. Box outlines
and the font grow with the drawn size, so that a picture looks the same at any size. Masks are pasted at the
drawn size, from the mask probabilities, with the threshold of the COCO results.

Labels are drawn in Pillow's built-in font, whose glyphs are ASCII only, or in a TrueType / OpenType font file
(`main.py infer --visualize_font`); a character the font lacks draws as a box (`missing_glyphs` finds them).

This module draws only: it reads no file but the labels' font and writes none (`main.py infer` saves the
pictures), and it must not import the runtime.

Glossary: D detections, R the mask side, h x w the image's size, H' x W' the picture's.
"""

import functools

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mrcnn_tf2.evaluation.coco_metrics import MASK_THRESHOLD
from mrcnn_tf2.ops.masks import paste_masks

# Smallest shorter side of a picture, in pixels. The demo's images are 128 x 128: drawn as they are, a label
# in a readable font covers a quarter of the image, and a small font is illegible once the picture is
# enlarged on a screen. Upscaled to 512 px, a 16 px label is ~3 % of the side, like a caption on a photo.
MIN_DRAWN_SIDE = 512
# Largest longer side that upscaling makes: a strip (1 x 3000 pixels) would otherwise become a picture of 512 x
# 1.5 million pixels, more memory than the run and more pixels than Pillow opens.
MAX_UPSCALED_SIDE = 4096
# Box outline width and label font size, in pixels, of a picture whose shorter side is MIN_DRAWN_SIDE; a
# larger picture scales both with its shorter side.
BOX_WIDTH = 2
FONT_SIZE = 16
# Opacity of the mask overlay: the object stays visible under its colour.
MASK_OPACITY = 0.45
# Distinct colours, one per class id (cycled).
PALETTE = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (170, 110, 40))


@functools.lru_cache(maxsize=16)  # read once, not for every picture (a CJK font file is 20 MB)
def label_font(path, size):
    """The font labels are drawn in, `size` pixels tall: the TrueType / OpenType file `path` (.ttf, .otf, .ttc),
    or Pillow's built-in font when `path` is None. Raises OSError when `path` is not a font file."""
    return ImageFont.load_default(size) if path is None else ImageFont.truetype(path, size)


def missing_glyphs(text, font):
    """The characters of `text`, in order and once each, that `font` has no glyph for: it draws them as its
    'missing' box, the drawing of a private-use code point that no font maps."""
    missing = font.getmask("\U0010FFFD")

    def lacks(char):
        mask = font.getmask(char)
        return mask.size == missing.size and bytes(mask) == bytes(missing)

    return "".join(dict.fromkeys(char for char in text if not char.isspace() and lacks(char)))


def drawn_size(height, width):
    """(H', W') of the picture of an h x w image: (h, w), or scaled up keeping the aspect ratio so that the
    shorter side is MIN_DRAWN_SIDE when it is shorter, as far as the longer side stays within
    MAX_UPSCALED_SIDE."""
    scale = max(1.0, min(MIN_DRAWN_SIDE / min(height, width), MAX_UPSCALED_SIDE / max(height, width)))
    return int(round(height * scale)), int(round(width * scale))


def draw_detections(image, boxes, classes, scores, masks, names, score_threshold, font_path=None):
    """The picture of `image` with each detection scoring >= score_threshold: mask overlay, box, 'name score'.

    Args:
      image: [h, w, 3] uint8 RGB, the original image.
      boxes: [D, 4] float [ymin, xmin, ymax, xmax] in pixels of `image`.
      classes: [D] int class ids; scores: [D] float in [0, 1].
      masks: [D, R, R] float mask probabilities inside each box (pasted at coco_metrics.MASK_THRESHOLD),
        or None to draw boxes only.
      names: {class id: name}; ids it lacks are drawn as the id.
      score_threshold: detections below it are left out.
      font_path: the labels' font file (`label_font`); None: Pillow's built-in font.

    Returns:
      [H', W', 3] uint8 RGB, a new array of `drawn_size(h, w)`: the image, scaled up when small, with the
      detections drawn at the same scale.
    """
    image = np.asarray(image, np.uint8)
    height, width = image.shape[:2]
    drawn_h, drawn_w = drawn_size(height, width)
    keep = np.asarray(scores) >= score_threshold
    # [D, 4] in pixels of the picture: per axis, as the sides are rounded separately.
    boxes = np.asarray(boxes, np.float32)[keep] * np.array([drawn_h / height, drawn_w / width] * 2, np.float32)
    classes, scores = np.asarray(classes)[keep], np.asarray(scores)[keep]
    colours = np.array([PALETTE[int(c) % len(PALETTE)] for c in classes], np.float32).reshape(-1, 3)
    picture = Image.fromarray(image)
    if (drawn_h, drawn_w) != (height, width):
        picture = picture.resize((drawn_w, drawn_h), Image.Resampling.BILINEAR)
    if masks is not None and len(boxes):
        canvas = np.asarray(picture, np.float32)
        pasted = paste_masks(np.asarray(masks, np.float32)[keep], boxes, (drawn_h, drawn_w), threshold=MASK_THRESHOLD)
        for mask, colour in zip(pasted.astype(bool), colours):
            canvas[mask] = (1.0 - MASK_OPACITY) * canvas[mask] + MASK_OPACITY * colour
        picture = Image.fromarray(np.clip(np.round(canvas), 0, 255).astype(np.uint8))
    scale = min(drawn_h, drawn_w) / MIN_DRAWN_SIDE
    line_width = max(1, int(round(BOX_WIDTH * scale)))
    font = label_font(font_path, max(1, int(round(FONT_SIZE * scale))))
    draw = ImageDraw.Draw(picture)
    for (ymin, xmin, ymax, xmax), class_id, score, colour in zip(boxes.tolist(), classes, scores, colours):
        colour = tuple(int(v) for v in colour)
        draw.rectangle([xmin, ymin, xmax, ymax], outline=colour, width=line_width)
        label = f"{names.get(int(class_id), str(int(class_id)))} {float(score):.2f}"
        left, top, right, bottom = draw.textbbox((xmin, ymin), label, font=font)
        # The label sits above the box, or inside it at the top when the box touches the picture's top.
        shift = bottom - top + line_width if ymin >= bottom - top + line_width else 0
        draw.rectangle([left, top - shift, right + line_width, bottom - shift], fill=colour)
        draw.text((xmin + line_width / 2, ymin - shift), label, fill=(0, 0, 0), font=font)
    return np.asarray(picture)
