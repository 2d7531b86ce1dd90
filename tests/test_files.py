"""Atomic file output (`mrcnn_tf2.files`): a result appears complete or not at all, a failure leaves the previous
one, and nothing temporary is left behind; and the package's exit statuses."""

import json
import os

import pytest

from mrcnn_tf2 import files, status
from tests.support import dead_pid


def listing(directory):
    return sorted(os.listdir(directory))


def test_write_json_and_bytes_replace_the_file_and_leave_no_temporary(tmp_path):
    path = str(tmp_path / "result.json")
    files.write_json(path, {"a": [1, 2.5, "é"]})
    files.write_json(path, {"b": None}, indent=1)
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == {"b": None}
    files.write_bytes(str(tmp_path / "blob"), b"\x00\x01")
    assert (tmp_path / "blob").read_bytes() == b"\x00\x01"
    assert listing(tmp_path) == ["blob", "result.json"]
    # Compact by default (annotation files), readable with an indent.
    files.write_json(path, {"k": [1, 2]})
    assert (tmp_path / "result.json").read_text() == '{"k":[1,2]}'


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "predictions.json")
    files.write_json(path, [1])
    with pytest.raises(RuntimeError, match="interrupted"):
        with files.atomic_path(path) as temporary:
            assert temporary == files.temporary_path(path) and temporary != path
            with open(temporary, "w") as f:
                f.write("[1, 2")  # half written
            raise RuntimeError("interrupted")
    with open(path) as f:
        assert json.load(f) == [1]
    assert listing(tmp_path) == ["predictions.json"]


def test_a_directory_is_replaced_whole_and_a_failed_one_leaves_the_old(tmp_path):
    path = str(tmp_path / "saved_model")
    for version in ("1", "2"):
        with files.atomic_path(path) as temporary:
            os.makedirs(os.path.join(temporary, "variables"))
            with open(os.path.join(temporary, "version"), "w") as f:
                f.write(version)
            # Until the block ends, readers see the previous export, or none.
            assert os.path.exists(path) == (version == "2")
    assert (tmp_path / "saved_model" / "version").read_text() == "2"
    with pytest.raises(OSError):
        with files.atomic_path(path) as temporary:
            os.makedirs(temporary)
            raise OSError("disk full")
    assert (tmp_path / "saved_model" / "version").read_text() == "2"
    assert listing(tmp_path) == ["saved_model"]


def test_a_failed_commit_of_a_directory_restores_the_old_one(tmp_path, monkeypatch):
    path = str(tmp_path / "export")
    os.makedirs(os.path.join(path, "old"))
    temporary = files.temporary_path(path)
    os.makedirs(temporary)
    real_replace = os.replace

    def replace(source, destination):
        if source == temporary:
            raise OSError("rename failed")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        files.commit(temporary, path)
    assert listing(path) == ["old"]
    assert sorted(listing(tmp_path)) == sorted(["export", os.path.basename(temporary)])


def test_temporary_names_match_no_reader_pattern_and_remove_takes_files_directories_or_nothing(tmp_path):
    temporary = files.temporary_path(str(tmp_path / "train-00000-of-00002.tfrecord"))
    assert not temporary.endswith((".tfrecord", ".json", ".png"))
    (tmp_path / "file").write_text("x")
    os.makedirs(tmp_path / "dir" / "sub")
    for name in ("file", "dir", "missing"):
        files.remove(str(tmp_path / name))
    assert listing(tmp_path) == []


def test_temporaries_a_killed_process_left_are_found_and_told_and_a_running_ones_are_not(tmp_path):
    killed_conversion, killed_export = dead_pid(), dead_pid()
    shard = tmp_path / f"train-00000-of-00002.tfrecord.tmp-{killed_conversion}"
    shard.write_bytes(b"x" * 2**20)
    export = tmp_path / f"export.tmp-{killed_export}"  # a directory
    (export / "variables").mkdir(parents=True)
    (export / "variables" / "data").write_bytes(b"x" * 2**19)
    (tmp_path / f"train-00001-of-00002.tfrecord.tmp-{os.getpid()}").write_bytes(b"")  # being written
    (tmp_path / "train-00001-of-00002.tfrecord.tmp-abc").write_bytes(b"")  # no temporary name of ours
    shards = str(tmp_path / "train-*-of-*.tfrecord")
    assert files.abandoned(shards) == [str(shard)]
    assert files.abandoned(str(tmp_path / "export")) == [str(export)]
    assert files.abandoned_note(shards) == (f"1 temporary file(s) that a killed process left beside the output "
                                            f"({shard}; 1.0 MiB in all): delete them")
    assert "(" + str(export) + "; 0.5 MiB in all)" in files.abandoned_note(str(tmp_path / "export"))
    assert files.abandoned_note(str(tmp_path / "val-*.tfrecord")) is None


def test_exit_statuses_are_distinct_and_bad_input_is_argparses():
    assert (status.OK, status.FAILURE, status.BAD_INPUT) == (0, 1, 2)  # 2: what argparse exits with on bad usage
