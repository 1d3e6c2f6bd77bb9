#!/usr/bin/env python
"""Measure the test suite's strength: inject known bugs into a copy of the repo, run the tests.

Each mutation replaces one exact snippet of one file with a bug. For every mutation the repo is
copied to a temporary directory (the working tree is never touched), the snippet is replaced
there, and the test files that should notice are run on the copy with a timeout. A mutation is

* ``caught``    — the tests fail (pytest exit status 1), as they should;
* ``timeout``   — the tests did not finish in time (counted as caught, shown apart);
* ``survived``  — the tests pass with the bug in: the suite does not hold that claim;
* ``not found`` — the snippet is not in the file (the code moved on): update the mutation;
* ``ambiguous`` — the snippet occurs more than once: make it longer;
* ``error``     — the mutant does not even import or collect (pytest status 2-5): a useless
  mutation, not a measure of the tests.

Usage::

    .venv/bin/python scripts/mutate.py              # every mutation, a table
    .venv/bin/python scripts/mutate.py --json       # the same as JSON
    .venv/bin/python scripts/mutate.py --only rho-pick-fastest --only tiles-split-drops-remainder
    .venv/bin/python scripts/mutate.py --full       # run the whole suite on each mutant (slow)
    .venv/bin/python scripts/mutate.py --list       # the mutations and whether each snippet is
                                                    # still in its file; nothing run

Exit status: 1 if any mutation survived; else 2 if any was not found, ambiguous or an error;
else 0. Before the mutants, the unmutated copy runs the union of their tests once (``--no-baseline``
skips it): a red baseline makes every "caught" meaningless, so the script stops there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLANNER_TESTS = ("tests/test_independent_references.py", "tests/planners/test_planners.py")
MEMORY_TESTS = ("tests/test_independent_references.py", "tests/paper/test_memory_model.py",
"tests/runtime/test_checkpointed.py")
EXECUTOR_TESTS = ("tests/test_independent_references.py", "tests/runtime/test_checkpointed.py")
SIMULATOR_TESTS = ("tests/test_independent_references.py", "tests/core/test_schedule.py",
"tests/planners/test_planners.py")
TILE_TESTS = ("tests/tiles/test_geometry.py", "tests/tiles/test_exact.py")
BUDGET_TESTS = ("tests/planners/test_budget_search.py", "tests/runtime/test_budget_fixed_part.py")


@dataclass(frozen=True)
class Mutation:
    """One injected bug: in ``file``, the exact text ``original`` becomes ``replacement``.

    Attributes:
        name: a short id (``--only``).
        file: path relative to the repo root.
        original: the snippet to replace; must occur exactly once in the file.
        replacement: the buggy text.
        tests: the test files that should catch it.
        bug: what the mutant gets wrong, in words.
        strength_test: one of the kinds that only the independent references of
            ``tests/test_independent_references.py`` catch.
    """

    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    bug: str
    strength_test: bool = False


MUTATIONS: tuple[Mutation, ...] = (
    # -- kinds only the independent references of tests/test_independent_references.py catch
    # ------------------
    Mutation(
        "optimal-rho-store-all",
        "edgetrain/planners/budget.py",
        "return next((p for p in self.points if p.recompute_factor <= limit), None)",
        "return next((p for p in reversed(self.points) if p.recompute_factor <= limit), None)",
        BUDGET_TESTS + PLANNER_TESTS,
        "the recompute-factor search returns the fastest plan within the factor (for optimal, "
        "the store-everything plan) instead of the least memory",
        True,
    ),
    Mutation(
        "rho-pick-fastest",
        "edgetrain/planners/budget.py",
        "key=lambda cs: (cs[0].heap_peak_bytes, cs[0].seconds, len(cs[1]))",
        "key=lambda cs: (cs[0].heap_peak_bytes, -cs[0].seconds, len(cs[1]))",
        BUDGET_TESTS + PLANNER_TESTS,
        "the frontier keeps the slowest plan of each peak: a recompute-factor search's tie goes "
        "to the slower plan, a budget's to a slower one",
        True,
    ),
    Mutation(
        "fixed-bytes-subtracts-buffers-input",
        "edgetrain/core/accounting.py",
        "+ chain.buffer_bytes\n        + chain.input_bytes",
        "- chain.buffer_bytes\n        - chain.input_bytes",
        MEMORY_TESTS,
        "fixed_training_bytes subtracts buffers and input instead of adding them",
        True,
    ),
    Mutation(
        "autograd-estimate-drops-buffers",
        "edgetrain/paper/memory_model.py",
        "other_bytes=chain.buffer_bytes + chain.input_bytes",
        "other_bytes=chain.input_bytes",
        MEMORY_TESTS,
        "autograd_estimate leaves out the buffers",
        True,
    ),
    Mutation(
        "autograd-estimate-drops-input",
        "edgetrain/paper/memory_model.py",
        "other_bytes=chain.buffer_bytes + chain.input_bytes",
        "other_bytes=chain.buffer_bytes",
        MEMORY_TESTS,
        "autograd_estimate leaves out the input",
        True,
    ),
    Mutation(
        "autograd-estimate-drops-activations",
        "edgetrain/paper/memory_model.py",
        "activations_bytes=peak,",
        "activations_bytes=0,",
        MEMORY_TESTS,
        "autograd_estimate leaves out its whole activation term",
        True,
    ),
    Mutation(
        "tradeoff-ignores-dp",
        "edgetrain/planners/budget.py",
        "return [table.schedule(int(m)) for m in changes]",
        "return [table.schedule(int(m)) for m in changes[:1]]",
        BUDGET_TESTS + PLANNER_TESTS,
        "the optimal frontier keeps only each table's least-memory plan (and storing everything)",
        True,
    ),
    # -- the budget search: the smallest budget, monotone feasibility, least memory within rho --
    Mutation(
        "device-smallest-is-fixed-part",
        "edgetrain/planners/search.py",
        "smallest = int(fixed_bytes + least)",
        "smallest = int(fixed_bytes)",
        BUDGET_TESTS,
        "a device budget below the fixed part reports the fixed part as the smallest that works "
        "(which is refused again)",
    ),
    Mutation(
        "smallest-is-store-all",
        "edgetrain/planners/budget.py",
        "            smallest = self.smallest_bytes\n",
        "            smallest = self.points[-1].peak_bytes\n",
        BUDGET_TESTS,
        "an infeasible budget reports the store-everything peak as the smallest that works",
    ),
    Mutation(
        "feasibility-not-monotone",
        "edgetrain/planners/budget.py",
        'index = int(np.searchsorted(peaks, memory_bytes, side="right")) - 1',
        'index = int(np.searchsorted(peaks, memory_bytes, side="right")) - 1 '
        "if memory_bytes < 0.6 * peaks[-1] else -1",
        BUDGET_TESTS,
        "budgets above 0.6 x the store-everything peak are refused while smaller ones plan",
    ),
    Mutation(
        "no-grad-shortcut-removed",
        "edgetrain/runtime/checkpointed.py",
        "if not torch.is_grad_enabled()",
        "if False and not torch.is_grad_enabled()",
        EXECUTOR_TESTS,
        "Checkpointed runs its plan (building graphs) under no_grad or with nothing to train",
        True,
    ),
    Mutation(
        "memory-table-never-red",
        "edgetrain/cli/memory.py",
        'style = "[bold red]" if not r["fits"] else ""',
        'style = ""',
        ("tests/test_independent_references.py", "tests/cli/test_commands.py"),
        "the memory table never marks a cell above the device memory",
        True,
    ),
    Mutation(
        "profile-slowest-run",
        "edgetrain/frontend/stage_measure.py",
        "        return min(samples)\n",
        "        return max(samples)\n",
        ("tests/test_independent_references.py", "tests/frontend/test_profiling.py"),
        "profiling takes the slowest timed run instead of the fastest",
        True,
    ),
    # -- kinds the rest of the suite catches: keep measuring them ---------------------------------
    Mutation(
        "memory-fits-always",
        "edgetrain/cli/memory.py",
        '"fits": paper.total_bytes <= device,',
        '"fits": True,',
        ("tests/test_independent_references.py", "tests/cli/test_commands.py"),
        "the memory command says every cell fits the device",
    ),
    Mutation(
        "executor-no-rng-replay",
        "edgetrain/autograd/replay.py",
        "    set_rng_state(state)\n    swapped",
        "    swapped",
        EXECUTOR_TESTS,
        "a recomputation does not replay the RNG state of the first run (other dropout masks)",
    ),
    Mutation(
        "executor-rng-not-restored",
        "edgetrain/autograd/replay.py",
        "        set_rng_state(outer)",
        "        pass",
        EXECUTOR_TESTS,
        "after a recomputation the caller's RNG stream is left where the replay ended",
    ),
    Mutation(
        "executor-no-buffer-copies",
        "edgetrain/autograd/replay.py",
        "        buffers[name] = copies[id(source)]",
        "        pass",
        EXECUTOR_TESTS,
        "a recomputation updates the real BatchNorm statistics a second time",
    ),
    Mutation(
        "executor-buffers-not-restored",
        "edgetrain/autograd/replay.py",
        "            buffers[name] = original",
        "            pass",
        EXECUTOR_TESTS,
        "after a recomputation the module keeps the copies of its buffers",
    ),
    Mutation(
        "simulate-ignores-saved-bytes",
        "edgetrain/core/simulator.py",
        "take(pieces[k + 1]) + stage.saved_bytes",
        "take(pieces[k + 1])",
        SIMULATOR_TESTS,
        "the simulator does not count what a graph saves besides its output",
    ),
    Mutation(
        "simulate-ignores-backward-peak",
        "edgetrain/core/simulator.py",
        "during = held + stage.backward_peak(grads_exist)",
        "during = held",
        SIMULATOR_TESTS,
        "the simulator ignores a backward's transient peak",
    ),
    Mutation(
        "revolve-split-halves",
        "edgetrain/planners/revolve.py",
        "return max(1, beta(slots, reps - 2), steps - beta(slots - 1, reps))",
        "return max(1, steps // 2)",
        PLANNER_TESTS,
        "revolve bisects instead of splitting at the binomial point",
    ),
    Mutation(
        "sequential-ceil-segments",
        "edgetrain/planners/sequential.py",
        "size = length // segments",
        "size = -(-length // segments)",
        PLANNER_TESTS,
        "sequential rounds segment sizes up, unlike checkpoint_sequential",
    ),
    Mutation(
        "tiles-split-drops-remainder",
        "edgetrain/tiles/grid.py",
        "size if i == parts - 1 else (i + 1) * step",
        "(i + 1) * step",
        TILE_TESTS,
        "the last tile does not take the remainder of the image",
    ),
    Mutation(
        "tiles-halo-one-short",
        "edgetrain/tiles/tiling.py",
        "(stop - 1) * self.stride - self.padding + self.extent",
        "(stop - 1) * self.stride - self.padding + self.extent - 1",
        TILE_TESTS,
        "a window's needed input span is one pixel short (halo too small)",
    ),
    # -- further kinds: the DP on its own, and profiling's byte counts ---------------------------
    Mutation(
        "dp-checkpoint-costs-nothing",
        "edgetrain/planners/dp_kernels.py",
        "own = 0 if pin else act[s]",
        "own = 0",
        PLANNER_TESTS,
        "the dynamic program forgets the memory of the checkpoint it keeps",
    ),
    Mutation(
        "dp-never-checkpoints",
        "edgetrain/planners/dp_kernels.py",
        "if value < best[m] * TIE:",
        "if value < -INF:",
        PLANNER_TESTS,
        "the dynamic program never considers a checkpoint (only graph-first and release plans)",
    ),
    Mutation(
        "profile-saved-counts-output-twice",
        "edgetrain/frontend/stage_measure.py",
        "saved_bytes=kept - new_saved_bytes,",
        "saved_bytes=kept,",
        ("tests/test_independent_references.py", "tests/frontend/test_profiling.py",
        "tests/runtime/test_checkpointed.py"),
        "profiling counts a stage's saved output twice (once more as saved tensors)",
    ),
)

IGNORED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "*.egg-info",
    "*.pyc",
)


@dataclass(frozen=True)
class Result:
    """What one mutation came to (``status``: see the module docstring)."""

    name: str
    file: str
    status: str
    seconds: float
    tests: tuple[str, ...]
    bug: str
    strength_test: bool
    detail: str = ""


def copy_repo(root: Path, into: Path) -> Path:
    """A copy of the repo's sources and tests in ``into`` (no venv, no git, no caches)."""
    target = into / "repo"
    shutil.copytree(root, target, ignore=IGNORED, symlinks=True)
    return target


def apply(repo: Path, mutation: Mutation) -> str | None:
    """Inject the mutation into the copy; returns None or why it could not be applied."""
    path = repo / mutation.file
    if not path.is_file():
        return "not found"
    text = path.read_text()
    count = text.count(mutation.original)
    if count == 0:
        return "not found"
    if count > 1:
        return "ambiguous"
    path.write_text(text.replace(mutation.original, mutation.replacement))
    return None


def run_tests(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str]:
    """Run pytest on ``tests`` in the copy: (status, last lines of its output)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "--hypothesis-seed=0",
        *tests,
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    process = subprocess.Popen(
        command,
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # our own process group: a timeout ends it and its children
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return "timeout", f"no result after {timeout:.0f} s"
    tail = "\n".join(output.strip().splitlines()[-3:])
    if process.returncode == 0:
        return "passed", tail
    if process.returncode == 1:
        failed = [line for line in output.splitlines() if line.startswith("FAILED")]
        return "failed", (failed[0] if failed else tail)
    return "error", f"pytest exit status {process.returncode}: {tail}"


def check_isolation(repo: Path) -> None:
    """The copy must import its own edgetrain, not the installed (editable) one."""
    probe = subprocess.run(
        [sys.executable, "-c", "import edgetrain; print(edgetrain.__file__)"],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        check=True,
    )
    if not Path(probe.stdout.strip()).resolve().is_relative_to(repo.resolve()):
        raise SystemExit(f"the copy imports edgetrain from {probe.stdout.strip()}, not {repo}")


def run_mutation(root: Path, mutation: Mutation, full: bool, timeout: float) -> Result:
    tests = ("tests",) if full else mutation.tests
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutate-{mutation.name}-") as tmp:
        repo = copy_repo(root, Path(tmp))
        problem = apply(repo, mutation)
        if problem is not None:
            status, detail = problem, f"snippet {mutation.original!r} in {mutation.file}"
        else:
            outcome, detail = run_tests(repo, tests, timeout)
            status = {"failed": "caught", "passed": "survived"}.get(outcome, outcome)
    return Result(
        mutation.name,
        mutation.file,
        status,
        time.perf_counter() - start,
        tests,
        mutation.bug,
        mutation.strength_test,
        detail,
    )


def baseline(root: Path, mutations: list[Mutation], full: bool, timeout: float) -> None:
    """Run the unmutated copy on every test file the mutations use; stop if it is red."""
    tests = ("tests",) if full else tuple(sorted({t for m in mutations for t in m.tests}))
    with tempfile.TemporaryDirectory(prefix="mutate-baseline-") as tmp:
        repo = copy_repo(root, Path(tmp))
        check_isolation(repo)
        status, detail = run_tests(repo, tests, timeout * 3)
    if status != "passed":
        raise SystemExit(f"baseline is not green ({status}): {detail}\nfix the suite first")


def show(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    styles = {"caught": "green", "timeout": "green", "survived": "bold red"}
    table = Table(title="Injected bugs (mutations) and the tests that should catch them")
    for column in ("mutation", "file", "status", "s", "strength test", "bug"):
        table.add_column(column)
    for r in results:
        style = styles.get(r.status, "yellow")
        table.add_row(
            r.name,
            r.file.removeprefix("edgetrain/"),
            f"[{style}]{r.status}[/]",
            f"{r.seconds:.0f}",
            "yes" if r.strength_test else "",
            r.bug,
        )
    counts = {s: sum(r.status == s for r in results) for s in sorted({r.status for r in results})}
    table.caption = ", ".join(f"{n} {s}" for s, n in counts.items())
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--only", action="append", default=[], help="run only this mutation")
    parser.add_argument("--full", action="store_true", help="run the whole suite on each mutant")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--list", action="store_true", help="list the mutations and stop")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [name for name in args.only if name not in known]
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(unknown)}; see --list")
    chosen = [known[name] for name in args.only] if args.only else list(MUTATIONS)
    if args.list:
        for m in chosen:
            path = ROOT / m.file
            count = path.read_text().count(m.original) if path.is_file() else 0
            found = {0: "not found", 1: "found"}.get(count, "ambiguous")
            print(f"{m.name:38} {m.file:36} {found:10} {m.bug}")
        return 0
    if not args.no_baseline:
        baseline(ROOT, chosen, args.full, args.timeout)
    results = []
    for mutation in chosen:
        result = run_mutation(ROOT, mutation, args.full, args.timeout)
        results.append(result)
        print(f"{result.name}: {result.status} ({result.seconds:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        show(results)
    if any(r.status == "survived" for r in results):
        return 1
    if any(r.status not in ("caught", "timeout") for r in results):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
