"""Native CPU kernels of the transformers backend, compiled on first use.

One kernel so far, :func:`paged_decode_attention` (``paged_attention.c``): decode attention read
straight from the paged KV pool, without first gathering each row's K/V into a padded tensor.

The C source is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) for this CPU
(``-O3 -march=native -fopenmp``) into a shared library cached under ``<repo>/.cache/kernels``
(``LLM_KERNEL_DIR`` overrides), keyed by the source, the compiler and the CPU, and loaded with
``ctypes``. It takes about a second, once per machine. Where no compiler is present or the build
fails, :func:`load` returns ``None`` and logs why; the backend then keeps its gather path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
REPO_ROOT = Path(__file__).resolve().parents[3]
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11")

_ERRORS = {
    1: "a row length is below 1 or beyond its block table",
    2: "out of memory for the attention scores",
    3: "a block table names a block outside the pool",
}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def kernel_dir() -> Path:
    """Where compiled kernels are cached: ``LLM_KERNEL_DIR`` or ``<repo>/.cache/kernels``."""
    configured = os.environ.get("LLM_KERNEL_DIR", "").strip()
    return Path(configured).expanduser() if configured else REPO_ROOT / ".cache" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("model name"):
                    return line
    except OSError:
        pass
    return platform.processor()


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; ``None`` where it cannot be built."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        try:
            lib = _build_and_load()
        except (OSError, AttributeError, subprocess.SubprocessError) as exc:
            logger.warning("native paged attention unavailable, using the gather path: %s", exc)
        _loaded["lib"] = lib
        return lib


def _build_and_load() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found ($CC, cc, gcc): native paged attention is off")
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(CFLAGS).encode(), version.encode(), _cpu_id().encode(),
                    platform.machine().encode()])
    ).hexdigest()[:16]
    target = kernel_dir() / f"paged_attention-{key}.so"
    if not target.exists() and not _compile(cc, target):
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        # A damaged cache entry (a truncated copy, say): build it again, once.
        logger.warning("cached kernel %s does not load (%s); rebuilding it", target, exc)
        target.unlink(missing_ok=True)
        if not _compile(cc, target):
            return None
        lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    return lib


def _compile(cc: str, target: Path) -> bool:
    """Build the library at ``target``; ``False`` (and a logged warning) if the compiler fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            logger.warning("building native paged attention failed, using the gather path:\n%s",
                           result.stderr[-2000:])
            return False
        os.replace(tmp, target)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, pool: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of one new token per row over the paged KV pool of one layer.

    Args:
        lib: the library :func:`load` returned.
        q: ``[rows, kv_heads, group, head_dim]`` fp32 queries (CPU, contiguous).
        pool: ``[2 * kv_heads, num_blocks, block_size, head_dim]`` fp32, K heads then V heads,
            the new tokens' K/V already written.
        tables: ``[rows, max_blocks]`` int64 block ids (unused tail entries ignored).
        lens: ``[rows]`` int64 tokens each row attends to, its new token included.
        scale: the softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[rows, kv_heads, group, head_dim]`` attention output.

    Raises:
        ValueError: for tensors of another dtype, device, rank or layout than above, or a
            length or block id that does not fit the pool.
        MemoryError: if the kernel cannot allocate its score buffer.
    """
    for name, tensor, dtype, dims in (("q", q, torch.float32, 4), ("pool", pool, torch.float32, 4),
                                      ("tables", tables, torch.int64, 2),
                                      ("lens", lens, torch.int64, 1)):
        if (tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != dims
                or not tensor.is_contiguous()):
            raise ValueError(f"paged decode attention: {name} must be a contiguous {dims}-d "
                             f"{dtype} CPU tensor, got {tuple(tensor.shape)} {tensor.dtype} "
                             f"on {tensor.device}")
    rows, kv_heads, group, head_dim = q.shape
    if (pool.shape[0] != 2 * kv_heads or pool.shape[3] != head_dim or tables.shape[0] != rows
            or lens.shape[0] != rows):
        raise ValueError(f"paged decode attention: shapes do not match: q {tuple(q.shape)}, "
                         f"pool {tuple(pool.shape)}, tables {tuple(tables.shape)}, "
                         f"lens {tuple(lens.shape)}")
    num_blocks, block_size = pool.shape[1], pool.shape[2]
    out = torch.empty_like(q)
    rc = lib.paged_decode_attention(
        q.data_ptr(), pool.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        rows, kv_heads, group, head_dim, num_blocks, block_size, tables.shape[1], scale,
    )
    if rc == 2:
        raise MemoryError(_ERRORS[2])
    if rc:
        raise ValueError(f"paged decode attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out
