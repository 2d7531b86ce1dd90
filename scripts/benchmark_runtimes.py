"""Inference speed of one model in each runtime, one run: TensorFlow on the newest checkpoint, and every artefact
`main.py export --format ...` wrote (onnx, tflite, tflite_fp16, openvino, openvino_int8).

    .venv/bin/python scripts/benchmark_runtimes.py --model_dir demo/model --export_dir demo/model/saved_model \\
        --input 'photos/*.jpg' --rounds 3

Each backend is `mrcnn_tf2.runtime.predictor`'s (the path of `main.py infer`): the same preprocessed images, one
image per call (batch 1), outputs copied to the host; reading and preprocessing are left out, and so is mask
pasting. Rounds alternate the order of the backends (forwards, then backwards) so that drifts of the machine
fall on all of them; each round runs every image once per backend after one warm-up image. Prints the CPU's
instruction-set flags, then per backend the images per second over all rounds, the median latency, and how many of
TensorFlow's detections it gives too (averaged over the images): the same ones (class, box IoU >= 0.9, score within
0.01) and close ones (class, IoU >= 0.5).

--profile: then, for each OpenVINO artefact, where its time goes: the CPU plugin's per-node timings (PERF_COUNT)
of one call per image, summed by node type, per image.
"""

import argparse
import collections
import os
import statistics
import time

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags():
    """The CPU_FLAGS that /proc/cpuinfo lists."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in flags]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a trained model directory (TensorFlow backend)")
    parser.add_argument("--export_dir", required=True, help="its export directory (the other backends)")
    parser.add_argument("--input", help="images (file, folder, glob); default: the validation TFRecords")
    parser.add_argument("--images", type=int, default=8, help="images per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="OpenVINO's time per node type, per image")
    args = parser.parse_args(argv)
    # After the arguments: --help answers without starting TensorFlow.
    from mrcnn_tf2.arguments import parse
    from mrcnn_tf2.data.preprocess import Preprocessor
    from mrcnn_tf2.runtime import deploy, infer, predictor

    # Batch 1 for TensorFlow too (on the canvas a smaller batch would be padded to eval_batch_size).
    config = parse(["infer", "--model_dir", args.model_dir, "--eval_batch_size", "1"])[1]
    photos = (infer.photos_from_files(infer.list_image_files(args.input)[:args.images]) if args.input else
              infer.photos_from_records(config.data.resolved_validation_pattern(), args.images))
    preprocessor = Preprocessor(config.data)
    batches = [predictor.preprocess(photo, preprocessor) for photo in photos]
    backends = {"tensorflow": predictor.ModelBackend.from_checkpoint(config)}
    for fmt, (name, _, _) in deploy.ARTEFACTS.items():
        if os.path.isfile(os.path.join(args.export_dir, name)):
            backends[fmt] = predictor.ExportedBackend(config, os.path.join(args.export_dir, name))
    print(f"[benchmark] CPU flags: {' '.join(cpu_flags()) or 'none of ' + ' '.join(CPU_FLAGS)}; "
          f"{len(batches)} images of {sorted({tuple(b['images'].shape[1:3]) for b in batches})}; "
          f"backends: {', '.join(backends)}", flush=True)
    latencies = {name: [] for name in backends}
    detections = {name: [None] * len(batches) for name in backends}
    for round_index in range(args.rounds):
        order = list(backends) if round_index % 2 == 0 else list(reversed(backends))
        for name in order:
            backends[name](batches[0])  # warm-up (first traces, allocations)
            for index, batch in enumerate(batches):
                tic = time.perf_counter()
                detections[name][index] = backends[name](batch)
                latencies[name].append(time.perf_counter() - tic)
    reference = len(latencies["tensorflow"]) / sum(latencies["tensorflow"])
    for name, times in latencies.items():
        rate = len(times) / sum(times)
        # The share of TensorFlow's detections each backend gives too, over all images: the same (class, box IoU
        # >= 0.9, score within 0.01) and close (class, IoU >= 0.5, any score).
        same, close = (statistics.mean(deploy.matched_fraction(found, expected, min_iou, tolerance)
                                       for found, expected in zip(detections[name], detections["tensorflow"]))
                       for min_iou, tolerance in ((0.9, 0.01), (0.5, None)))
        print(f"{name:14s} {rate:7.3f} img/s  median {1000 * statistics.median(times):7.1f} ms  "
              f"{rate / reference:5.2f}x tensorflow  detections same {same:6.1%} close {close:6.1%}", flush=True)
    if args.profile:
        for fmt, (name, runtime, _) in deploy.ARTEFACTS.items():
            if runtime == "openvino" and fmt in backends:
                print_openvino_profile(fmt, os.path.join(args.export_dir, name), batches)


def print_openvino_profile(fmt, path, batches):
    """Prints the OpenVINO model at `path`'s node time by type, per image, over one call per batch (after one
    untimed call), compiled as `deploy.Runner` compiles it."""
    import openvino
    import openvino.properties.hint as hints

    compiled = openvino.Core().compile_model(path, "CPU", {hints.inference_precision: openvino.Type.f32,
                                                           "PERF_COUNT": "YES"})
    request = compiled.create_infer_request()
    by_type = collections.Counter()
    for index, batch in enumerate([batches[0]] + batches):
        request.infer({"images": batch["images"], "image_info": batch["image_info"]})
        if index:
            for node in request.profiling_info:
                by_type[f"{node.node_type} ({node.exec_type.split('_')[-1]})"] += node.real_time.total_seconds()
    total = sum(by_type.values())
    print(f"{fmt}: {1000 * total / len(batches):.1f} ms of node time per image", flush=True)
    for kind, seconds in by_type.most_common(10):
        print(f"    {kind:44s} {1000 * seconds / len(batches):7.1f} ms  {seconds / total:6.1%}", flush=True)


if __name__ == "__main__":
    main()
