"""The recipe as data: a Recipe's optimizer, clipping, micro-batches and loss scaling reach
a training step and a fit; a case, a fix and the old shorthands (``fit_lr``, ``optimizer=``,
``grad_scaler=False``) name one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure.authoring.case import Case, RunContext, Workload, fix
from harness.measure.authoring.model_targets import ModelCheckError, recipe_for
from harness.measure.authoring.recipes import (
    DEFAULT_RECIPE,
    Recipe,
    RecipeError,
    adamw,
    mode_scaler,
)
from harness.measure.precision.modes import Precision
from harness.measure.running.fitting import fit
from harness.measure.running.training import train_step
from harness.plugin import MARK, check_model
from harness.results import storage
from tests.conftest import FIXTURES, only_run_dir

CPU = torch.device("cpu")


def sgd(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


class Plain(Case):
    name = "plain"

    @fix("none", rationale="upstream")
    def none(self, w: Workload, ctx: RunContext) -> Any:
        return w.model

    @fix("sgd", rationale="its own optimizer", optimizer=sgd)
    def own_optimizer(self, w: Workload, ctx: RunContext) -> Any:
        return w.model

    @fix("unscaled", rationale="trains without a GradScaler", grad_scaler=False)
    def unscaled(self, w: Workload, ctx: RunContext) -> Any:
        return w.model

    @fix("clipped", rationale="its own recipe", recipe=Recipe(sgd, 0.5, clip_norm=1.0))
    def clipped(self, w: Workload, ctx: RunContext) -> Any:
        return w.model


class SlowPlain(Plain):
    name = "slow-plain"
    fit_lr = 1e-4


class Named(Plain):
    name = "named"
    recipe = Recipe(lr=3e-4, accumulation=2)


def test_the_default_recipe_is_adamw_at_1e3_without_weight_decay() -> None:
    optimizer = DEFAULT_RECIPE.make_optimizer([torch.zeros(2, requires_grad=True)])
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["foreach"]) == (1e-3, 0.0, False)
    assert (DEFAULT_RECIPE.clip_norm, DEFAULT_RECIPE.accumulation) == (None, 1)


def test_fit_lr_a_fixs_optimizer_and_grad_scaler_map_onto_a_recipe() -> None:
    plain, slow, named = Plain(), SlowPlain(), Named()
    assert plain.recipe_of("none") == DEFAULT_RECIPE
    assert slow.recipe_of("none") == Recipe(lr=1e-4)
    assert slow.recipe_of("sgd") == Recipe(sgd, 1e-4)
    assert plain.recipe_of("unscaled").scalers == ("none",)
    assert named.recipe_of("none") == Recipe(lr=3e-4, accumulation=2)  # the case's wins
    assert named.recipe_of("clipped") == Recipe(sgd, 0.5, clip_norm=1.0)  # the fix's wins


def test_a_recipe_with_its_shorthands_is_refused() -> None:
    with pytest.raises(TypeError, match="give it alone"):
        fix("x", rationale="", recipe=Recipe(), optimizer=sgd)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"lr": 0.0}, "lr must be a positive number"),
        ({"clip_norm": -1.0}, "clip_norm must be a positive number"),
        ({"accumulation": 0}, "accumulation must be a whole number"),
        ({"scalers": ("loose",)}, "scalers: 'loose' is not one of none, dynamic, static"),
    ],
)
def test_a_malformed_recipe_is_one_line(given: dict[str, Any], named: str) -> None:
    with pytest.raises(RecipeError, match=named):
        Recipe(**given)


def test_the_modes_scaler_and_the_controls() -> None:
    assert mode_scaler("float16", "autocast") == "dynamic"
    assert mode_scaler("float16", "half") == mode_scaler("float16", "half-autocast") == "dynamic"
    assert mode_scaler("bfloat16", "autocast") == mode_scaler("float32", "fp32") == "none"
    both = Recipe(scalers=("none", "dynamic"))
    assert both.scalers_for("float16", "autocast") == ("none", "dynamic")
    assert both.scalers_for("float32", "fp32") == ("none",)  # the control is plain
    assert both.scalers_for("float16", "autocast", managed_by_case=True) == ("none",)


def linear(dtype: torch.dtype) -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(8, 8).to(dtype), torch.randn(16, 8).to(dtype)


def test_a_step_clips_its_gradients_as_torch_does() -> None:
    model, x = linear(torch.float64)
    precision = Precision(CPU, torch.float64, "half")
    step = train_step(lambda: model(x), lambda out: out.pow(2).sum(), model, precision,
                      Recipe(clip_norm=0.1))  # fmt: skip
    clipped = {n: g.clone() for n, g in step.leaves.items() if n.startswith("grad.")}
    model.zero_grad()
    model(x).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=False)
    assert float(total) > 0.1  # the clip took
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.equal(clipped[f"grad.{name}"], param.grad)


def test_accumulation_runs_each_micro_batch_and_averages_their_loss() -> None:
    model, x = linear(torch.float64)
    calls: list[int] = []

    def forward() -> torch.Tensor:
        calls.append(1)
        return model(x)

    precision = Precision(CPU, torch.float64, "half")
    one = train_step(forward, lambda out: out.pow(2).mean(), model, precision)
    four = train_step(forward, lambda out: out.pow(2).mean(), model, precision,
                      Recipe(accumulation=4))  # fmt: skip
    assert len(calls) == 1 + 4
    for name, value in one.leaves.items():
        torch.testing.assert_close(four.leaves[name], value, rtol=1e-12, atol=0.0)


def test_half_weights_scaled_as_their_mode_scales_keep_gradients_that_underflow_unscaled() -> None:
    """The output's gradient, 1e-8, is 0 in float16 (its smallest subnormal is 6e-8), so the
    bias's (16 rows of it, 1.6e-7) is lost unscaled; the float16 ``half`` mode's own scaler
    (dynamic, held by the harness: a GradScaler refuses to unscale float16 gradients) and a
    static 2**16 keep it."""
    model, x = linear(torch.float16)
    precision = Precision(CPU, torch.float16, "half")

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.float().sum() * 1e-8

    unscaled = train_step(lambda: model(x), loss, model, precision, scaler="none")
    by_mode = train_step(lambda: model(x), loss, model, precision)
    static = train_step(lambda: model(x), loss, model, precision, Recipe(scalers=("static",)),
                        scaler="static")  # fmt: skip
    assert not unscaled.leaves["grad.bias"].any()
    assert static.leaves["grad.bias"].abs().min() > 0
    assert torch.allclose(by_mode.leaves["grad.bias"].double(), torch.full((8,), 16e-8,
                          dtype=torch.float64), rtol=1e-3)  # fmt: skip
    assert by_mode.note is None


def test_a_half_weights_dynamic_scale_backs_off_until_its_gradients_are_finite() -> None:
    """An output whose gradient is 4, scaled by 2**16, overflows float16 (65504): the held
    scale halves until it does not, and the note says which scales it skipped, as a
    GradScaler's does."""
    model, x = linear(torch.float16)
    step = train_step(lambda: model(x), lambda out: out.sum() * 4, model,
                      Precision(CPU, torch.float16, "half"))  # fmt: skip
    assert step.note is not None and step.note.text.startswith("the dynamic loss scale skipped")
    assert "; the step ran at scale " in step.note.text
    assert torch.equal(step.leaves["grad.bias"], torch.full((8,), 64.0))  # 16 rows of 4


def test_a_static_scale_that_overflows_skips_the_fits_steps_and_never_moves() -> None:
    model, x = linear(torch.float32)
    run = fit(lambda: model(x), lambda out: out.float().pow(2).sum(), model,
              Precision(CPU, torch.float16, "autocast"),
              Recipe(sgd, 1e-3, static_scale=2.0**40), scaler="static", steps=3)  # fmt: skip
    assert (run.skipped_steps, run.final_scale) == (3, 2.0**40)
    assert run.losses[0] == run.losses[-1]
    assert run.note is not None and run.note.text.startswith(
        "the static loss scale (1.09951e+12) skipped 3 of 3 step(s) of the fit"
    )


def test_a_fit_runs_its_recipes_optimizer_and_clip() -> None:
    """SGD at lr 1 with the gradient clipped to 1e-3 moves the weights by 1e-3 at most per
    step; unclipped the same step moves them further."""
    model, x = linear(torch.float32)
    start = model.weight.detach().clone()
    precision = Precision(CPU, torch.float32, "fp32")
    fit(lambda: model(x), lambda out: out.pow(2).sum(), model, precision,
        Recipe(sgd, 1.0, clip_norm=1e-3), steps=1)  # fmt: skip
    moved = float((model.weight.detach() - start).norm())
    assert 0 < moved <= 1e-3 * (1 + 1e-5)
    model, x = linear(torch.float32)
    fit(lambda: model(x), lambda out: out.pow(2).sum(), model, precision, Recipe(sgd, 1.0),
        steps=1)  # fmt: skip
    assert float((model.weight.detach() - start).norm()) > 1e-2


def test_adamw_is_the_default_optimizer_factory() -> None:
    assert Recipe().optimizer is adamw


def check(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness check fit_model:build --stage fit`` from the fixtures folder, as
    a user runs it: bfloat16 half weights on the CPU, no timing."""
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", "fit_model:build", "--stage", "fit",
         "--device", "cpu", "--dtype", "bfloat16", "--mode", "half", "--no-timing",
         "--fit-steps", "2", "-n", "0", "--out", str(out), *args],
        cwd=FIXTURES, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_check_trains_with_the_recipe_it_names(tmp_path: Path) -> None:
    result = check(tmp_path, "--recipe", "fit_recipes:announced")
    assert result.returncode != 2, result.stderr
    fits = [r for r in storage.read_records(only_run_dir(tmp_path)) if r.cell.stage == "fit"]
    assert [r.cell.mode for r in fits] == ["half"]
    for record in fits:  # the cell's and the float64 reference's fit both built it
        assert "the recipe's own optimizer was built, lr 0.25" in (record.error_message or "")


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("fit_recipes:nope", "--recipe fit_recipes:nope: fit_recipes has no recipe 'nope'"),
        ("fit_recipes:not_a_recipe", "--recipe fit_recipes:not_a_recipe is dict, not a Recipe "
         "(harness.measure.authoring.recipes.Recipe)"),
        ("fit_recipes", "--recipe 'fit_recipes': expected MODULE:NAME, e.g. "
         "myrecipes:clipped_adamw"),
    ],
)  # fmt: skip
def test_a_bad_recipe_name_is_one_line(tmp_path: Path, spec: str, said: str) -> None:
    result = check(tmp_path, "--recipe", spec)
    assert result.returncode != 0
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_plugin_refuses_what_is_not_a_recipe_and_a_recipe_with_no_training() -> None:
    with pytest.raises(ModelCheckError, match="is dict, not a Recipe"):
        check_model(recipe={"lr": 0.1}, stages=("fit",))
    with pytest.raises(ModelCheckError, match=r"the recipe .* no stage trains"):
        check_model(recipe=Recipe(), stages=("forward",))
    test = check_model(recipe=Recipe(lr=0.5), stages=("fit",))(lambda: None)
    assert getattr(test, MARK).recipe == Recipe(lr=0.5)


def test_a_recipe_entry_applies_to_its_factory_first() -> None:
    entries = ("m:plain", "build=m:own")
    assert recipe_for("models:build", entries) == "m:own"
    assert recipe_for("models:other", entries) == "m:plain"
    with pytest.raises(ModelCheckError, match="two recipes, --recipe m:a and --recipe m:b"):
        recipe_for("models:build", ("m:a", "m:b"))


def test_a_half_weights_step_not_finite_at_any_held_scale_is_judged_not_raised() -> None:
    """Its gradients are read in float32, and the step's own float16 ones are left on the
    weights (a float32 gradient cannot be assigned to a float16 weight)."""
    model, x = linear(torch.float16)
    step = train_step(lambda: model(x), lambda out: out.exp().sum() * 1e30, model,
                      Precision(CPU, torch.float16, "half"))  # fmt: skip
    assert step.note is not None and "skipped every step it tried (24)" in step.note.text
    assert not torch.isfinite(step.leaves["grad.bias"]).all()
    assert model.bias.grad is not None and model.bias.grad.dtype == torch.float16
