"""Build a random-weight LoRA adapter for a local model, in PEFT's layout, as vLLM loads it.

Nothing is downloaded: ``adapter_config.json`` names the attention projections it adapts,
and ``adapter_model.safetensors`` holds ``lora_A`` / ``lora_B`` for each of them in every
layer, drawn from ``--seed`` (PEFT starts ``lora_B`` at zero, which would change nothing:
here both are random and large enough that the adapter's greedy answers differ from the
base model's and from another seed's).

    .venv-vllm/bin/python -m backends.tinylora /tmp/a1 --base models/tiny-llama --seed 1

Needs torch and safetensors (the vLLM environment has them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = ("q_proj", "v_proj")


def build(out: Path, base: Path, seed: int, rank: int = 8) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    sizes = {"q_proj": heads * head_dim,
             "v_proj": config.get("num_key_value_heads", heads) * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                rank, hidden, generator=generator) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(
                sizes[target], rank, generator=generator) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGETS), "fan_in_fan_out": False}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    build(args.out, args.base, args.seed, args.rank)


if __name__ == "__main__":
    main()
