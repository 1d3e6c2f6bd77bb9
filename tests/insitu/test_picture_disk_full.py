"""The in-situ picture on a full disk: one line (DiskFull), no partial file, the store intact."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.insitu.helpers import fill

ROOT = Path(__file__).resolve().parents[2]

_DRAW = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from edgetrain.insitu.evaluate import Report, picture
    from edgetrain.insitu.files import DiskFull
    from edgetrain.insitu.store import Store

    directory = Path(sys.argv[1])
    report = Report(None, None, None, None, [], None, None, 0, 0, 0, 0.0, 0, 0, 0, 0)
    store, _ = Store.open(directory, create=False)
    with store:
        try:
            picture(report, store, None, directory / "insitu.png")
        except DiskFull as exc:
            print(type(exc).__name__, exc)
            sys.exit(2)
    """
)


def _limit_file_size(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _draw(directory: Path, limit: int | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _DRAW, str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=None if limit is None else (lambda: _limit_file_size(limit)),
        timeout=120,
    )


def test_a_full_disk_while_the_picture_is_written_is_one_line(tmp_path):
    fill(tmp_path, 1, per_track=2)
    database = (tmp_path / "store.sqlite").read_bytes()
    full = _draw(tmp_path, limit=1024)
    assert full.returncode == 2, full.stderr[-2000:]
    lines = full.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("DiskFull no room to write"), full.stdout
    assert "insitu.png" in lines[0]
    assert not (tmp_path / "insitu.png").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") or "tmp.png" in p.name]
    assert (tmp_path / "store.sqlite").read_bytes() == database

    room = _draw(tmp_path, limit=None)
    assert room.returncode == 0, room.stderr[-2000:]
    assert (tmp_path / "insitu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
