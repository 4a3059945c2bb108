"""Hand-fused CPU kernels, built on first use with the system C compiler and cached.

``clip_surrogate`` computes the loss, d loss / d log_prob and the region metrics of the clipped-surrogate
objectives (``ce_gppo``, ``gppo``, ``ppo_clip`` and its ``grpo`` / ``dapo`` settings) in one vectorized pass.
``get_objective(..., compile=True)`` uses it for float32 CPU tensors; on other devices, dtypes and objectives
it uses ``torch.compile``. Why a C kernel: on CPU, Inductor splits this computation into two loops and
materialises the ratio twice, which keeps it at 3-4x the memory-bandwidth floor, against 2.1-2.3x for this
kernel (``benchmarks/results/objectives.md``).

Its ``exp`` is a polynomial within about 2 ulp of ``torch.exp`` (tested over the whole clamp range), so loss,
gradient and metrics agree with the Python definitions to float32 rounding; a token whose ratio lies within
that distance of a clip boundary may land on the other side of it.

The library lands in ``$CEGPPO_CACHE/kernels`` (default ``~/.cache/cegppo/kernels``), named by a hash of the
source, the compiler and the CPU, so it is rebuilt when any of them changes. ``CC`` picks the compiler
(default ``cc``); ``CEGPPO_CPU_KERNEL=0`` turns the kernel off. If it cannot be built, the first caller
gets one warning with the compiler's message and ``torch.compile`` is used instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from cegppo.io import cache_root

SOURCE = Path(__file__).with_name("clip_surrogate.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# order of clip_surrogate's `out` array
STAT_NAMES = ("loss", "clip/low_frac", "clip/high_frac", "clip/dual_frac", "ppo_kl", "ratio/mean")


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded; the message says why."""


_lib: ctypes.CDLL | None = None
_error: KernelUnavailable | None = None
_warned = False


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux), else the platform string."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.platform()


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernel into the cache (atomically; a no-op when already there) and return its path."""
    cc = os.environ.get("CC", "cc")
    compiler = shutil.which(cc)
    if compiler is None:
        raise KernelUnavailable(f"no C compiler {cc!r} on PATH (set CC to one)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, platform.machine(), _cpu_id()]).encode())
        cache_dir = cache_dir or cache_root() / "kernels"
        target = cache_dir / f"clip_surrogate-{key.hexdigest()[:16]}.so"
        if target.exists():
            return target
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-clip_surrogate-", suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            cmd = [compiler, *FLAGS, "-o", tmp, str(SOURCE)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise KernelUnavailable(f"`{cc} {' '.join(FLAGS)}` failed:\n{proc.stderr.strip()}")
            os.replace(tmp, target)  # concurrent builders write identical files; readers never see a partial one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler crash or timeout
        raise KernelUnavailable(f"building the kernel with {cc!r} failed: {e}") from e
    return target


def load() -> ctypes.CDLL:
    """The built kernel library; raises :class:`KernelUnavailable` (remembered, so the build is tried once)."""
    global _lib, _error
    if _lib is None and _error is None:
        try:
            path = build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # a cached file that does not load (damaged, foreign): rebuild it once
                path.unlink(missing_ok=True)
                lib = ctypes.CDLL(str(build()))
        except (OSError, KernelUnavailable) as e:
            _error = e if isinstance(e, KernelUnavailable) else KernelUnavailable(f"cannot load the kernel: {e}")
        else:
            f, p, i64, f32 = lib.clip_surrogate, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
            f.argtypes = [p, p, p, i64, p, i64, i64, *[f32] * 7, ctypes.c_double, ctypes.c_int, p, p]
            f.restype = ctypes.c_int
            _lib = lib
    if _error is not None:
        raise _error
    return _lib


def available() -> bool:
    """Whether ``clip_surrogate`` can run here (builds it on first call; warns once if it cannot)."""
    if os.environ.get("CEGPPO_CPU_KERNEL", "1") == "0":
        return False
    global _warned
    try:
        load()
    except KernelUnavailable as e:
        if not _warned:
            _warned = True
            warnings.warn(f"cegppo: fused CPU kernel unavailable, using torch.compile instead: {e}", stacklevel=3)
        return False
    return True


def clip_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    denom: float,
    *,
    eps_low: float,
    eps_high: float,
    low: tuple[float, float],
    high: tuple[float, float],
    clip_ratio_c: float | None,
) -> tuple[Tensor, Tensor]:
    """(d loss / d log_prob ``[B, T]``, stats ``[6]`` in :data:`STAT_NAMES` order) for float32 CPU ``[B, T]``
    inputs; ``advantages`` ``[B, 1]`` or ``[B, T]``; ``low`` / ``high`` = (value, grad weight) of the two clip
    regions (``clip_surrogate.c`` has the table). ``loss = sum(value * mask) / denom``, grad likewise."""
    lib = load()
    if log_prob.dim() != 2 or old_log_prob.shape != log_prob.shape or mask.shape != log_prob.shape:
        raise ValueError(f"clip_surrogate needs log_prob, old_log_prob and mask of one shape [B, T]; got "
                         f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(mask.shape)}")
    B, T = log_prob.shape
    if advantages.shape not in ((B, 1), (B, T)):
        raise ValueError(f"clip_surrogate needs advantages of shape [B, 1] or [B, T] = {(B, T)}; "
                         f"got {tuple(advantages.shape)}")
    # the C code reads raw float32 memory: convert and compact first (no-ops for float32 contiguous inputs)
    lp, old, m, adv = (
        t.detach().to("cpu", torch.float32).contiguous() for t in (log_prob, old_log_prob, mask, advantages)
    )
    grad = torch.empty_like(lp)
    stats = torch.empty(len(STAT_NAMES), dtype=torch.float32)
    c = math.inf if clip_ratio_c is None else clip_ratio_c
    rc = lib.clip_surrogate(
        lp.data_ptr(), old.data_ptr(), adv.data_ptr(), int(adv.shape[1] != 1), m.data_ptr(), B, T,
        eps_low, eps_high, *low, *high, c, float(denom), torch.get_num_threads(), grad.data_ptr(), stats.data_ptr(),
    )
    if rc != 0:
        raise MemoryError(f"clip_surrogate: could not allocate {B} x 7 doubles of scratch")
    return grad, stats

