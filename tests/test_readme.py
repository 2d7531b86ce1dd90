"""The commands in the README's and docs' fenced code blocks name flags, modes, presets and config keys that
exist: a renamed flag fails here rather than in a user's shell. Every tool's --help answers without
TensorFlow."""

import functools
import re
import shlex
import subprocess
import sys

import pytest

from mrcnn_tf2 import arguments, presets
from mrcnn_tf2.config import Config
from tests.support import ROOT

DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
# The programs of these folders; the modules they import (weights/torch_pickle.py, ...) have no command line.
TOOLS = sorted(str(p.relative_to(ROOT)) for folder in ("dataset", "weights", "scripts")
               for p in (ROOT / folder).glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
# A line of `python -X importtime`'s report (stderr) of a module of TensorFlow's.
TENSORFLOW_IMPORT = re.compile(r"\| +tensorflow(\.|$)", re.MULTILINE)
FENCE = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def fenced_commands(text):
    """Each command of the shell blocks (```bash) of `text`: continuation lines joined, comments dropped."""
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield line


# Words that end one command of a line and start the next (or a redirection).
SEPARATORS = ("|", "&&", ";", ">", "2>&1")


def invocations(command):
    """(script, arguments) of each Python script of this repository that `command` runs."""
    try:
        words = shlex.split(command)
    except ValueError:
        return
    in_pytest = False  # pytest's arguments name test files, not scripts that run
    for i, word in enumerate(words):
        name = word.removeprefix("./")
        if name in SEPARATORS:
            in_pytest = False
            continue
        in_pytest = in_pytest or name == "pytest"
        entry_point = name.endswith("bin/mrcnn-tf2") or (name == "mrcnn-tf2" and i == 0)  # not docker's image
        if not in_pytest and (name == "main.py" or entry_point or (name.endswith(".py") and (ROOT / name).is_file())):
            rest = []
            for item in words[i + 1:]:
                if item in SEPARATORS:
                    break
                rest.append(item)
            yield ("main.py" if entry_point else name), rest


@functools.lru_cache(maxsize=None)
def script_help(script):
    """(the --flags that `script --help` lists, whether it imported TensorFlow), from one process, which
    `-X importtime` makes list on stderr every module it imports."""
    result = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, f"{script} --help failed: {result.stderr[-2000:]}"
    return set(re.findall(r"--[a-z][a-z0-9_-]*", result.stdout)), bool(TENSORFLOW_IMPORT.search(result.stderr))


def test_documents_hold_commands():
    commands = [c for doc in DOCUMENTS for c in fenced_commands((ROOT / doc).read_text())]
    assert sum(1 for c in commands for _ in invocations(c)) >= 10


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_documented_command_names_flags_that_exist(document):
    parser = arguments.build_parser()
    main_flags = {option for action in parser._actions for option in action.option_strings}
    problems = []
    for command in fenced_commands((ROOT / document).read_text()):
        for script, words in invocations(command):
            if "--" in words:  # a script that passes what follows to main.py (scripts/profile_step.py)
                words, main_words = words[:words.index("--")], words[words.index("--") + 1:]
                problems += check(command, "main.py", main_words, main_flags)
            problems += check(command, script, words, main_flags if script == "main.py" else script_help(script)[0])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", TOOLS)
def test_every_tools_help_answers_without_tensorflow(script):
    flags, imports_tensorflow = script_help(script)  # the process the documented commands' check ran, if any
    assert "--help" in flags and not imports_tensorflow


def check(command, script, words, known):
    """Problems with the `words` that follow `script` in `command`, given the flags `known` to it."""
    problems = []
    if script == "main.py" and (not words or words[0] not in arguments.MODES and not words[0].startswith("{")):
        problems.append(f"{command}: main.py needs a mode first")  # ({...} is a synopsis)
    for i, word in enumerate(words):
        flag = word.split("=")[0]
        if flag.startswith("--") and flag not in known:
            problems.append(f"{command}: {script} has no flag {flag}")
        following = words[i + 1] if i + 1 < len(words) else ""
        if script == "main.py" and word == "--config_override":
            try:
                Config().get(following.split("=")[0])
            except AttributeError:
                problems.append(f"{command}: no config key {following.split('=')[0]}")
        if script == "main.py" and word == "--preset" and following not in presets.names():
            problems.append(f"{command}: no preset {following}")
    return problems
