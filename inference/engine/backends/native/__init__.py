"""Native CPU kernels of the transformers backend, compiled once per machine.

Five kernels: :func:`paged_decode_attention` (``paged_attention.c``): decode attention read
straight from the paged KV pool, without first gathering each row's K/V into a padded tensor, in
fp32, in bf16, or fp32 over a bf16 pool (three C symbols, :data:`SYMBOLS`; bf16 K/V are widened
to fp32 exactly and accumulated in fp32); and
:func:`bf16_weight_matmul` (``bf16_head.c``): a bf16 model's LM head with fp32 logits, reading the
bf16 weight (half the bytes of an fp32 copy); and the projections of a bf16 model over weights
packed at load time (``bf16_gemm.c``, called through :mod:`inference.engine.backends.native.gemm`)
and its prefill attention read from the paged pool (``prefill_attention.c``, through
:mod:`inference.engine.backends.native.prefill`), and products over 4-bit weights as GGUF files
store them (``quant.c``: Q4_1 and Q8_0, through :mod:`inference.engine.backends.native.quant`).

The C sources are compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``) for this
CPU (:data:`CFLAGS`: ``-O3 -march=native -ffast-math -fopenmp``; linked without ``-ffast-math``,
whose start-up code would flush subnormals to zero for the whole process) into a shared library
cached under ``<repo>/.cache/kernels`` (the caller may name another folder: the worker's
``LLM_KERNEL_DIR``, ``EngineConfig.llm_kernel_dir``). The cache entry is keyed by the source,
the flags, the compiler and the CPU (model and feature flags), and holds a SHA-256
of the built file that is checked before every load, so a truncated or altered file is rebuilt
instead of mapped. The build takes a fraction of a second; the transformers backend runs it when
it is created, before serving. Where no compiler is present, the build fails or times out
(:data:`BUILD_TIMEOUT_S`), :func:`load` returns ``None`` and logs why; the backend then keeps its
gather path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_attention.c", "bf16_head.c", "bf16_gemm.c",
                             "prefill_attention.c", "quant.c", "decode_layer.c", "lora.c"))
REPO_ROOT = Path(__file__).resolve().parents[4]
# Compiled with -ffast-math (vectorised dot products and expf) but linked without it: linking
# with it adds start-up code that flushes subnormal floats to zero for the whole process.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LDFLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0  # per compile or link step

_ERRORS = {
    1: "a row length is below 1 or beyond its block table",
    2: "out of memory for the attention scores",
    3: "a block table names a block outside the pool",
}

# The kernel's C symbol per dtype of q (and out), and of the pool.
SYMBOLS = {(torch.float32, torch.float32): "paged_decode_attention",
           (torch.bfloat16, torch.bfloat16): "paged_decode_attention_bf16",
           (torch.float32, torch.bfloat16): "paged_decode_attention_f32_kv_bf16"}

HEAD_SYMBOL = "bf16_weight_matmul_f32"
GEMM_SYMBOL = "bf16_packed_matmul"  # bf16_gemm.c; called by inference.engine.backends.native.gemm
# prefill_attention.c; called by inference.engine.backends.native.prefill
PREFILL_SYMBOL = "prefill_attention_bf16"
# quant.c; called by inference.engine.backends.native.quant
QUANT_SYMBOLS = ("q4_1_matmul", "q4_1_dequantize", "q8_0_matmul", "q8_0_dequantize",
                 "q4_1_q8_matmul", "q8_0_q8_matmul", "q4_1_x16_pack", "q4_1_x16_q8_matmul",
                 "q8_0_x16_pack", "q8_0_x16_q8_matmul")
ALL_SYMBOLS = (*SYMBOLS.values(), HEAD_SYMBOL, GEMM_SYMBOL, PREFILL_SYMBOL, *QUANT_SYMBOLS,
               "decode_layer_bf16", "decode_layer_q4_1")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

DEFAULT_KERNEL_DIR = REPO_ROOT / ".cache" / "kernels"


def kernel_dir(configured: str | Path = "") -> Path:
    """Where compiled kernels are cached: ``configured`` or ``<repo>/.cache/kernels``."""
    configured = str(configured).strip()
    return Path(configured).expanduser() if configured else DEFAULT_KERNEL_DIR


def _compiler() -> list[str] | None:
    """The compiler command: ``$CC`` (split like a shell would: ``ccache gcc``), else cc, gcc.

    ``CC`` is the C toolchain's own convention (make and setuptools read it the same way), so
    it is read here, where the compiler runs, rather than passed down as an engine setting.
    """
    configured = os.environ.get("CC", "").strip()
    if configured:
        try:
            command = shlex.split(configured)
        except ValueError:
            command = []
        if command and shutil.which(command[0]):
            return command
        logger.warning("CC=%r is not a program on the PATH; trying cc and gcc", configured)
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return [name]
    return None


def _cpu_id() -> str:
    """The CPU's model and feature flags (``-march=native`` code must not move between CPUs)."""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines: list[str] = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in wanted and line not in lines:
                    lines.append(line)
                if not line.strip() and lines:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return "".join(lines) or platform.processor()


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    """Run ``command`` in a session of its own; on timeout kill all of it (cc1, as, ld too)."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            # A process that left the group may still hold the pipes: do not wait for it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def load(cache_dir: str | Path = "") -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; ``None`` where it cannot be built.

    Args:
        cache_dir: where built kernels are kept (empty: ``<repo>/.cache/kernels``).

    Never raises: any failure is logged as a warning and remembered (no retry in this process).
    """
    folder = kernel_dir(cache_dir)
    with _lock:
        if str(folder) in _loaded:
            return _loaded[str(folder)]
        lib = None
        try:
            lib = _build_and_load(folder)
        except Exception as exc:  # noqa: BLE001 - any failure means: use the gather path
            logger.warning("native paged attention unavailable, using the gather path: %s: %s",
                           type(exc).__name__, exc)
        _loaded[str(folder)] = lib
        return lib


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build_and_load(folder: Path) -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found ($CC, cc, gcc): native paged attention is off")
        return None
    version = _run([*cc, "--version"], timeout=10)
    if version.returncode != 0:
        raise subprocess.CalledProcessError(version.returncode, version.args)
    key = hashlib.sha256(b"\0".join([
        *(path.read_bytes() for path in sorted(SOURCES[0].parent.glob("*.[ch]"))),
        " ".join(CFLAGS + LDFLAGS).encode(), " ".join(cc).encode(),
        version.stdout,
        _cpu_id().encode(), platform.machine().encode(),
    ])).hexdigest()[:16]
    target = folder / f"paged_attention-{key}.so"
    stamp = target.with_name(target.name + ".sha256")
    try:
        intact = (target.is_file() and stamp.is_file()
                  and stamp.read_text().strip() == _digest(target))
    except (OSError, UnicodeDecodeError):
        intact = False
    if not intact:
        if target.exists() or stamp.exists():
            logger.warning("cached kernel %s is missing its checksum or does not match it; "
                           "rebuilding it", target)
        if not _compile(cc, target, stamp):
            return None
    lib = ctypes.CDLL(str(target))
    for symbol in SYMBOLS.values():
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    head = lib.bf16_weight_matmul_f32
    head.restype = ctypes.c_int
    head.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    gemm = getattr(lib, GEMM_SYMBOL)
    gemm.restype = ctypes.c_int
    gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
    prefill = getattr(lib, PREFILL_SYMBOL)
    prefill.restype = ctypes.c_int
    prefill.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7
                        + [ctypes.c_float, ctypes.c_int64])
    declare_quant(lib)
    for flag in ("bf16_weight_matmul_uses_dpbf16", "bf16_packed_matmul_available"):
        getattr(lib, flag).restype = ctypes.c_int
        getattr(lib, flag).argtypes = []
    logger.info("native paged attention loaded from %s", target)
    return lib


def declare_quant(lib: ctypes.CDLL) -> None:
    """The argument types of ``quant.c``'s symbols on ``lib`` (x16: AVX-512 VNNI's layout)."""
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    pack, matmul = [ptr] * 2 + [i64] * 2, [ptr] * 4 + [i64] * 3 + [c_int]
    for kind in ("q4_1", "q8_0"):
        for name, args in (("matmul", matmul), ("q8_matmul", matmul), ("x16_q8_matmul", matmul),
                           ("x16_pack", pack), ("dequantize", [*pack, c_int])):
            getattr(lib, f"{kind}_{name}").restype = c_int
            getattr(lib, f"{kind}_{name}").argtypes = args
    for flag in ("q4_1_simd", "q4_1_x16_available"):
        getattr(lib, flag).restype, getattr(lib, flag).argtypes = c_int, []


def _looks_built(path: Path) -> bool:
    """A shared object with the kernels' symbols in it (a compiler that wrote nothing or garbage
    must not leave a checksummed entry that is then mapped)."""
    data = path.read_bytes()
    return data[:4] == b"\x7fELF" and all(s.encode() in data for s in ALL_SYMBOLS)


def _compile(cc: list[str], target: Path, stamp: Path) -> bool:
    """Build the library at ``target`` and its checksum at ``stamp``; ``False`` (and a logged
    warning) if the compiler fails, times out or writes nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, tmp_stamp = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(fd)
    try:
        try:
            objects = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
            for source, obj in zip(SOURCES, objects, strict=True):
                result = _run([*cc, *CFLAGS, "-c", str(source), "-o", obj], BUILD_TIMEOUT_S)
                if result.returncode != 0:
                    break
            else:
                result = _run([*cc, *LDFLAGS, *objects, "-o", tmp, "-lm"], BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("building native paged attention took over %g s; using the gather "
                           "path", BUILD_TIMEOUT_S)
            return False
        if result.returncode != 0 or not _looks_built(Path(tmp)):
            logger.warning("building native paged attention failed (exit %s), using the gather "
                           "path:\n%s", result.returncode,
                           result.stderr.decode(errors="replace")[-2000:])
            return False
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would shut out other users of a shared cache
        Path(tmp_stamp).write_text(_digest(Path(tmp)) + "\n")
        os.chmod(tmp_stamp, 0o644)
        os.replace(tmp, target)
        os.replace(tmp_stamp, stamp)
        return True
    finally:
        for leftover in (tmp, tmp_stamp, *(f"{tmp}.{i}.o" for i in range(len(SOURCES)))):
            if os.path.exists(leftover):
                os.unlink(leftover)


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, pool: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention of one new token per row over the paged KV pool of one layer.

    ``q`` and ``pool`` are both fp32, both bf16, or fp32 over a bf16 pool (:data:`SYMBOLS`); the
    output has ``q``'s dtype. The kernel widens bf16 K, V and q to fp32 exactly, computes scores,
    softmax and the weighted sum of V in fp32, and rounds a bf16 output once (to nearest even).

    Args:
        lib: the library :func:`load` returned.
        q: ``[rows, kv_heads, group, head_dim]`` fp32 or bf16 queries (CPU, contiguous).
        pool: ``[2 * kv_heads, num_blocks, block_size, head_dim]`` fp32 or bf16, K heads then
            V heads, the new tokens' K/V already written.
        tables: ``[rows, max_blocks]`` int64 block ids (unused tail entries ignored).
        lens: ``[rows]`` int64 tokens each row attends to, its new token included.
        scale: the softmax scale (``head_dim ** -0.5``).

    Returns:
        ``[rows, kv_heads, group, head_dim]`` attention output in ``q``'s dtype.

    Raises:
        ValueError: for tensors of another dtype, device, rank or layout than above (a bf16 ``q``
            over an fp32 ``pool`` included), or a length or block id that does not fit the pool.
        MemoryError: if the kernel cannot allocate its score buffer.
    """
    floats, names = (torch.float32, torch.bfloat16), "torch.float32 or torch.bfloat16"
    for name, tensor, dtypes, dims in (("q", q, floats, 4), ("pool", pool, floats, 4),
                                       ("tables", tables, (torch.int64,), 2),
                                       ("lens", lens, (torch.int64,), 1)):
        if (tensor.dtype not in dtypes or tensor.device.type != "cpu" or tensor.dim() != dims
                or not tensor.is_contiguous()):
            kind = names if dtypes is floats else str(dtypes[0])
            raise ValueError(f"paged decode attention: {name} must be a contiguous {dims}-d "
                             f"{kind} CPU tensor, got {tuple(tensor.shape)} {tensor.dtype} "
                             f"on {tensor.device}")
    if (q.dtype, pool.dtype) not in SYMBOLS:
        raise ValueError(f"paged decode attention: no kernel for q {q.dtype} over a pool "
                         f"{pool.dtype}")
    rows, kv_heads, group, head_dim = q.shape
    if (pool.shape[0] != 2 * kv_heads or pool.shape[3] != head_dim or tables.shape[0] != rows
            or lens.shape[0] != rows):
        raise ValueError(f"paged decode attention: shapes do not match: q {tuple(q.shape)}, "
                         f"pool {tuple(pool.shape)}, tables {tuple(tables.shape)}, "
                         f"lens {tuple(lens.shape)}")
    num_blocks, block_size = pool.shape[1], pool.shape[2]
    if min(kv_heads, group, head_dim, num_blocks, block_size) < 1:
        raise ValueError(f"paged decode attention: empty dimension in q {tuple(q.shape)} or "
                         f"pool {tuple(pool.shape)}")
    out = torch.empty_like(q)
    if rows == 0:
        return out
    kernel = getattr(lib, SYMBOLS[q.dtype, pool.dtype])
    rc = kernel(
        q.data_ptr(), pool.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        rows, kv_heads, group, head_dim, num_blocks, block_size, tables.shape[1], scale,
    )
    if rc == 2:
        raise MemoryError(_ERRORS[2])
    if rc:
        raise ValueError(f"paged decode attention: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def bf16_weight_matmul_max_rows(lib: ctypes.CDLL) -> int:
    """Most rows of ``x`` for which :func:`bf16_weight_matmul` beats the backend's fp32 product
    over an fp32 copy of the weight (``python -m benchmarks.kernels.lm_head``): any number where the
    library's products run on VDPBF16PS (2.2 to 7.5 times faster from 1 to 128 rows on the
    default model's head), 2 where they run on widened fp32 (bound by reading the weight, half
    the bytes, only for a row or two; beyond that oneDNN's fp32 blocking does better)."""
    return sys.maxsize if lib.bf16_weight_matmul_uses_dpbf16() else 2


def bf16_weight_matmul(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32 from a bf16 ``weight``, read as bf16 (half the bytes of an
    fp32 copy) and widened exactly to fp32 in the kernel: the result equals an fp32 matmul over
    ``weight.float()`` up to the order of the additions. For a few rows of ``x``, where the
    product is bound by memory bandwidth (a bf16 model's LM head at decode).

    Args:
        lib: the library :func:`load` returned.
        x: ``[rows, in_features]`` fp32 (CPU, contiguous).
        weight: ``[out_features, in_features]`` bf16 (CPU, contiguous).
        bias: ``[out_features]`` fp32, or None.

    Returns:
        ``[rows, out_features]`` fp32.

    Raises:
        ValueError: for tensors of another dtype, device, rank, layout or size than above.
        MemoryError: if the kernel cannot allocate its per-thread weight buffer.
    """
    for name, tensor, dtype, dims in (("x", x, torch.float32, 2),
                                      ("weight", weight, torch.bfloat16, 2),
                                      ("bias", bias, torch.float32, 1)):
        if tensor is None:
            continue
        if (tensor.dtype != dtype or tensor.device.type != "cpu" or tensor.dim() != dims
                or not tensor.is_contiguous()):
            raise ValueError(f"bf16 weight matmul: {name} must be a contiguous {dims}-d {dtype} "
                             f"CPU tensor, got {tuple(tensor.shape)} {tensor.dtype} on "
                             f"{tensor.device}")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if (weight.shape[1] != in_features or min(in_features, out_features) < 1
            or (bias is not None and bias.shape[0] != out_features)):
        raise ValueError(f"bf16 weight matmul: shapes do not match: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    rc = getattr(lib, HEAD_SYMBOL)(weight.data_ptr(), x.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(),
                                   rows, out_features, in_features)
    if rc == 2:
        raise MemoryError("bf16 weight matmul: out of memory for the weight buffer")
    if rc:
        raise ValueError(f"bf16 weight matmul: error {rc}")
    return out
