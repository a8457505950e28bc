"""``check`` against a plain script that computes the same errors (``nox -s bench``).

Both run as a user runs them, each in a fresh interpreter, alternated so drift hits both
alike. The plain script builds the model, and for float16 and bfloat16 under autocast and
cast to the dtype, and the float32 control, computes the relative error against the same
model in float64: the five figures ``check`` gives (without its trail, flags and files).

On the CPU the model is a small attention block; where a GPU is visible, also 14 small
transformers and timm models on ``cuda`` (``benchmarks/gpu_models.py``), in one ``check``
against one plain script over the same models.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"cpu": 1.25, "cuda": 2.0}

BLOCK = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        h = self.norm(x)
        return self.proj(self.attn(h, h, h, need_weights=False)[0]) + x


def block():
    return Block().eval(), {"x": torch.randn(2, 16, 64)}
"""

PLAIN = """
import copy, sys
import torch
import {module} as models

device = sys.argv[1]
kind = device.split(":")[0]
for name in sys.argv[2:]:
    torch.manual_seed(0)
    built = getattr(models, name)()
    model, inputs = built[0], built[1]
    forward = built[2] if len(built) > 2 else lambda m, i: m(**i)

    def run(model, cast_to=None, autocast_dtype=None):
        moved = {{k: v.to(device) for k, v in inputs.items()}}
        if cast_to is not None:
            moved = {{k: v.to(cast_to) if v.is_floating_point() else v for k, v in moved.items()}}
        enabled = autocast_dtype is not None
        with torch.no_grad(), torch.autocast(kind, dtype=autocast_dtype, enabled=enabled):
            return forward(model, moved)

    reference = run(copy.deepcopy(model).double().to(device), torch.float64)

    def error(out):
        return ((out.double() - reference).norm() / reference.norm()).item()

    base = model.to(device)
    for dtype in (torch.float16, torch.bfloat16):
        print(name, dtype, "autocast", error(run(base, autocast_dtype=dtype)))
        print(name, dtype, "half", error(run(copy.deepcopy(base).to(dtype), dtype)))
    print(name, "float32", error(run(base)))
"""


#: The same, for one training step: the loss (mean squared error against a fixed random
#: target, as ``check`` takes by default) and every parameter's gradient against float64,
#: float16 under autocast with a GradScaler, the half modes unscaled.
PLAIN_TRAIN = """
import copy, sys
import torch
import torch.nn.functional as F
import {module} as models

device = sys.argv[1]
kind = device.split(":")[0]
for name in sys.argv[2:]:
    torch.manual_seed(0)
    model, inputs = getattr(models, name)()[:2]
    target = None

    def step(model, cast_to=None, autocast_dtype=None):
        global target
        moved = {{k: v.to(device) for k, v in inputs.items()}}
        if cast_to is not None:
            moved = {{k: v.to(cast_to) if v.is_floating_point() else v for k, v in moved.items()}}
        enabled = autocast_dtype is not None
        with torch.autocast(kind, dtype=autocast_dtype, enabled=enabled):
            out = model(**moved)
            if target is None:
                target = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234),
                                     dtype=torch.float64)
            loss = F.mse_loss(out, target.to(device=out.device, dtype=out.dtype))
        params = [p for p in model.parameters() if p.requires_grad]
        if autocast_dtype == torch.float16:
            scaler = torch.amp.GradScaler(kind)
            optimizer = torch.optim.SGD(params, lr=0.0)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        return [p.grad.double() for p in params]

    reference = step(copy.deepcopy(model).double().to(device), torch.float64)

    def error(grads):
        return max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference))

    base = model.to(device)
    for dtype in (torch.float16, torch.bfloat16):
        print(name, dtype, "autocast", error(step(copy.deepcopy(base), autocast_dtype=dtype)))
        print(name, dtype, "half", error(step(copy.deepcopy(base).to(dtype), dtype)))
    print(name, "float32", error(step(copy.deepcopy(base))))
"""


def timed(command: Sequence[str], cwd: Path) -> float:
    """Wall seconds of ``command``, with the project importable (as an install makes it)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def side_by_side(
    folder: Path,
    module: str,
    factories: list[str],
    device: str,
    rounds: int,
    stage: str = "forward",
) -> tuple[float, float]:
    """Median seconds of ``check`` and of the plain script, alternated ``rounds`` times, for
    ``stage`` (a forward pass, or one training step)."""
    script = PLAIN_TRAIN if stage == "train" else PLAIN
    (folder / "plain.py").write_text(script.format(module=module))
    targets = [f"{module}:{name}" for name in factories]
    check = [sys.executable, "-m", "harness", "check", *targets, "--device", device]
    check += ["--no-timing", "--stage", stage, "--out", str(folder / "results")]
    plain = [sys.executable, "plain.py", device, *factories]
    times: dict[str, list[float]] = {"check": [], "plain": []}
    for _ in range(rounds):
        times["check"].append(timed(check, folder))
        times["plain"].append(timed(plain, folder))
    return statistics.median(times["check"]), statistics.median(times["plain"])


def report(what: str, device: str, check_s: float, plain_s: float) -> None:
    """One line: both medians, their ratio against the target, and the machine's load
    average as the pair ended (the ratio is fair beside other work, the seconds are not)."""
    ratio, target = check_s / plain_s, TARGETS[device.split(":")[0]]
    verdict = "PASS" if ratio <= target else "MISS"
    print(
        f"check of {what} on {device}: {check_s:.2f} s, plain script {plain_s:.2f} s: "
        f"{ratio:.2f}x (target <= {target}x) {verdict} (load average {load_average()})",
        flush=True,
    )


def load_average() -> str:
    """The 1-minute load average, or ``n/a`` where the system gives none."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "n/a"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "mymodels.py").write_text(BLOCK)
        check_s, plain_s = side_by_side(folder, "mymodels", ["block"], "cpu", args.rounds)
        report("one small model (an attention block)", "cpu", check_s, plain_s)
        check_s, plain_s = side_by_side(
            folder, "mymodels", ["block"], "cpu", args.rounds, stage="train"
        )
        report("a training step of the same model", "cpu", check_s, plain_s)
        if gpu_visible():
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from gpu_models import MODELS

            (folder / "gpu_models.py").write_text((ROOT / "benchmarks/gpu_models.py").read_text())
            names = list(MODELS)
            check_s, plain_s = side_by_side(folder, "gpu_models", names, "cuda", args.rounds)
            report(f"{len(names)} small transformers and timm models", "cuda", check_s, plain_s)
    return 0


def gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
