"""scalenlp on a platform without POSIX's ``resource`` module (Windows): every module imports and `scalenlp --help`
answers. The module is hidden in a fresh interpreter (``sys.modules["resource"] = None`` makes its import fail as it
does there), since this one has long imported it."""

import subprocess
import sys
import textwrap

import pytest

WITHOUT_RESOURCE = textwrap.dedent("""
    import contextlib, importlib, io, json, pkgutil, sys
    sys.modules["resource"] = None
    import scalenlp
    from scalenlp.cli import COMMANDS, main

    failed, imported = {}, 0
    for module in pkgutil.walk_packages(scalenlp.__path__, "scalenlp."):
        if module.name.endswith("__main__"):  # importing it would run a command
            continue
        try:
            importlib.import_module(module.name)
            imported += 1
        except Exception as e:
            failed[module.name] = f"{type(e).__name__}: {e}"
    helps = {}
    for argv in (["--help"], *([name, "--help"] for name in COMMANDS)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(argv)
        helps[" ".join(argv)] = out.getvalue()
    print(json.dumps({"failed": failed, "imported": imported, "helps": helps}))
""")


@pytest.mark.slow  # imports every module, Ray and FastAPI included: 11-15 s here
def test_every_module_imports_and_help_answers_without_resource():
    import json

    from scalenlp.cli import COMMANDS

    done = subprocess.run([sys.executable, "-c", WITHOUT_RESOURCE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}
    assert result["imported"] > 100  # the walk found the package's modules, not an empty path
    assert result["helps"]["--help"].startswith("usage: scalenlp")
    for name in COMMANDS:
        assert result["helps"][f"{name} --help"].startswith(f"usage: scalenlp {name}"), name
