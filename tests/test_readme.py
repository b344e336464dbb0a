"""The README's examples run as written: every ```python block runs in a fresh interpreter
from the repository root, and every indented `disagg ...` command line parses with the
real CLI parser (placeholders such as PREFILL or PORT replaced by plausible values)."""

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.cli import build_parser
from disagg.config import tomllib

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 120

# Placeholders the README uses for what differs per deployment -> values that parse.
PLACEHOLDERS = [
    (re.compile(r"\b(?:ROUTER_PORT|PORT)\b"), "8100"),
    (re.compile(r"\b(?:PREFILL|DECODE|ROUTER)\b"), "127.0.0.1"),
]


def python_blocks(text: str, lang: str = "python") -> list[tuple[int, str]]:
    """(first line number, code) of every ```python (or ```LANG) fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```" + lang:
            start, body = i + 2, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"README.md:{start - 1}: ```{lang} block is never closed")
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def disagg_commands(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every indented shell line that runs disagg."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("    ") and line.strip().startswith((".venv/bin/disagg ", "disagg ")):
            out.append((n, line.strip()))
    return out


def cli_argv(line: str) -> list[str]:
    """The line's arguments after the program name, placeholders filled in, comment dropped."""
    for pattern, value in PLACEHOLDERS:
        line = pattern.sub(value, line)
    return shlex.split(line, comments=True)[1:]


TEXT = README.read_text()
BLOCKS = python_blocks(TEXT)
TOML_BLOCKS = python_blocks(TEXT, "toml")
COMMANDS = disagg_commands(TEXT)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2, "README.md lost its python examples"
    assert COMMANDS, "README.md lost its disagg command lines"
    assert TOML_BLOCKS, "README.md lost its --config example"


@pytest.mark.parametrize("line,text", TOML_BLOCKS, ids=[f"line{n}" for n, _ in TOML_BLOCKS])
@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_config_block_is_read_by_the_workers(tmp_path, line, text, command):
    path = tmp_path / "disagg.toml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("disagg")), command, "--config", str(path), "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"README.md:{line}: {proc.stderr[-2000:]}"
    given, effective = tomllib.loads(text), tomllib.loads(proc.stdout)[command]
    for key in {**{k: v for k, v in given.items() if not isinstance(v, dict)}, **given.get(command, {})}:
        assert key in effective, f"README.md:{line}: {key} not taken by {command}"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_python_block_runs(line, code):
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"README.md:{line}: block ran past {TIMEOUT_S} s\nstderr:\n{exc.stderr or ''}") from None
    assert proc.returncode == 0, (
        f"README.md:{line}: block exited {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )


@pytest.mark.parametrize("line,command", COMMANDS, ids=[f"line{n}" for n, _ in COMMANDS])
def test_disagg_command_parses(line, command):
    argv = cli_argv(command)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
            code = 0
        except SystemExit as exc:  # argparse's way of refusing (2), or of answering --help (0)
            code = exc.code
    assert code in (0, None), f"README.md:{line}: `{command}` does not parse:\n{err.getvalue().strip()}"
