"""scripts/benchmark_torchvision.py: what each side is asked to run in inference and training, and when bfloat16 is
measured (no benchmark runs here)."""

import glob
import os

import pytest

from mrcnn_tf2.arguments import parse
from scripts import benchmark_torchvision as bench


def test_bfloat16_is_measured_only_on_a_cpu_with_bfloat16_instructions():
    assert bench.bfloat16_unmeasured(["avx2", "avx512f", "avx512_vnni"]).startswith("bfloat16 not measured")
    assert bench.bfloat16_unmeasured(["avx2", "avx512f", "avx512_bf16"]) is None
    assert bench.bfloat16_unmeasured(["avx2", "amx_bf16"]) is None
    # The flags with which --amp picks bfloat16 on a CPU: the script cannot import them without Keras.
    from mrcnn_tf2.runtime.precision import BFLOAT16_CPU_FLAGS
    assert bench.BFLOAT16_CPU_FLAGS == BFLOAT16_CPU_FLAGS


@pytest.mark.parametrize("setting, precision, freeze_bn, freeze_blocks", [
    ("finetune", "fp32", True, (0, 1)), ("finetune", "bf16", True, (0, 1)), ("scratch", "fp32", False, ()),
])
def test_ours_trains_the_preset_with_what_the_setting_freezes(tmp_path, setting, precision, freeze_bn, freeze_blocks):
    argv = bench.package_train_command(setting, precision, "records/*.tfrecord", str(tmp_path / "converted"),
                                       str(tmp_path / "run"), steps=5, warmup=2, min_size=800)
    assert "--image_size" not in argv  # the preset's sizes
    config = parse(argv)[1]
    assert (config.model.freeze_bn, config.model.freeze_blocks) == (freeze_bn, freeze_blocks)
    assert config.train.init_checkpoint == (str(tmp_path / "converted") if setting == "finetune" else None)
    assert (config.runtime.amp, config.runtime.amp_dtype) == ((True, "bfloat16") if precision == "bf16" else
                                                              (False, "auto"))
    assert (config.train.train_batch_size, config.data.use_synthetic_data, config.runtime.benchmark) == (2, True, True)
    assert (config.data.image_size, config.data.resize_min_size, config.data.resize_max_size) == ((1344, 1344), 800,
                                                                                                 1333)


def test_smaller_scenes_and_a_tight_canvas_reach_both_sides():
    assert bench.train_sizes(800) == (1333, (1344, 1344))
    assert bench.train_sizes(320) == (533, (576, 576))
    argv = bench.package_train_command("scratch", "fp32", "r", "c", "m", 1, 1, min_size=320, image_size=(320, 448))
    config = parse(argv)[1]
    assert (config.data.image_size, config.data.resize_min_size, config.data.resize_max_size) == ((320, 448), 320, 533)


def test_train_flags_belong_to_the_train_mode():
    args = bench.parse_args(["--mode", "train"])
    assert (args.steps, args.warmup, args.settings, args.precisions, args.min_size) == (
        5, 2, ["scratch", "finetune"], ["fp32", "bf16"], 800)
    infer = bench.parse_args([])
    assert (infer.steps, infer.warmup, infer.precisions) == (10, 3, ["fp32"])
    for argv in (["--settings", "scratch"], ["--image_size", "800", "1088"], ["--mode", "train", "--model", "v2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


@pytest.mark.parametrize("precision, amp", [("fp32", (False, "auto")), ("bf16", (True, "bfloat16"))])
def test_ours_infers_at_batch_one_in_each_precision(precision, amp):
    argv = bench.package_infer_command(precision, "torchvision_v2", "model", "records/*.tfrecord", steps=10, warmup=3)
    config = parse(argv)[1]
    assert (config.runtime.amp, config.runtime.amp_dtype) == amp
    assert (config.eval.eval_batch_size, config.runtime.benchmark) == (1, True)
    assert config.data.validation_file_pattern == "records/*.tfrecord"
    assert bench.parse_args(["--precisions", "fp32", "bf16"]).precisions == ["fp32", "bf16"]


def test_a_run_without_jemalloc_says_under_its_results_that_the_ratios_overstate_ours(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(bench.ALLOCATORS, "jemalloc",
                        {**bench.ALLOCATORS["jemalloc"], "LD_PRELOAD": str(tmp_path / "libjemalloc.so.2")})
    env = bench.torchvision_environment()
    assert env is None and "jemalloc not found" in capsys.readouterr().out
    assert bench.torchvision_allocator({"LD_PRELOAD": "libjemalloc.so.2"}) == ("jemalloc", None)
    name, caveat = bench.torchvision_allocator(env)
    assert name == "malloc" and "the ratios above overstate ours" in caveat
    row = dict(setting="scratch", precision="fp32", package_img_per_s=[0.3, 0.3], package_mean=0.3,
               torchvision_img_per_s=[0.1, 0.1], torchvision_mean=0.1, ratio=3.0, package_peak_rss_gib=4.0,
               torchvision_peak_rss_gib=5.0, gflop_per_image=1000.0, package_share_of_peak=1.3,
               matmul_peak_gflops=223.0, torchvision_share_of_peak=0.5, torchvision_allocator=name)
    bench.print_train_table([row], caveat)
    lines = capsys.readouterr().out.splitlines()
    assert lines.index(caveat) == len(lines) - 2 and '"torchvision_allocator": "malloc"' in lines[-1]


def test_fewer_photos_than_shards_make_a_shard_each(tmp_path):
    from scripts.benchmark_pipeline import generated_records

    pattern = generated_records(str(tmp_path), 2)
    assert sorted(os.path.basename(path) for path in glob.glob(pattern)) == [
        "train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
