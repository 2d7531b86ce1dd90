"""Where the time of a train step or a predict step goes, by stage of the model, by TensorFlow op type and by op.

    .venv/bin/python scripts/profile_step.py [--steps 3] [--top 15] -- train --backbone resnet50 \
        --image_size 832 1344 --train_batch_size 2 --data_dir D --use_synthetic_data
    .venv/bin/python scripts/profile_step.py -- infer --backbone resnet50 --image_size 832 1344 \
        --eval_batch_size 2 --data_dir D --use_synthetic_data

After `--` come `main.py` flags (mode `train` or `infer`); they describe the model and the data exactly as
for a run. The step is the one `main.py ... --benchmark` times (the update of `main.py train`, the
`predict_step` function of `main.py infer`), on the first batch of the records, repeated. Two warm-up
steps run untraced; then --steps steps run under the TensorFlow profiler and the script prints:

- the wall time per step;
- op time per step by stage: the model part an op belongs to (backbone, fpn, rpn_head, box_head,
  mask_head: the op name's Keras scope), or, outside the layers, the ops' own kind (RoIAlign, proposals,
  sampling, losses and the rest, by op type); forward and backward together;
- op time per step by op type (Conv2D, its backprops, the fused ops' kernels, ...);
- the heaviest ops themselves, by type and name.

Op times are summed over both threads of the CPU pool, so their total can exceed the wall time.

`--memory` profiles the step's memory instead: the process runs TensorFlow's BFC allocator on the CPU (whose
allocations the profiler records with the op and shape of each tensor), and the script prints the allocator's
peak and the tensors live at the step's peak, the largest first, by the op that allocated them (a tensor
forwarded in place to a later op keeps the first op's name).
"""

import argparse
import collections
import functools
import glob
import os
import re
import sys
import tempfile
import time

from mrcnn_tf2.arguments import check_inputs, parse
from mrcnn_tf2.cli import import_tensorflow

# TensorFlow is imported inside the functions that use it, so that --help answers at once; main() starts it
# first as main.py does (import_tensorflow), to profile the kernels main.py runs.

# The model's learned parts by the Keras scope of their ops (the layer's name, which Keras derives from its
# class and suffixes with _N in each trace).
LAYERS = {"res_net": "backbone", "fpn": "fpn", "rpn_head": "rpn_head", "box_head": "box_head",
          "mask_head": "mask_head"}
WARMUP_STEPS = 2
OP_EVENT = re.compile(r"^(?P<name>[^:]+):(?P<type>\w+)$")
# oneDNN (TF_ENABLE_ONEDNN_OPTS=1, main.py's setting) runs its kernels in place of the graph's ops under
# their own op types: "_Mkl" or "_MklNative" before the op's type (_MklMatMul, _MklNativeConv2D), or before
# that of a grappler fusion without its underscore (_MklNativeFusedConv2D for _FusedConv2D), and its own
# fusions add "PadWith" (a Pad before a conv) or "WithBias" (BiasAddGrad in a kernel gradient).
ONEDNN_KERNEL = re.compile(r"^_Mkl(?:Native)?(?P<type>\w+)$")


def train_step(config):
    """() -> runs one update of `main.py train` on the first batch of the training records."""
    from mrcnn_tf2.runtime.train import Trainer

    trainer = Trainer(config)
    batch = next(iter(trainer.dataset(0)))
    trainer.build()
    update = trainer.update_function()
    return lambda: {name: value.numpy() for name, value in update([batch])[0].items()}


def predict_step(config):
    """() -> runs `main.py infer`'s predict function on the first batch of the validation records."""
    from mrcnn_tf2.data.pipeline import InputPipeline
    from mrcnn_tf2.runtime.predictor import load_model, predict_function

    model = load_model(config, require_checkpoint=False).model
    batch = next(iter(InputPipeline(config, training=False).dataset(
        config.data.resolved_validation_pattern(), config.eval.eval_batch_size)))
    predict = predict_function(model, fixed_weights=True)
    return lambda: {name: value.numpy() for name, value in predict(batch).items()}


def op_events(logdir):
    """Yields (op name, op type, seconds) of every TensorFlow op kernel the profiler recorded on the host."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if line.name == "python":  # the Python thread's events are calls, not op kernels
                continue
            for event in line.events:
                # An op kernel's event is named "name:Type"; the executor's own ("ExecutorState::Process",
                # "ThreadpoolListener::Record") have a double colon.
                match = OP_EVENT.match(plane.event_metadata[event.metadata_id].name)
                if match:
                    yield match["name"], op_type(match["type"]), event.duration_ps * 1e-12


def memory_events(logdir):
    """Yields (time in ps, allocated: bool, address, bytes requested, op name, shape) of every allocation and
    deallocation the profiler recorded (TensorFlow's BFC allocator records them; the default CPU allocator does
    not), in no particular order."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if name in ("MemoryAllocation", "MemoryDeallocation"):
                    stats = stat_values(plane, event)
                    yield (line.timestamp_ns * 1000 + event.offset_ps, name == "MemoryAllocation", stats["addr"],
                           stats.get("requested_bytes", 0), stats.get("tf_op", ""), stats.get("shape", ""))


def stat_values(plane, event):
    """{stat name: value} of a profiler event (strings the plane interns given as themselves)."""
    values = {}
    for stat in event.stats:
        kind = stat.WhichOneof("value")
        value = getattr(stat, kind) if kind else None
        if kind == "ref_value":
            value = plane.stat_metadata[value].name
        values[plane.stat_metadata[stat.metadata_id].name] = value
    return values


def live_at_peak(events):
    """(peak bytes, [(bytes, op name, shape) of the tensors live then]) of `memory_events`: the most bytes
    allocated at once by the recorded allocations (those made before the profile started are not counted)."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for _, allocated, address, size, op, shape in sorted(events):
        if allocated:
            live[address] = (size, op, shape)
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif address in live:
            total -= live.pop(address)[0]
    return peak, sorted(at_peak.values(), reverse=True)


@functools.lru_cache(maxsize=None)
def op_type(kernel):
    """The op type that a kernel's event stands for: oneDNN's kernels by the op they replace (ONEDNN_KERNEL),
    so that a profile reads the same with oneDNN on or off."""
    from tensorflow.python.framework import op_def_registry

    match = ONEDNN_KERNEL.match(kernel)
    if not match:
        return kernel
    kind = match["type"]
    for candidate in (kind, re.sub(r"^PadWith|WithBias$", "", kind)):
        for op in (candidate, "_" + candidate):
            if op_def_registry.get(op) is not None:
                return op
    return kernel  # oneDNN's own op (_MklLayerNorm, _MklFusedMish...): no other name


def stage_of(name, kind):
    """The report row of an op: the learned layer whose scope holds it, else its op type's kind."""
    for part in name.split("/"):
        layer = LAYERS.get(re.sub(r"_\d+$", "", part))
        if layer:
            return layer
    return f"other: {kind}"


def print_memory(tf, logdir, top):
    """--memory's report; returns 0."""
    peak, tensors = live_at_peak(memory_events(logdir))
    info = tf.config.experimental.get_memory_info("CPU:0")
    print(f"allocator: peak {info['peak'] / 2**30:.2f} GiB in use (with what the steps before the profile left), "
          f"{info['current'] / 2**30:.2f} GiB now (variables, optimizer slots)")
    print(f"tensors allocated in the profiled steps: {peak / 2**30:.2f} GiB live at the peak, {len(tensors)} tensors")
    for size, op, shape in tensors[:top]:
        print(f"{size / 2**20:9.1f} MiB  {op}  {shape}")
    rest = sum(size for size, _, _ in tensors[top:])
    print(f"{rest / 2**20:9.1f} MiB  (the other {max(len(tensors) - top, 0)})")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    parser.add_argument("--top", type=int, default=15, help="rows of each table")
    parser.add_argument("--memory", action="store_true",
                        help="the tensors live at the step's peak instead of its time (module docstring)")
    args = parser.parse_args(ours)
    if args.memory:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # read when TensorFlow starts
    cli, config = parse(flags)
    if cli.mode not in ("train", "infer"):
        parser.error(f"the main.py mode after -- must be train or infer, got {cli.mode}")
    check_inputs(cli.mode, config)
    tf = import_tensorflow(cli.onednn, config.runtime.verbose)
    step = train_step(config) if cli.mode == "train" else predict_step(config)
    for _ in range(WARMUP_STEPS):
        step()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        tic = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = (time.perf_counter() - tic) / args.steps
        tf.profiler.experimental.stop()
        if args.memory:
            return print_memory(tf, logdir, args.top)
        by_stage, by_type, by_op = collections.Counter(), collections.Counter(), collections.Counter()
        for name, kind, seconds in op_events(logdir):
            by_stage[stage_of(name, kind)] += seconds / args.steps
            by_type[kind] += seconds / args.steps
            by_op[f"{kind} {name}"] += seconds / args.steps
    total = sum(by_type.values())
    print(f"{cli.mode} step: {wall:.3f} s wall, {total:.3f} s of op time (both threads), {args.steps} steps profiled")
    for title, table in (("by stage", by_stage), ("by op type", by_type), ("by op (type and name)", by_op)):
        width = max(40, *(len(key) for key, _ in table.most_common(args.top)))
        print(f"\n{title:<{width}} {'s/step':>8} {'share':>6}")
        for key, seconds in table.most_common(args.top):
            print(f"{key:<{width}} {seconds:8.3f} {seconds / total:6.1%}")
        rest = total - sum(seconds for _, seconds in table.most_common(args.top))
        if rest > 0:
            print(f"{'(the rest)':<{width}} {rest:8.3f} {rest / total:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
