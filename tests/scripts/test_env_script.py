"""scripts/_env.sh: the Python version is checked first, and a failed install leaves no venv.

Each test runs the real script with bash in a scratch venv directory (EDGETRAIN_VENV); pip is
pointed at nothing, so nothing is downloaded.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "_env.sh"
BASH = shutil.which("bash")
TOOLS = ("sha256sum", "cut", "cat", "rm", "mkdir", "dirname", "sed", "head")

pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def fake_python(directory: Path, name: str, version: str) -> Path:
    """An executable called ``name`` that answers the version query with ``version``."""
    path = directory / name
    path.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then echo {version}; else exit 1; fi\n')
    path.chmod(0o755)
    return path


def run_env(tmp_path: Path, path_dirs: list[Path], **env: str) -> subprocess.CompletedProcess:
    """Source _env.sh in bash with PATH = ``path_dirs`` and a scratch venv; return the result."""
    full = {
        "HOME": str(tmp_path),
        "PATH": os.pathsep.join(map(str, path_dirs)),
        "EDGETRAIN_VENV": str(tmp_path / "venv"),
        "PIP_CONFIG_FILE": os.devnull,
        **env,
    }
    return subprocess.run(
        [BASH, "-c", f'source "{ENV_SCRIPT}" && echo READY'],
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
    )


def tools(tmp_path: Path) -> Path:
    """A directory with just the commands the script needs besides Python."""
    directory = tmp_path / "tools"
    directory.mkdir(exist_ok=True)
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found is not None, tool
        (directory / tool).symlink_to(found)
    return directory


def one_error_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("edgetrain: error")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_an_unsupported_python_stops_at_once_and_creates_nothing(tmp_path):
    stub = fake_python(tmp_path, "python3.10", "3.10")
    result = run_env(tmp_path, [tools(tmp_path)], PYTHON=str(stub))
    assert result.returncode == 2
    line = one_error_line(result)
    assert "is Python 3.10" in line and "3.11 to 3.14" in line and "set PYTHON" in line
    assert not (tmp_path / "venv").exists()


def test_no_supported_python_on_path_names_what_was_found(tmp_path):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    fake_python(stubs, "python3", "3.15")
    fake_python(stubs, "python3.11", "3.10")  # a misnamed interpreter is judged by its version
    result = run_env(tmp_path, [stubs, tools(tmp_path)])
    assert result.returncode == 2
    line = one_error_line(result)
    assert "python3.11 is 3.10" in line and "python3 is 3.15" in line
    assert not (tmp_path / "venv").exists()


def test_a_supported_python_later_in_the_list_is_accepted(tmp_path):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    fake_python(stubs, "python3.11", "3.10")
    fake_python(stubs, "python3.13", "3.13")  # picked, then fails to make a venv: it is a stub
    result = run_env(tmp_path, [stubs, tools(tmp_path)])
    assert "with python3.13 (3.13)" in result.stderr
    assert result.returncode == 2 and "-m venv failed" in one_error_line(result)
    assert not (tmp_path / "venv").exists()


def test_an_unfinished_venv_from_an_earlier_run_is_removed_not_reused(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".edgetrain-venv").touch()  # made by the script, never stamped complete
    (venv / "bin" / "python").symlink_to(sys.executable)
    stub = fake_python(tmp_path, "python3.10", "3.10")
    result = run_env(tmp_path, [tools(tmp_path)], PYTHON=str(stub))
    assert "its last install did not finish" in result.stderr
    assert not venv.exists()


def test_a_directory_that_is_not_a_venv_is_left_alone(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "notes.txt").write_text("mine")
    result = run_env(tmp_path, [tools(tmp_path)])
    assert result.returncode == 2 and "not a virtual environment" in one_error_line(result)
    assert (venv / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_failed_install_removes_the_venv(tmp_path):
    """pip finds nothing to install from; the half-made venv must not survive for later runs."""
    python = str(Path(sys._base_executable).resolve())  # a real interpreter, not a shim
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_env(
        tmp_path,
        [tools(tmp_path), Path(python).parent],
        PYTHON=python,
        EDGETRAIN_TORCH_INDEX="",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(empty),
    )
    assert result.returncode == 2, result.stderr
    assert "installing the dependencies failed" in one_error_line(result)
    assert "READY" not in result.stdout
    assert not (tmp_path / "venv").exists()


def _stamped_venv(tmp_path: Path, extras: str) -> None:
    """A venv whose python answers 3.11 and whose stamp says ``extras`` were installed from
    this pyproject.toml."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake_python(bin_dir, "python", "3.11")
    digest = subprocess.run(
        ["sha256sum", str(ENV_SCRIPT.parents[1] / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    (tmp_path / "venv" / ".edgetrain-installed").write_text(f"{digest}\n{extras}\n")


def test_a_script_needing_fewer_extras_than_installed_installs_nothing(tmp_path):
    _stamped_venv(tmp_path, "dev,insitu")
    result = run_env(tmp_path, [tools(tmp_path)], EDGETRAIN_EXTRAS="insitu")
    assert "READY" in result.stdout, result.stderr
    assert "installing" not in result.stderr


def test_a_script_needing_an_extra_not_installed_installs_again(tmp_path):
    _stamped_venv(tmp_path, "insitu")
    result = run_env(tmp_path, [tools(tmp_path)], EDGETRAIN_EXTRAS="dev,insitu")
    assert "installing dependencies" in result.stderr
    assert "READY" not in result.stdout  # the fake python has no pip: the install fails
