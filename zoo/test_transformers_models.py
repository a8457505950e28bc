"""transformers models, small configs, random weights: T5 and a Llama-style decoder."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5EncoderModel

from harness import RunContext, check_model
from zoo import STAGES

SEED_TOKENS = (2, 12)


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, SEED_TOKENS)


def t5_config() -> T5Config:
    return T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        feed_forward_proj="relu",
    )  # fmt: skip


def t5_keep_fp32() -> tuple[str, ...]:
    """The modules ``T5EncoderModel._keep_in_fp32_modules`` (``wo``) names, as
    ``from_pretrained(torch_dtype=torch.float16)`` keeps them in float32."""
    model = T5EncoderModel(t5_config())
    keep = set(model._keep_in_fp32_modules or ())
    return tuple(name for name, _ in model.named_modules() if name.split(".")[-1] in keep)


def last_hidden_state(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).last_hidden_state


@check_model(
    stages=STAGES,
    modes=("autocast", "half"),
    keep_fp32=t5_keep_fp32(),
    expect={"autocast": "passes[undone-upcast]"},
)
def test_t5_encoder_keeps_wo_in_fp32() -> tuple[Any, ...]:
    """T5's encoder with ``wo`` kept float32, as transformers loads it in half precision.
    Under autocast the cast up before ``wo`` (``hidden_states.to(self.wo.weight.dtype)``)
    is undone: autocast runs ``wo`` in the half dtype all the same (accepted, it is true)."""
    config = t5_config()
    return (
        T5EncoderModel(config).eval(),
        {"input_ids": token_ids(config.vocab_size)},
        last_hidden_state,
    )


def llama_config(attention: str) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = attention
    return config


def logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits


@check_model(stages=STAGES, modes=("autocast", "half"), backends=("sdpa", "eager"))
def test_llama_decoder(ctx: RunContext) -> tuple[Any, ...]:
    """A Llama-style decoder (GQA, RoPE, RMSNorm) with SDPA or eager attention."""
    config = llama_config(ctx.backend)
    return LlamaForCausalLM(config).eval(), {"input_ids": token_ids(config.vocab_size)}, logits
