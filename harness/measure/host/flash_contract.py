"""A stand-in for flash-attn's ``flash_attn_func`` where flash-attn is not installed.

flash-attn is CUDA-only and cannot be installed on a machine without a GPU. This module does
NOT run the real kernel: :func:`flash_attn_contract_func` enforces the input contract that
flash-attn 2 checks before launching its kernel (``mha_fwd`` in
``csrc/flash_attn/flash_api.cpp``, Dao-AILab/flash-attention), raising ``RuntimeError`` with
flash-attn's own messages, and then computes the attention with
``torch.nn.functional.scaled_dot_product_attention``. A result obtained through it comes from
the contract, not from the real kernel, and must be reported as such.

Checks, in flash-attn's order (after the Python wrapper's ``maybe_contiguous``):

- q dtype is fp16 or bf16: ``FlashAttention only support fp16 and bf16 data type``;
  on CUDA, bf16 needs sm80+: ``bfloat16 is only supported on Ampere GPUs or newer``;
- k and v dtypes equal q's: ``query and key must have the same dtype`` /
  ``query and value must have the same dtype``;
- device: the real kernel requires CUDA (``q must be on CUDA``). That one check is lifted,
  since standing in on the CPU is this module's purpose; k and v must be on q's device;
- last dimension contiguous: ``Input tensor must have contiguous last dimension``;
- batch size positive, head dimension at most 256, heads of k/v dividing heads of q,
  and k/v shapes consistent with q.

The real kernels (flash-attn 2, or flash-attn 4 on sm90+) are in
:mod:`harness.measure.host.flash_kernels`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: flash-attn 2's largest supported head dimension (forward).
MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """flash-attn's TORCH_CHECK: a RuntimeError with the kernel's own message."""
    if not condition:
        raise RuntimeError(message)


def _maybe_contiguous(x: torch.Tensor) -> torch.Tensor:
    """What flash_attn_interface does before calling the kernel."""
    return x.contiguous() if x.stride(-1) != 1 else x


def _check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in FLASH_DTYPES, "FlashAttention only support fp16 and bf16 data type")
    if q.dtype == torch.bfloat16 and q.is_cuda:
        major, _ = torch.cuda.get_device_capability(q.device)
        _check(major >= 8, "bfloat16 is only supported on Ampere GPUs or newer")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")


def _check_devices_and_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(k.device == q.device, "k must be on the same device as q (contract stand-in)")
    _check(v.device == q.device, "v must be on the same device as q (contract stand-in)")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "q, k, v must be (B, L, H, D)")
    batch, _, heads, head_dim = q.shape
    _, seqlen_k, heads_k, _ = k.shape
    _check(batch > 0, "batch size must be positive")
    _check(
        head_dim <= MAX_HEAD_DIM, "FlashAttention forward only supports head dimension at most 256"
    )
    _check(
        heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query"
    )
    expected_kv = (batch, seqlen_k, heads_k, head_dim)
    _check(
        tuple(k.shape) == expected_kv,
        "k must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)",
    )
    _check(
        tuple(v.shape) == expected_kv,
        "v must have shape (batch_size, seqlen_k, num_heads_k, head_size_og)",
    )


def check_flash_attn_contract(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise RuntimeError, with flash-attn's message, where the real kernel would refuse."""
    _check_dtypes(q, k, v)
    _check_devices_and_layout(q, k, v)
    _check_shapes(q, k, v)


def _bottom_right_causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """flash-attn >= 2.1 aligns the causal mask to the bottom-right corner."""
    ones = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    return ones.tril(diagonal=seqlen_k - seqlen_q)


def _sdpa_blhd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, scale: float, causal: bool
) -> torch.Tensor:
    """SDPA on flash-attn's (B, L, H, D) layout; returns (B, L, H, D), contiguous."""
    groups = q.shape[2] // k.shape[2]
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    if groups > 1:
        k_, v_ = k_.repeat_interleave(groups, dim=1), v_.repeat_interleave(groups, dim=1)
    mask = _bottom_right_causal_mask(q.shape[1], k.shape[1], q.device) if causal else None
    out = F.scaled_dot_product_attention(
        q_, k_, v_, attn_mask=mask, dropout_p=dropout_p, scale=scale
    )
    return out.transpose(1, 2).contiguous()


def flash_attn_contract_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """``flash_attn_func``'s signature and (B, L, H, D) layout: contract checks, then SDPA."""
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    check_flash_attn_contract(q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _sdpa_blhd(q, k, v, dropout_p, scale, causal)
