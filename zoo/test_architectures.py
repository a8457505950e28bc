"""More real architectures (``zoo/architectures.py``: GPT-2, BERT, Qwen2 and OPT 12 layers
deep; Mistral, Gemma 2, BART, Whisper's encoder, diffusers' VAE, DiT, SD3 and Flux
transformers), each checked as a user checks a model: ``@check_model`` on its factory, in
the forward pass and one training step."""

from __future__ import annotations

from harness import check_model
from zoo import STAGES
from zoo.architectures import ARCHITECTURES

for _name, (_factory, _layers) in ARCHITECTURES.items():
    _check = check_model(modes=("autocast", "half"), stages=STAGES)
    globals()[f"test_{_name.replace('-', '_')}"] = _check(_factory)
