"""Write a weightless model directory for `load_format="dummy"`: SRC's config.json
(optionally reshaped) and tokenizer files, no weights. The engine then draws
random weights on the device itself, so a GPU machine that cannot receive a
checkpoint benchmarks the model's shape (throughput with `ignore_eos` does not
depend on the weights' values).

    python bench/gpu/random_model.py SRC_DIR OUT_DIR                      # SRC's own shape
    python bench/gpu/random_model.py SRC_DIR OUT_DIR --shape llama3-8b    # realistic decode

`llama3-8b` keeps SRC's vocabulary and tokenizer and takes Llama-3-8B's layer
dims (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, untied
head), so decode reads ~16 GB of bf16 weights per step: memory-bound, as in
real serving.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil

META_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json", "generation_config.json")
SHAPES = {
    "same": {},
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
                  "tie_word_embeddings": False, "rope_theta": 500000.0,
                  "max_position_embeddings": 8192},
}


def write(src: str, out: str, shape: str = "same") -> pathlib.Path:
    src_dir, out_dir = pathlib.Path(src), pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in META_FILES:
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, out_dir / name)
    config = json.loads((src_dir / "config.json").read_text())
    config.update(SHAPES[shape])
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="same")
    args = ap.parse_args(argv)
    out = write(args.src, args.out, args.shape)
    print(f"weightless {args.shape} model directory written to {out} (serve it with load_format=dummy)")


if __name__ == "__main__":
    main()
