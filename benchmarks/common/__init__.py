"""The code the benchmark scripts share; no script imports another script, each imports this package.

A script run as ``python benchmarks/<name>.py`` finds this package beside it (Python puts the script's directory,
``benchmarks/``, first on ``sys.path``; the tests get it from ``tests/conftest.py``). Its modules:

- ``common`` (here): what every results file records about how it was made: the commit, the command (argv only:
  ``--note`` texts go to the file's notes), the date and the machine (CPU model and ISA, cores, torch and its
  threads, the 1-minute load average), with the precision it ran in; and writing a results file;
- :mod:`common.bf16_rounding`: bf16 autocast's numerics at fp32 speed (``precision_gradients``, ``precision_warmstart``);
- :mod:`common.entropy`: the additions task and the entropy-control setting (``reproduce_entropy``,
  ``entropy_control``, ``entropy_regime``, ``entropy_plant``, ``stability_map``);
- :mod:`common.measure`: the problems one RL step trains on (``step_throughput``, ``roofline``) and torch's peak CPU
  allocation (``logits_memory``, ``objectives``).
"""

from __future__ import annotations

import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def in_checkout(path: Path) -> Path:
    """``path`` relative to the checkout when it lies inside it (what results record: no machine's path)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def quick_out(name: str) -> Path:
    """Where a ``--quick`` smoke run writes by default: under ``runs/``, never over ``benchmarks/results/``."""
    return ROOT / "runs" / f"{name}_quick"


def without_notes(argv: list[str]) -> list[str]:
    """``argv`` less every ``--note TEXT`` (and ``--note=TEXT``): a note is prose for the results file's notes, not
    part of the command that reproduces it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            out.append(arg)
    return out


def command(script: str, env: dict[str, str] | None = None) -> str:
    """The command line that ran ``benchmarks/<script>`` (relative to the checkout, so results compare across clones;
    paths outside it as ``<local>``, :func:`cegppo.engine.provenance.portable_path`), argv only: first the environment
    variables that matter (``env``, then any cap on the kernels' instruction set,
    :func:`cegppo.engine.provenance.isa_caps`), no ``--note`` texts (:func:`without_notes`). ``script`` is the
    script's name (a path, such as ``__file__``, is reduced to its name)."""
    from cegppo.engine.provenance import isa_caps, portable_path

    env = {**(env or {}), **isa_caps()}
    return shlex.join([*(f"{k}={portable_path(v)}" for k, v in env.items()), "python",
                       f"benchmarks/{Path(script).name}", *map(portable_path, without_notes(sys.argv[1:]))])


def settings(args) -> dict:
    """A script's parsed arguments as a results file records them: paths as :func:`command` writes them (relative to
    the checkout, else ``<local>``), so no record names a directory of the machine that made it."""
    from cegppo.engine.provenance import portable_path

    return {k: portable_path(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items()}


def tests_module(name: str):
    """``tests/<name>.py`` loaded by its path (``objectives.py`` times the tests' reference formulations), with no
    ``sys.path`` entry for ``tests/``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def provenance(script: str, precision: str) -> dict:
    """commit, command, date, machine (:func:`cegppo.engine.provenance.machine`) and precision, for a results file."""
    from cegppo.engine.provenance import commit_label, machine

    return {"commit": commit_label(), "command": command(script),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "precision": precision}


def write_results(out: Path, name: str, result: dict, text: str) -> None:
    """``out/name.json`` (the result) and ``out/name.md`` (its report ``text``), each written atomically; the report
    is printed too."""
    from cegppo.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{name}.json", result)
    atomic_write_text(out / f"{name}.md", text)
    print(text)


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), range and the values themselves: a figure over seeds."""
    import statistics

    return {"values": values, "mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def load_now() -> float:
    return round(os.getloadavg()[0], 2)


def provenance_line(result: dict) -> str:
    """One markdown line: the commit, date and machine of a result (results older than this record none)."""
    m = result.get("machine")
    if not m:
        return "Commit, date and machine not recorded (a result from before they were)."
    busy = m["load_1min"] > 0.6 * m["cores"]
    caps = ", ".join(f"{k}={v}" for k, v in sorted((m.get("isa_caps") or {}).items()))  # as the JSON reads back
    capped = f", kernels capped to {m['kernel_isa']} by {caps}" if caps else ""
    return (f"Commit `{result['commit']}`, {result['date']}; {m['cpu']} ({m['isa']}{capped}, {m['cores']} cores"
            f"{', GPU ' + m['gpu'] if m.get('gpu') else ''}), torch {m['torch']} with {m['threads']} threads, precision "
            f"{result['precision']}; 1-min load average {m['load_1min']} at the start"
            f"{' (other processes were running)' if busy else ''}.")
