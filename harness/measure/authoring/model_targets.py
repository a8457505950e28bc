"""What a ``check`` names, parsed and checked before any model is built: its targets
(``MODULE:FACTORY``) and the case name of each, the ``--keep-fp32``, ``--loss`` and
``--recipe`` entries that apply to each target, and the one-line error
(:class:`ModelCheckError`) for what is wrong with them. Importing and building the models is
:mod:`harness.measure.authoring.model_case`'s.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

#: How a factory and a loss function are named, as a one-line error shows them.
FACTORY_FORM = "MODULE:FACTORY, e.g. models:build_block"
LOSS_FORM = "MODULE:FUNC, e.g. mylosses:token_loss"
RECIPE_FORM = "MODULE:NAME, e.g. myrecipes:clipped_adamw"


class ModelCheckError(ValueError):
    """A factory or target that cannot be checked, said in one line."""


def case_name(text: str) -> str:
    """A case name from a function or module name: ``test_T5_block`` -> ``test-t5-block``."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not name:
        raise ModelCheckError(f"{text!r} gives no usable case name")
    return name


def split_target(target: str, form: str = FACTORY_FORM) -> tuple[str, str]:
    """``MODULE:FACTORY`` (or a loss's ``MODULE:FUNC``: ``form``) as its two parts, or a
    ``ModelCheckError`` saying what is wrong."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ModelCheckError(f"{target!r}: expected {form}")
    return module_name, attribute


def target_names(targets: Sequence[str]) -> dict[str, str]:
    """The case name of each target: its factory's name (``models:build_block`` ->
    ``build-block``), or, where two targets' factories share a name, the module's and the
    factory's (``dup_a:build`` -> ``dup-a-build``), so no two models share a cell id. Two
    targets that would still share a name are a ``ModelCheckError``."""
    unique = list(dict.fromkeys(targets))
    short = {target: case_name(split_target(target)[1]) for target in unique}
    counts = Counter(short.values())
    names = {
        target: name if counts[name] == 1 else case_name(target.replace(":", "-"))
        for target, name in short.items()
    }
    by_name: dict[str, str] = {}
    for target, name in names.items():
        if name in by_name:
            raise ModelCheckError(
                f"{by_name[name]} and {target} would both be checked as {name!r}: "
                "rename one factory"
            )
        by_name[name] = target
    return names


def keep_for(target: str, keep_fp32: tuple[str, ...]) -> tuple[str, ...]:
    """The ``--keep-fp32`` names that apply to ``target``: ``NAME`` applies to every target,
    ``FACTORY=NAME`` to that factory's model only."""
    factory = split_target(target)[1]
    kept = []
    for entry in keep_fp32:
        owner, _, name = entry.rpartition("=")
        if not owner or owner == factory:
            kept.append(name)
    return tuple(kept)


def loss_for(target: str, losses: Sequence[str]) -> str:
    """The ``--loss`` that applies to ``target`` (empty: none): ``FACTORY=MODULE:FUNC``
    for that factory's model, else a plain ``MODULE:FUNC``, which applies to every
    target; two that apply alike are a ``ModelCheckError``."""
    return entry_for(target, losses, "--loss", "losses")


def recipe_for(target: str, recipes: Sequence[str]) -> str:
    """The ``--recipe`` that applies to ``target`` (empty: the default recipe), as
    :func:`loss_for` picks a loss: ``FACTORY=MODULE:NAME`` before ``MODULE:NAME``."""
    return entry_for(target, recipes, "--recipe", "recipes")


def entry_for(target: str, entries: Sequence[str], flag: str, what: str) -> str:
    """The entry of ``flag`` that applies to ``target``: its factory's own, else a plain
    one; two that apply alike are a ``ModelCheckError``."""
    factory = split_target(target)[1]
    own = [spec for owner, spec in map(loss_owner, entries) if owner == factory]
    every = [spec for owner, spec in map(loss_owner, entries) if not owner]
    chosen = own or every
    if len(set(chosen)) > 1:
        raise ModelCheckError(f"{target}: two {what}, {flag} {f' and {flag} '.join(chosen)}")
    return chosen[0] if chosen else ""


def loss_owner(entry: str) -> tuple[str, str]:
    """``FACTORY=MODULE:FUNC`` as its factory and its loss; ``MODULE:FUNC`` has no factory."""
    owner, equals, spec = entry.partition("=")
    return (owner, spec) if equals else ("", entry)


def check_loss_entries(
    targets: Sequence[str], losses: Sequence[str], flag: str = "--loss", form: str = LOSS_FORM
) -> None:
    """A ``--loss`` (or ``--recipe``: ``flag``) that names nothing, or a
    ``FACTORY=MODULE:FUNC`` whose factory no target names, is a ``ModelCheckError``
    (either would train on the default unseen)."""
    factories = {split_target(target)[1] for target in targets}
    for entry in losses:
        owner, spec = loss_owner(entry)
        if not spec:
            raise ModelCheckError(f"{flag} {entry!r}: expected {form}")
        if owner and owner not in factories:
            raise ModelCheckError(
                f"{flag} {entry}: no target's factory is named {owner!r} "
                f"(targets: {', '.join(targets)})"
            )
