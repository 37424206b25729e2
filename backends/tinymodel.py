"""Build a tiny random-weight Llama that vLLM loads, locally and in seconds.

Nothing is downloaded: a byte-level BPE tokenizer is trained on this Python's own
standard-library sources plus seeded filler text, the weights are random (std 0.02),
and a ChatML chat template is included, so chat completions work.

    .venv-vllm/bin/python -m backends.tinymodel models/tiny-llama

Needs torch, transformers and tokenizers (the vLLM environment has them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus(max_bytes: int, seed: int = 0) -> Iterator[str]:
    """Standard-library sources (sorted, so deterministic), then seeded filler."""
    budget = max_bytes
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "__pycache__"))
        for name in sorted(n for n in names if n.endswith(".py")):
            if budget <= max_bytes // 3:
                break
            try:
                text = Path(root, name).read_text(encoding="utf-8")[:200_000]
            except (OSError, UnicodeDecodeError):
                continue
            budget -= len(text)
            yield text
    rng = random.Random(seed)
    syllables = "ba ke lo mi nu ra se ti vo wa ch st th qu pl".split()
    while budget > 0:
        line = " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3)))
                        for _ in range(200)) + f" {rng.randint(0, 10**6)}\n"
        budget -= len(line)
        yield line


def build_tokenizer(vocab_size: int, max_position: int, corpus_bytes: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(corpus_bytes), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # a random model may emit any id: every id must decode
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=max_position, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build(out: Path, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 512, vocab: int = 2048, max_pos: int = 2048, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab, max_pos, 1_000_000)
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_pos, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"]],
        pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if "chat_template" not in tc:  # for readers that look only here
        tc["chat_template"] = CHAT_TEMPLATE
        tc_path.write_text(json.dumps(tc, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    if (args.out / "model.safetensors").exists() and not args.force:
        print(f"{args.out}: already built")
        return 0
    started = time.time()
    build(args.out, hidden=args.hidden, layers=args.layers, seed=args.seed)
    print(f"{args.out}: built in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
