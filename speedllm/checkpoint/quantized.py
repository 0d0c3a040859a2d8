"""Quantized Hugging Face export (`task=convert convert.to=hf quant=int8_wo`).

transformers stores torchao-quantized weights in safetensors and loads them back offline through the
`quantization_config` (TorchAoConfig) it writes into config.json. The export therefore lets transformers do
the quantizing: the full-precision export is loaded with the same torchao config our inference applies to the
same layers (every linear layer but the output projection), and saved. int4 cannot go this way on a CPU:
torchao's int4 tensors need the CUDA-only `mslk` kernels to be built or loaded.
"""

import shutil
from pathlib import Path

from speedllm.errors import UserError
from speedllm.quant import inference_scheme

EXPORTABLE = ("int8_wo",)


def check_exportable(name: str) -> None:
    if inference_scheme(name) not in EXPORTABLE:
        raise UserError(f"convert.to=hf with quant={name} is not supported: transformers loads torchao int4 (and "
                        f"float8) weights only with CUDA kernels; export with quant=int8_wo, or export full precision "
                        f"(quant=none) and apply quant={name} when loading")


def quantize_hf_dir(fp_dir: Path, out: Path, quant) -> None:
    """Load the full-precision HF directory `fp_dir` quantized for quant.name and save it to `out`."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from speedllm.checkpoint.hf import copy_tokenizer
    from speedllm.quant import torchao_inference_config

    config = TorchAoConfig(torchao_inference_config(inference_scheme(quant.name), quant),
                           modules_to_not_convert=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(str(fp_dir), quantization_config=config, dtype="auto")
    model.save_pretrained(str(out))
    copy_tokenizer(str(fp_dir), out)
    shutil.rmtree(fp_dir)
