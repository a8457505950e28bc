"""This process and what it runs on: torch's global settings and their restore
(``torch_state``), the devices and GPUs learned without starting CUDA here (``cuda_facts``,
``environment``), flash-attn's kernels and its contract stand-in (``flash_kernels``,
``flash_contract``), SIGINT held off a fork (``forking``), and every process-global cache
with its one reset (``caches``).

May import: no other part of ``harness.measure``.
"""
