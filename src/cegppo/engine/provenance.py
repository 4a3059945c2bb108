"""What produced a result: the command, cegppo's version, the commit (:func:`provenance`, :func:`commit_label`) and
the machine (:func:`machine`: CPU model and ISA, cores, GPU, torch, load). Run directories record the first,
results files under ``benchmarks/results`` all three."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def provenance() -> dict:
    """What produced a result: the command line, cegppo's version and, in a git checkout, the commit. A copy of the
    tree names its commit in ``CEGPPO_COMMIT``, which wins over any ``.git`` there (the GPU machine's copy holds a
    ``.git`` of an older commit beside the newer tree)."""
    src = Path(__file__).resolve().parents[3]  # the checkout, when cegppo runs from one (pip install -e)
    commit, dirty = os.environ.get("CEGPPO_COMMIT") or None, False
    if commit is None and (src / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            dirty = bool(subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    return {"command": " ".join([portable_path(a) for a in command_argv()]), "cegppo_version": _version(),
            "commit": commit, "uncommitted_changes": dirty}


def command_argv() -> list[str]:
    """``sys.argv`` with the program named as a user types it: ``cegppo`` for the console script and for
    ``python -m cegppo.cli``."""
    prog = Path(sys.argv[0])
    if prog.name == "cegppo" or prog.parts[-2:] == ("cegppo", "cli.py"):
        return ["cegppo", *sys.argv[1:]]
    return list(sys.argv)


def portable_path(arg: str) -> str:
    """A command-line argument as a results file may record it: a path inside the checkout relative to it, any other
    absolute path as ``<local>`` (this machine's paths mean nothing on another); other arguments unchanged."""
    name, eq, value = arg.partition("=") if "=" in arg and not arg.startswith("/") else ("", "", arg)
    if not value.startswith("/"):
        return arg
    root = Path(__file__).resolve().parents[3]
    try:
        value = str(Path(value).resolve().relative_to(root))
    except ValueError:
        value = "<local>"
    return f"{name}{eq}{value}"


# Environment variables that cap the instruction set torch's kernels use below what the CPU has: a run with any set
# measured a narrower machine than ``isa`` names, and its results must say so.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_caps() -> dict[str, str]:
    """The :data:`ISA_CAPS` set in this process's environment, with their values."""
    return {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}


def machine() -> dict:
    """The machine a result was measured on: CPU model, the ISA level that decides the precision (``amx`` /
    ``avx512_bf16`` / ``avx512`` / ``avx2``), cores, whether bf16 is fast there, the GPU if torch sees one, torch's
    version and threads, and the 1-minute load average (what else was running). Also the ISA torch's own kernels
    dispatch to (``kernel_isa``) and any cap set on them (:func:`isa_caps`)."""
    import platform

    import torch

    flags, model = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = next((name for name, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"),
                                        ("avx2", "avx2")) if flag in flags), platform.machine())
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "isa": isa, "cores": os.cpu_count(), "bf16_fast": bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()), "gpu": gpu, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
        "kernel_isa": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": isa_caps()}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cegppo")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
        return "unknown (not installed)"


def commit_label() -> str:
    """The checkout's commit, short, with ``-dirty`` when tracked files have uncommitted changes (for results files);
    ``unknown`` outside a git checkout."""
    p = provenance()
    return "unknown" if p["commit"] is None else p["commit"][:7] + ("-dirty" if p["uncommitted_changes"] else "")
