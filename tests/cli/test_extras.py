"""The in-situ application is an optional extra: the library and the other commands install and
run without it, and `edgetrain insitu` without it says what to install."""

import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
INSITU_ONLY = ("opencv", "pillow", "psutil", "motpy", "filterpy")


def test_the_base_install_pulls_no_in_situ_dependency():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    base = [d.lower() for d in project["dependencies"]]
    assert not [d for d in base if d.startswith(INSITU_ONLY)], base
    insitu = [d.lower() for d in project["optional-dependencies"]["insitu"]]
    assert all(any(d.startswith(name) for d in insitu) for name in INSITU_ONLY)


def _cli_without_opencv(*args: str) -> subprocess.CompletedProcess:
    code = (
        "import sys; sys.modules['cv2'] = None\n"  # `import cv2` fails as if not installed
        "from edgetrain.cli.main import main\n"
        f"sys.argv = ['edgetrain', *{list(args)!r}]\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_insitu_without_its_extra_is_one_line_naming_the_extra():
    result = _cli_without_opencv("insitu", "run", "--synthetic", "--store", "somewhere")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'edgetrain[insitu]'" in lines[0], result.stderr


def test_other_commands_run_without_the_in_situ_extra():
    result = _cli_without_opencv("revolve", "--steps", "6", "--slots", "2", "--json")
    assert result.returncode == 0, result.stderr
    listing = _cli_without_opencv("--help")
    assert listing.returncode == 0 and "insitu" in listing.stdout
