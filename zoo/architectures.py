"""Real architectures from transformers and diffusers, built small from their configs with
random weights (nothing is downloaded), for calibrating the numerical-error yardstick.

Each factory takes no arguments and returns ``(model, inputs, forward)`` as the zoo's tests
do: the model in float32 on the CPU in eval mode, the inputs a dict of keyword tensors drawn
from the (already seeded) RNG, and ``forward(model, inputs)`` the output to compare. Widths
are small (hidden 64, 4 heads, vocabulary 128, 16 tokens, batch 2) so a float64 forward pass
takes milliseconds on a CPU; depth is mixed: 12 layers for GPT-2, BERT, Qwen2 and OPT, 2-4
for the rest. ``ARCHITECTURES`` maps a short name to ``(factory, layers)``; ``DEEP`` does the
same for three healthy models 48 layers deep, post-LayerNorm encoders (BERT, and torch's
own ``nn.TransformerEncoder`` with its ReLU) and a pre-norm decoder (Llama), which calibrate
the yardstick at depth (too slow for the zoo's tests). Every
entry builds and runs under both transformers 4.46.3 / diffusers 0.31.0 and transformers
5.23.0 / diffusers 0.42.1, with the same config arguments, so none is gated on a version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    WhisperConfig,
)

Factory = Callable[[], tuple[Any, ...]]
Forward = Callable[[Any, dict[str, Any]], torch.Tensor]

VOCAB = 128
BATCH = 2
TOKENS = 16


def token_ids(tokens: int = TOKENS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, tokens))


def text_inputs() -> dict[str, Any]:
    ids = token_ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def sdpa(config: Any) -> Any:
    config._attn_implementation = "sdpa"
    return config


def logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits


def last_hidden_state(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).last_hidden_state


def sample(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).sample


def causal_lm(model: Any) -> tuple[Any, dict[str, Any], Forward]:
    return model.eval(), text_inputs(), logits


# -- transformers: decoders --------------------------------------------------------------


def gpt2_12l() -> tuple[Any, ...]:
    """GPT-2 (learned positions, pre-LayerNorm, GELU MLP), 12 layers."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=12, n_head=4, n_inner=256,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return causal_lm(GPT2LMHeadModel(sdpa(config)))


def opt_12l() -> tuple[Any, ...]:
    """OPT (learned offset positions, pre-LayerNorm, ReLU MLP), 12 layers."""
    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=12, ffn_dim=256,
        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
        pad_token_id=1, bos_token_id=2, eos_token_id=2, use_cache=False,
    )  # fmt: skip
    return causal_lm(OPTForCausalLM(sdpa(config)))


def qwen2_12l() -> tuple[Any, ...]:
    """Qwen2 (GQA with QKV bias, RoPE, RMSNorm, SwiGLU), 12 layers."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    return causal_lm(Qwen2ForCausalLM(sdpa(config)))


def llama(layers: int) -> tuple[Any, ...]:
    """Llama (GQA, RoPE, pre-RMSNorm, SwiGLU), ``layers`` deep."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    return causal_lm(LlamaForCausalLM(sdpa(config)))


def llama_48l() -> tuple[Any, ...]:
    """Llama (GQA, RoPE, pre-RMSNorm, SwiGLU), 48 layers."""
    return llama(48)


def mistral_2l() -> tuple[Any, ...]:
    """Mistral (GQA, RoPE, RMSNorm, SwiGLU, sliding-window mask of 8 tokens), 2 layers."""
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        sliding_window=8, use_cache=False,
    )  # fmt: skip
    return causal_lm(MistralForCausalLM(sdpa(config)))


def gemma2_2l() -> tuple[Any, ...]:
    """Gemma 2 (scaled embeddings, sandwich RMSNorm, GeGLU, tanh soft-capping), 2 layers."""
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=64, sliding_window=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=1,
    )  # fmt: skip
    # Eager attention: SDPA has no attention-logit soft-capping, so transformers 5 refuses SDPA
    # for Gemma 2 (and 4.46 silently drops the capping there); eager keeps tanh at 50 on the
    # attention scores, besides tanh at 30 on the final logits. use_cache=False goes to the
    # forward only: in the config, 4.46 warns (through a broken logging call) that it overrides
    # Gemma 2's "hybrid" cache_implementation.
    config._attn_implementation = "eager"
    return causal_lm(Gemma2ForCausalLM(config))


# -- transformers: encoders and an encoder-decoder ----------------------------------------


def bert(layers: int) -> tuple[Any, ...]:
    """BERT encoder (post-LayerNorm, absolute positions, token types), ``layers`` deep."""
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=64,
    )  # fmt: skip
    inputs = text_inputs()
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    return BertModel(sdpa(config), add_pooling_layer=False).eval(), inputs, last_hidden_state


def bert_12l() -> tuple[Any, ...]:
    """BERT encoder (post-LayerNorm, absolute positions, token types), 12 layers."""
    return bert(12)


def bert_48l() -> tuple[Any, ...]:
    """BERT encoder (post-LayerNorm, absolute positions, token types), 48 layers."""
    return bert(48)


def bart_4l() -> tuple[Any, ...]:
    """BART encoder-decoder (post-LayerNorm, cross-attention), 2 encoder + 2 decoder layers."""
    config = BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    inputs = text_inputs()
    inputs["decoder_input_ids"] = token_ids(12)
    return BartForConditionalGeneration(sdpa(config)).eval(), inputs, logits


def whisper_encoder_2l() -> tuple[Any, ...]:
    """Whisper's audio encoder (two convolutions over log-mel frames, pre-LayerNorm), 2 layers."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1,
    )  # fmt: skip
    # the encoder takes exactly 2 * max_source_positions frames (the stride-2 conv halves them)
    inputs = {"input_features": torch.randn(BATCH, 16, 32)}
    return WhisperEncoder(sdpa(config)).eval(), inputs, last_hidden_state


# -- diffusers -----------------------------------------------------------------------------


def autoencoder_kl_2l() -> tuple[Any, ...]:
    """diffusers AutoencoderKL (the Stable Diffusion VAE: GroupNorm ResNets, a mid-block
    attention), 2 resolution levels each way, encode then decode."""
    import diffusers  # only these four need it (a GPU box may lack it)

    model: Any = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=8, sample_size=16,
    )  # fmt: skip
    # without a generator the forward decodes the posterior's mode: deterministic
    return model.eval(), {"sample": torch.randn(BATCH, 3, 16, 16)}, sample


def dit_2l() -> tuple[Any, ...]:
    """diffusers DiT (class-conditioned adaLN-Zero transformer over latent patches), 2 layers."""
    import diffusers  # only these four need it (a GPU box may lack it)

    model: Any = diffusers.DiTTransformer2DModel(
        num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, norm_num_groups=8, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
    )  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(BATCH, 4, 8, 8),
        "timestep": torch.tensor([500] * BATCH),
        "class_labels": torch.randint(0, 10, (BATCH,)),
    }
    return model.eval(), inputs, sample


def sd3_2l() -> tuple[Any, ...]:
    """diffusers SD3 MMDiT (joint image-text attention, adaLN, pooled text embedding), 2 layers."""
    import diffusers  # only these four need it (a GPU box may lack it)

    model: Any = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
    )  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(BATCH, 4, 8, 8),
        "encoder_hidden_states": torch.randn(BATCH, 6, 32),
        "pooled_projections": torch.randn(BATCH, 32),
        "timestep": torch.tensor([500.0] * BATCH),
    }
    return model.eval(), inputs, sample


def flux_2l() -> tuple[Any, ...]:
    """diffusers Flux transformer (3-axis RoPE, one double-stream and one single-stream block),
    2 layers."""
    import diffusers  # only these four need it (a GPU box may lack it)

    model: Any = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    image, text = 16, 6  # a 4x4 grid of packed latent patches, 6 text tokens
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    img_ids = torch.stack([torch.zeros(image), rows.flatten(), cols.flatten()], dim=-1)
    inputs = {
        "hidden_states": torch.randn(BATCH, image, 16),
        "encoder_hidden_states": torch.randn(BATCH, text, 32),
        "pooled_projections": torch.randn(BATCH, 32),
        "timestep": torch.tensor([0.5] * BATCH),  # Flux scales it by 1000 itself
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
    }
    return model.eval(), inputs, sample


ARCHITECTURES: dict[str, tuple[Factory, int]] = {
    "gpt2-12l": (gpt2_12l, 12),
    "bert-12l": (bert_12l, 12),
    "qwen2-12l": (qwen2_12l, 12),
    "opt-12l": (opt_12l, 12),
    "mistral-2l": (mistral_2l, 2),
    "gemma2-2l": (gemma2_2l, 2),
    "bart-4l": (bart_4l, 4),
    "whisper-encoder-2l": (whisper_encoder_2l, 2),
    "autoencoderkl-2l": (autoencoder_kl_2l, 2),
    "dit-2l": (dit_2l, 2),
    "sd3-2l": (sd3_2l, 2),
    "flux-2l": (flux_2l, 2),
}


def torch_encoder_48l() -> tuple[Any, ...]:
    """torch's own ``nn.TransformerEncoder`` (post-LayerNorm, ReLU: its defaults, the
    encoder of Lightning's validation-loop case), 48 layers."""
    layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 48, enable_nested_tensor=False).eval()
    return model, {"src": torch.randn(BATCH, TOKENS, 64)}, encoded


def encoded(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs)


#: Healthy models 48 layers deep: the yardstick must hold at any depth.
DEEP: dict[str, tuple[Factory, int]] = {
    "bert-48l": (bert_48l, 48),
    "llama-48l": (llama_48l, 48),
    "torch-encoder-48l": (torch_encoder_48l, 48),
}
