"""The package's import layers, read from the source, and the installed package seen from outside the checkout.

Layers, lowest first: ops <- model <- runtime; data and evaluation sit beside model (they may use ops and
model, never runtime); config and arguments are read before TensorFlow is imported (`main.py --help`), so
they use nothing of the package but config; files and status, which any layer and script may use, use
nothing of it; cli is the top, imported by nobody. The package never imports the repository's own tools
(main.py, dataset/, weights/, scripts/, tests/): they are not installed with it.
Imports are read with `ast`, all of them, also those inside functions, which run late but still bind one
layer to another.
"""

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = "mrcnn_tf2"
# Layer -> the layers (and outside packages) it must not import. Every module of the package must belong
# to one of these layers, so that a new subpackage gets its rules when it is added.
FORBIDDEN = {
    "ops": {"model", "runtime", "data", "evaluation", "cli"},
    "model": {"runtime", "data", "evaluation", "cli"},
    "data": {"runtime", "cli"},
    "evaluation": {"runtime", "cli"},
    "runtime": {"cli"},
    "config": {"ops", "model", "runtime", "data", "evaluation", "arguments", "cli", "tensorflow", "keras"},
    "arguments": {"ops", "model", "runtime", "data", "evaluation", "cli", "tensorflow", "keras"},
    "cli": set(),
    # Atomic file output and exit statuses: used by every layer and by the scripts (dataset/ without
    # TensorFlow), so they use nothing of the package nor TensorFlow, but a commit asks whether a signal stopped
    # the run.
    "files": {"ops", "model", "runtime", "data", "evaluation", "config", "arguments", "cli", "tensorflow", "keras"},
    "status": {"ops", "model", "runtime", "data", "evaluation", "config", "arguments", "cli", "files", "tensorflow",
               "keras"},
    # Lines for the console of a long run (console.say): used by the data pipeline and the runtime's logger.
    "console": {"ops", "model", "runtime", "data", "evaluation", "config", "arguments", "cli", "files", "status",
                "tensorflow", "keras"},
    # The device a run computes on: asked by config-level and model code, so it imports no package layer
    # (TensorFlow only inside its function).
    "devices": {"ops", "model", "runtime", "data", "evaluation", "config", "arguments", "cli", "files", "status",
                "presets"},
    # Named sets of config values: plain data, read by the command line.
    "presets": {"ops", "model", "runtime", "data", "evaluation", "config", "arguments", "cli", "files", "status",
                "tensorflow", "keras"},
    PACKAGE: set(),  # the package's __init__
}
# The repository's tools, which are not part of the installed package.
REPOSITORY_TOOLS = {"main", "dataset", "weights", "scripts", "tests"}
SYS_PATH_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__"}


def package_modules():
    """{dotted module name: source path} of every module of the package (a package is its __init__)."""
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module, path, known):
    """Dotted names of everything `module` (source at `path`) imports, at any depth of its code.

    `from a import b` counts as a.b when that is a module of the package (b is a submodule), else as a.
    Relative imports are resolved against the module's package.
    """
    names = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if submodule in known else base)
    return names


def layer(name):
    """The layer of a dotted name: the subpackage or module under the package, else the top-level name."""
    parts = name.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else parts[0]


def layer_violations():
    """['<module> imports <name> (<layer> must not import <layer>)', ...] over the whole package."""
    known = package_modules()
    violations = []
    for module, path in known.items():
        own = layer(module)
        if own not in FORBIDDEN:
            violations.append(f"{module}: layer {own!r} has no rules in FORBIDDEN; add them")
            continue
        for name in sorted(imported_names(module, path, known)):
            other = layer(name)
            if other in FORBIDDEN[own] or other in REPOSITORY_TOOLS:
                violations.append(f"{module} imports {name} ({own} must not import {other})")
    return violations


def edits_sys_path(tree):
    """Whether a parsed file changes sys.path: calls a mutating method of it, assigns or deletes it or an item
    of it, imports `path` from sys, or calls site.addsitedir."""
    def is_sys_path(node):
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in SYS_PATH_MUTATORS and is_sys_path(node.func.value):
                return True
            if (node.func.attr == "addsitedir" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "site"):
                return True
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                return True
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            return True
    return False


def repository_python_files():
    """Paths (relative to the root, '/'-separated) of the repository's .py files, outside hidden directories
    (.venv, .git) and caches."""
    files = []
    for directory, subdirectories, names in os.walk(ROOT):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".") and d != "__pycache__"]
        files += [Path(directory, name).relative_to(ROOT).as_posix() for name in names if name.endswith(".py")]
    return sorted(files)


def test_the_package_keeps_its_import_layers():
    assert len(package_modules()) > 30  # the walk found the package
    assert layer_violations() == []


def test_the_layer_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    known = {"mrcnn_tf2.ops", "mrcnn_tf2.ops.masks", "mrcnn_tf2.runtime", "mrcnn_tf2.runtime.train"}
    source = tmp_path / "masks.py"
    source.write_text("import numpy as np\nfrom . import box_ops\n\n"
                      "def late():\n    from mrcnn_tf2.runtime import train\n    from ..runtime.train import run\n")
    names = imported_names("mrcnn_tf2.ops.masks", source, known)
    assert names == {"numpy", "mrcnn_tf2.ops", "mrcnn_tf2.runtime.train"}
    assert {layer(name) for name in names} & FORBIDDEN["ops"] == {"runtime"}


def test_no_python_file_edits_sys_path():
    edits = {path for path in repository_python_files() if edits_sys_path(ast.parse((ROOT / path).read_text()))}
    assert edits == set(), "import through the installed package (or pytest.ini's pythonpath) instead"


@pytest.mark.parametrize("code, edits", [
    ("import sys\nsys.path.insert(0, 'x')", True),
    ("import sys\nif True:\n    sys.path[:0] = ['x']", True),
    ("import sys\nsys.path += ['x']", True),
    ("import site\nsite.addsitedir('x')", True),
    ("import sys\nprint(sys.path[0], len(sys.path))", False),
    ("import os\nos.path.join('a', 'b')", False),
])
def test_the_sys_path_check(code, edits):
    assert edits_sys_path(ast.parse(code)) is edits


def run_outside(directory, *argv):
    """Runs argv in `directory` (outside the checkout) without PYTHONPATH: of the repository, only the
    installed package is importable."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(argv, cwd=directory, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_package_imports_from_another_directory_without_the_repository_tools(tmp_path):
    # Where each tool's name resolves, if anywhere: it must not be the checkout (tf2onnx 1.17, an optional extra,
    # installs its own test suite as a top-level `tests` in site-packages, which is not ours).
    code = ("import importlib.util, mrcnn_tf2\nprint(mrcnn_tf2.__file__)\n"
            f"specs = {{name: importlib.util.find_spec(name) for name in {sorted(REPOSITORY_TOOLS)}}}\n"
            "print([name for name, spec in sorted(specs.items()) if spec and any(\n"
            "    str(path).startswith(" + repr(str(ROOT) + os.sep) + " + name)\n"
            "    for path in [spec.origin or '', *(spec.submodule_search_locations or [])])])")
    result = run_outside(tmp_path, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    package_file, tools = result.stdout.splitlines()
    assert Path(package_file) == ROOT / PACKAGE / "__init__.py"  # editable: the checkout's own files
    assert tools == "[]"


def test_the_console_script_is_main_py(tmp_path):
    script = Path(sysconfig.get_path("scripts"), "mrcnn-tf2")
    assert os.access(script, os.X_OK), f"{script} is missing: run scripts/setup.sh"
    installed = run_outside(tmp_path, str(script), "train", "--help")
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout == run_outside(tmp_path, sys.executable, str(ROOT / "main.py"), "train", "--help").stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", [
    "dataset/make_shapes_dataset.py", "dataset/create_coco_tf_record.py", "weights/convert_keras_resnet.py",
    "weights/convert_torchvision.py", "scripts/benchmark_conv.py", "scripts/benchmark_model.py",
    "scripts/benchmark_ops.py",
    "scripts/benchmark_pipeline.py", "scripts/benchmark_torchvision.py", "scripts/benchmark_runtimes.py",
])
def test_the_repository_tools_run_from_another_directory(script, tmp_path):
    result = run_outside(tmp_path, sys.executable, str(ROOT / script), "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
