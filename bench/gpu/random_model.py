"""Write a random-weight copy of a Llama-family model: its config.json and
tokenizer files from SRC, bf16 weights drawn at random (transformers' init).

Throughput with `ignore_eos` does not depend on the weights' values, so a GPU
machine that cannot receive the real checkpoint benchmarks this copy instead.

    python bench/gpu/random_model.py SRC_DIR OUT_DIR
"""
from __future__ import annotations

import pathlib
import shutil
import sys

META_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json", "generation_config.json")


def main(src: str, out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src_dir, out_dir = pathlib.Path(src), pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(src_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in META_FILES:
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, out_dir / name)
    print(f"random-weight model written to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
