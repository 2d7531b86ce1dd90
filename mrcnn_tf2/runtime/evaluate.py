"""`main.py eval`: COCO box and mask AP of the latest checkpoint in model_dir on the validation TFRecords.

The run restores the model weights of the newest checkpoint (not the optimizer), predicts over at most
eval.eval_samples validation images in batches of eval.eval_batch_size, turns the detections into COCO
results (boxes [x, y, w, h] and RLE masks in original-image pixels, see `mrcnn_tf2.evaluation.coco_metrics`),
scores them with COCOeval against eval.eval_file, prints the table, and writes two files to model_dir,
each atomically (`mrcnn_tf2.files`): eval_results.json (metrics, checkpoint, step, image count, time
breakdown) and detections.json (the COCO results, in image id order). With data.pad_to_multiple (the
torchvision presets) a batch holds only images of one padded shape, so an image's detections are those it
gets alone, as in torchvision's evaluation of one image per batch.

Training evaluates its live model with the same `run_evaluation` through `TrainingEvaluator`. The model is
restored and run by `mrcnn_tf2.runtime.predictor`, as `main.py infer` and `main.py export` do.
"""

import dataclasses
import json
import os
import sys
import time
import warnings

from mrcnn_tf2 import files, status
from mrcnn_tf2.config import SAVED_CONFIG_FILE, ConfigError
from mrcnn_tf2.data.pipeline import InputPipeline, evaluation_images
from mrcnn_tf2.evaluation import coco_metrics
from mrcnn_tf2.model.factory import choose_ops
from mrcnn_tf2.runtime import checkpoints
from mrcnn_tf2.runtime.distributed import SINGLE_PROCESS
from mrcnn_tf2.runtime.predictor import ModelBackend, concat_batches, open_backend, same_shape_batches

RESULTS_FILE = "eval_results.json"
DETECTIONS_FILE = "detections.json"
# In model_dir: the metrics of training's evaluations by step ({"<step>": {'bbox/AP': ...}}), which tell a resumed
# run whether its checkpoint's step met the target APs or still owes its evaluation (`TrainingEvaluator.resume`).
TRAINING_RESULTS_FILE = "train_evaluations.json"
# In model_dir: the model directory of the checkpoint whose evaluation in training scored highest on
# eval.best_metric, with BEST_FILE saying which (`keep_best`).
BEST_DIR = "best"
BEST_FILE = "best.json"
# The COCO statistic of each AP that training reports and can stop at: box AP and mask AP.
AP_KEYS = {"bbox": coco_metrics.metric_key("bbox", "AP"), "mask": coco_metrics.metric_key("segm", "AP")}


# `TrainingEvaluator.resume`'s answers.
REACHED, EVALUATE = "reached", "evaluate"


class EvaluationStopped(Exception):
    """A stop signal came while `run_evaluation` was predicting (`stopping`): the evaluation is abandoned, on every
    rank. `signum` is the signal's number (the largest of the ranks')."""

    def __init__(self, signum):
        super().__init__(f"evaluation abandoned on signal {signum}")
        self.signum = signum


@dataclasses.dataclass
class Evaluation:
    """What one evaluation pass produced."""

    metrics: dict  # {'bbox/AP': float, ...}, see coco_metrics.evaluate
    results: list  # COCO result dicts of every evaluated image
    num_images: int
    time_s: dict  # seconds spent: input (reading batches), model, pasting (masks + RLE), cocoeval


def annotations_of(config, world=SINGLE_PROCESS):
    """The ground truth of eval.eval_file (`coco_metrics.load_annotations`) on rank 0, None on the other ranks, once
    rank 0 has checked that it is of the images of the validation records that evaluations read
    (`coco_metrics.check_record_images`; the first eval.eval_samples): rank 0 alone reads the file (the other
    machines need not have it). Raises ConfigError on every rank when rank 0 finds the file or the validation
    records wrong (`pipeline.evaluation_images`), so that no rank waits for one that stopped."""
    coco_gt, problem = None, None
    if world.is_chief:
        try:
            coco_gt = coco_metrics.load_annotations(config.eval.eval_file)
            images = evaluation_images(config.data.resolved_validation_pattern(), config.eval.eval_samples)
            coco_metrics.check_record_images(coco_gt, images, config.eval.eval_file)
        except ConfigError as err:
            problem = (err.key, err.message)
        except ValueError as err:  # of the validation records
            problem = ("--data_dir", str(err))
    problem = world.broadcast_object(problem)
    if problem is not None:
        raise ConfigError(*problem)
    return coco_gt


def run_evaluation(backend, config, coco_gt, max_images=None, world=SINGLE_PROCESS, stopping=None):
    """Predicts over the validation images and scores the detections with COCOeval.

    Under a launcher every rank calls it: each predicts and encodes its share of the images (every
    world.size-th record, `InputPipeline.dataset`), and rank 0 gathers the detections and scores them once.

    Args:
      backend: what predicts (`predictor.ModelBackend` of a model, or `predictor.ExportedBackend`), and its COCO
        RLE mask encoder.
      config: the run's Config (data.validation pattern, eval.eval_batch_size, eval.eval_file, model...).
      coco_gt: on rank 0 the ground truth as a pycocotools COCO object (`annotations_of`), None on the others.
      max_images: evaluate at most this many images (in file order); None: eval.eval_samples, and all
        images when that is None too.
      world: the process world (runtime.distributed.World).
      stopping: None, or f() -> the number of a signal that stops training (0: none came), asked before each
        batch (`runtime.stop_signals`).

    Returns:
      an `Evaluation` on rank 0 (its results sorted by image id); None on the other ranks.

    Raises:
      ValueError: max_images < 1, no validation image, or validation images that the annotation file lacks.
      EvaluationStopped: `stopping` gave a signal on some rank; every rank raises it once the others have
        ended their shares.
    """
    max_images = config.eval.eval_samples if max_images is None else max_images
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be >= 1 or None, got {max_images}.")
    category_ids = world.broadcast_object(coco_gt.getCatIds() if world.is_chief else None)
    batch_size = config.eval.eval_batch_size
    pattern = config.data.resolved_validation_pattern()
    own_size = config.data.pad_to_multiple is not None
    # Batches padded to their own size hold images of one padded shape (`same_shape_batches`): read one image
    # at a time, each padded to its own multiple, and batch them here.
    dataset = InputPipeline(config, training=False).dataset(pattern, 1 if own_size else batch_size, world.rank,
                                                            world.size, max_images)
    time_s = dict(input=0.0, model=0.0, pasting=0.0, cocoeval=0.0)
    results, image_ids, dropped = [], [], 0
    batches = iter(dataset)
    if own_size:
        batches = map(concat_batches, same_shape_batches(batches, batch_size, lambda b: tuple(b["images"].shape)))
    while True:
        # Evaluating COCO's validation set takes an hour on a CPU: longer than any grace period after SIGTERM.
        signum = stopping() if stopping is not None else 0
        if signum:
            break
        tic = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        toc = time.perf_counter()
        outputs = backend(batch)
        time_s["input"] += toc - tic
        time_s["model"] += time.perf_counter() - toc
        tic = time.perf_counter()
        batch_results, batch_dropped = coco_metrics.convert_detections(outputs, category_ids, backend.mask_encoder)
        time_s["pasting"] += time.perf_counter() - tic
        results += batch_results
        dropped += batch_dropped
        image_ids += outputs["source_ids"].tolist()
    if world.size > 1:
        # Each rank ends its share (a rank without the signal predicts it all) and learns here whether to stop.
        shares = world.allgather_object((results, image_ids, dropped, signum))
        results, image_ids, dropped = ([r for share in shares for r in share[0]],
                                       [i for share in shares for i in share[1]], sum(share[2] for share in shares))
        signum = max(share[3] for share in shares)
    if signum:
        raise EvaluationStopped(signum)
    if not image_ids:
        raise ValueError(f"no validation image in {pattern}.")
    if not world.is_chief:
        return None
    # In image id order, each image's detections in their own order: the same list however many processes
    # evaluated and however the images were batched.
    results.sort(key=lambda result: result["image_id"])
    coco_metrics.warn_dropped(dropped, category_ids)
    tic = time.perf_counter()
    iou_types = coco_metrics.IOU_TYPES if config.model.include_mask else ("bbox",)
    try:
        metrics = coco_metrics.evaluate(coco_gt, results, image_ids, iou_types)
    except ValueError as err:
        raise ValueError(f"the validation TFRecords do not match eval.eval_file {config.eval.eval_file}: {err}") \
            from None
    time_s["cocoeval"] = time.perf_counter() - tic
    return Evaluation(metrics, results, len(image_ids), time_s)


def targets_reached(metrics, min_bbox_map, min_mask_map):
    """Whether training has reached its target: every given minimum AP is met (None: no target on it).

    Args:
      metrics: {'bbox/AP': float, 'segm/AP': float, ...} as `coco_metrics.evaluate` returns them.
      min_bbox_map, min_mask_map: target bbox and mask (segm) AP, or None.

    Returns:
      bool; False when neither target is given (the run never stops early) and when a targeted AP is
      missing from `metrics`.
    """
    given = {name: target for name, target in (("bbox", min_bbox_map), ("mask", min_mask_map)) if target is not None}
    return bool(given) and all(metrics.get(AP_KEYS[name], -1.0) >= target for name, target in given.items())


class TrainingEvaluator:
    """COCO evaluation during training, and the early stop at the target APs (as NVIDIA's PyTorch seed does).

    It evaluates after every eval.resolved_eval_every_epochs() epochs and after the last step, with
    `run_evaluation` on the live model (the code of `main.py eval`), and logs the statistics: the APs on
    the console, every statistic to the JSON-lines log (event 'eval') and to TensorBoard ('bbox/AP', ...).
    Training stops once `targets_reached` says so. The checkpoint of the best evaluation on eval.best_metric is
    kept in BEST_DIR (`keep_best`). Under a launcher every rank has one: the ranks evaluate
    their shares of the images, rank 0 scores and logs, and every rank gets its decision to stop.
    """

    def __init__(self, config, steps_per_epoch, world=SINGLE_PROCESS):
        self.config = config
        self.world = world
        # The live model was built with the same choice (factory.build_model asks choose_ops too).
        self.encode_masks = choose_ops(config).mask_encoder
        every = config.eval.resolved_eval_every_epochs()
        self.interval = None if every is None else every * steps_per_epoch
        self.steps_per_epoch = steps_per_epoch
        # Read once, before the first step: evaluations reuse it.
        self.coco_gt = annotations_of(config, world)

    @classmethod
    def from_config(cls, config, steps_per_epoch, world=SINGLE_PROCESS):
        """The evaluator of a training run, or None when the run does not evaluate (no eval.eval_file)."""
        return cls(config, steps_per_epoch, world) if config.eval.eval_file else None

    def due(self, step, last_step):
        """Whether update `step` (1-based) ends an evaluation interval or the run."""
        return step == last_step or (self.interval is not None and step % self.interval == 0)

    def resume(self, step, last_step, logger):
        """What a run that starts after update `step` (0: a new run) does about evaluations, the same on every rank
        (rank 0 reads TRAINING_RESULTS_FILE): REACHED when the evaluation of `step` met the target APs (logged as
        when it came), EVALUATE when `step` was due an evaluation that has no result (a stop signal abandoned it,
        or the process died in it), else None. A new run forgets an earlier run's results in model_dir."""
        action = problem = None
        if self.world.is_chief and not step:
            for name in (TRAINING_RESULTS_FILE, BEST_DIR):
                files.remove(os.path.join(self.config.runtime.model_dir, name))
        elif self.world.is_chief:
            try:
                metrics = self._recorded().get(str(step))
            except ConfigError as err:
                metrics, problem = None, (err.key, err.message)
            if metrics is not None:
                action = REACHED if self._reached(metrics, step, logger, "reached before this run") else None
            elif self.due(step, last_step):
                action = EVALUATE
        action, problem = self.world.broadcast_object((action, problem))
        if problem is not None:  # on every rank, so that none waits for rank 0
            raise ConfigError(*problem)
        return action

    def evaluate(self, model, step, logger, stopping=None):
        """Evaluates `model` after update `step`, logs the result; returns True when training should stop (on
        every rank: rank 0's decision). Raises EvaluationStopped when `stopping` (see `run_evaluation`) gives a
        signal before the evaluation ends."""
        backend = ModelBackend(model, self.config, self.encode_masks, "the model in training")
        evaluation = run_evaluation(backend, self.config, coco_gt=self.coco_gt, world=self.world, stopping=stopping)
        return self.world.broadcast_object(self.world.is_chief and self._report(evaluation, step, logger))

    def _report(self, evaluation, step, logger):
        """Logs `evaluation` of update `step`; returns whether the targets are reached."""
        metrics, seconds = evaluation.metrics, sum(evaluation.time_s.values())
        aps = {name: metrics[key] for name, key in AP_KEYS.items() if key in metrics}
        epoch = (step - 1) // self.steps_per_epoch + 1
        line = (f"[eval] step {step} epoch {epoch}: " + "  ".join(f"{name} AP {ap:.4f}" for name, ap in aps.items())
                + f"  ({evaluation.num_images} images, {seconds:.1f} s)")
        logger.metrics(step, {**metrics, "eval_images": evaluation.num_images, "eval_time_s": seconds}, line,
                       event="eval")
        recorded = self._recorded()
        files.write_json(os.path.join(self.config.runtime.model_dir, TRAINING_RESULTS_FILE),
                         {**recorded, str(step): metrics}, indent=1)
        kept = keep_best(self.config.runtime.model_dir, self.config.eval.best_metric, step, metrics, recorded)
        if kept:
            key = self.config.eval.best_metric
            logger.event("best", step=step, **{key: f"{metrics[key]:.4f}"}, path=kept)
        return self._reached(metrics, step, logger, "stopping training")

    def _recorded(self):
        """TRAINING_RESULTS_FILE's {"<step>": metrics} ({} without the file). Raises ConfigError naming a file
        that is not one."""
        path = os.path.join(self.config.runtime.model_dir, TRAINING_RESULTS_FILE)
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                recorded = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError("--model_dir", f"{path} cannot be read ({err}): delete it to evaluate again") from None
        if not isinstance(recorded, dict) or not all(isinstance(value, dict) for value in recorded.values()):
            raise ConfigError("--model_dir", f"{path} is not a record of evaluations: delete it to evaluate again")
        return recorded

    def _reached(self, metrics, step, logger, message):
        """Whether `metrics`, of update `step`, meet the target APs; logs it (with `message`) when they do."""
        targets = {"bbox": self.config.eval.min_bbox_map, "mask": self.config.eval.min_mask_map}
        if not targets_reached(metrics, targets["bbox"], targets["mask"]):
            return False
        logger.event("target reached", step=step, **{f"{name}_AP": f"{metrics[AP_KEYS[name]]:.4f} >= {target}"
                                                     for name, target in targets.items() if target is not None},
                     message=message)
        return True


def keep_best(model_dir, key, step, metrics, recorded):
    """Makes the checkpoint of update `step` in `model_dir` the one in its BEST_DIR, with the run's config and
    BEST_FILE, when the step's `metrics` beat every earlier evaluation of the run on statistic `key` (a tie keeps
    the earlier); returns the checkpoint prefix in BEST_DIR then, else None.

    Args:
      model_dir: the training's model directory, holding ckpt-<step> and its config.json.
      key: a statistic of `metrics` ('bbox/AP', ...), or None: nothing is kept.
      step: the evaluated update.
      metrics: the evaluation's {'bbox/AP': float, ...}.
      recorded: the run's evaluations {"<step>": metrics} (TRAINING_RESULTS_FILE's), this one included or not.
    """
    if key is None:
        return None
    earlier = [other[key] for other_step, other in recorded.items() if other_step != str(step) and key in other]
    if earlier and metrics[key] <= max(earlier):
        return None
    with open(os.path.join(model_dir, SAVED_CONFIG_FILE), "rb") as f:
        config = f.read()
    best = {"step": step, "metric": key, "value": metrics[key], "metrics": metrics}
    return checkpoints.copy_checkpoint(os.path.join(model_dir, f"ckpt-{step}"), os.path.join(model_dir, BEST_DIR),
                                       {SAVED_CONFIG_FILE: config, BEST_FILE: json.dumps(best, indent=1).encode()})


def _fail(message, world=SINGLE_PROCESS):
    if world.is_chief:  # every rank fails alike: the job says it once
        print(f"[eval] error: {message}", file=sys.stderr)
    return status.BAD_INPUT


def run(config, world=SINGLE_PROCESS):
    """Entry point of `main.py eval`: evaluates the latest checkpoint of runtime.model_dir; returns the exit status.

    Under a launcher each rank evaluates its share of the images (`run_evaluation`); every rank reads the
    checkpoint, rank 0 alone reads eval_file's annotations, prints and writes the results.
    """
    model_dir = config.runtime.model_dir
    eval_file = config.eval.eval_file
    if not eval_file:
        return _fail("--eval_file is required: the COCO annotation JSON of the validation images.", world)
    total = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the annotations' and dropped detections' warnings show on every run
        try:
            coco_gt = annotations_of(config, world)
            backend = open_backend(config, world)
            evaluation = run_evaluation(backend, config, coco_gt=coco_gt, world=world)
        except ValueError as err:  # ConfigError included
            return _fail(str(err), world)
    loaded = backend.loaded  # None for an exported artefact
    if not world.is_chief:
        return status.OK
    time_s = {**evaluation.time_s, "total": time.perf_counter() - total}
    print(coco_metrics.format_table(evaluation.metrics))
    print(coco_metrics.format_category_table(evaluation.metrics))
    model_s = evaluation.time_s["model"]
    print(f"[eval] {evaluation.num_images} images, {backend.description}: "
          + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in time_s.items()), flush=True)
    record = {
        "metrics": evaluation.metrics,
        "checkpoint": loaded and loaded.checkpoint,
        "step": loaded and loaded.step,
        "averaged_weights": bool(loaded and loaded.averaged),
        "exported": config.infer.exported,
        "num_images": evaluation.num_images,
        "num_detections": len(evaluation.results),
        "eval_file": eval_file,
        "precision": loaded.policy if loaded else "float32",
        "time_s": time_s,
        # Includes the first batch's tracing, so it understates the steady-state rate of short runs.
        "model_images_per_s": evaluation.num_images / model_s if model_s > 0 else None,
    }
    os.makedirs(model_dir, exist_ok=True)
    files.write_json(os.path.join(model_dir, DETECTIONS_FILE), evaluation.results)
    files.write_json(os.path.join(model_dir, RESULTS_FILE), record)
    return status.OK
