"""Environments aggregated, so a report grows with what differs, not with cells.

A nightly measures the same cells in dozens of environments (torch releases x hosts x
devices), and a cell usually has the same outcome in most of them. The report shows each
cell once per distinct outcome, with the environments that had it named compactly
(``torch 2.1.2-2.6.0 · H100 80GB HBM3 (sm90) · host-a, host-b``, with an en dash), and the numbers
measured there as a median with their range, so nothing measured is dropped: it is
summarised, and where the outcome differs between environments, every variant is a row of
its own."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.results.search import release_key
from harness.schema.axes import CONTROL_FIX, DTYPES, MODE_NAMES, STAGES, rank
from harness.schema.releases import torch_release

#: What makes two measurements the same cell in different environments.
CELL_KEY = ("row", "dtype", "mode", "size")
#: What must be equal for two environments to share a row: the outcome as shown.
VARIANT = ("label", "skip_reason", "out_dtype", "attn_dtype")
#: Between the ends of a range (of releases, of values): an en dash.
DASH = "\u2013"
#: A list of environments longer than this is folded into a ``<details>``.
SHORT_TEXT = 90


@dataclass(frozen=True)
class Environment:
    label: str
    release: str
    device: str
    host: str


def place_device(env: Any) -> str:
    """The device an environment is named by: its GPU's name where the frame has it
    (``H100 80GB HBM3 (sm90)``), so an A100's and an H100's ``cuda:0`` are two places."""
    label = getattr(env, "device_label", None)
    return str(label) if isinstance(label, str) and label else str(env.device)


class Environments:
    """Names sets of environments compactly, against the environments a case ran in."""

    def __init__(self, frame: pd.DataFrame) -> None:
        envs = frame.drop_duplicates("env") if "env" in frame else pd.DataFrame()
        self.known = {
            e.env: Environment(
                e.env, torch_release(e.torch_version), place_device(e), e.host or ""
            )
            for e in envs.itertuples()
        }
        releases = sorted({e.release for e in self.known.values()}, key=release_key)
        self.order = {release: i for i, release in enumerate(releases)}
        #: Each environment's place in a sorted list: device, host, release.
        self.sort_keys = {
            label: (env.device, env.host, self.order.get(env.release, -1))
            for label, env in self.known.items()
        }
        #: The releases measured per place, by universe (a case's environments: one a case).
        self.measured: dict[frozenset[str], dict[tuple[str, str], list[str]]] = {}

    def describe(self, labels: Iterable[str], universe: Iterable[str]) -> EnvironmentSet:
        """``labels`` as ``torch 2.1.2-2.4.1, 2.6.0 · cpu · host-a``; a range a-b is every
        release measured from a to b on that device and host (the ``universe``)."""
        # a column's values as a list first: iterating a pandas column is slow, item by item
        given = set(labels.tolist() if isinstance(labels, pd.Series) else labels)
        chosen = sorted(given, key=self.sort_keys.__getitem__)
        everywhere = frozenset(universe)
        if len(chosen) == 1:
            return EnvironmentSet(chosen, chosen[0], chosen[0])
        if everywhere not in self.measured:
            self.measured[everywhere] = self._releases_by_place(everywhere)
        measured = self.measured[everywhere]
        by_place: dict[tuple[str, str], list[str]] = defaultdict(list)
        for label in chosen:
            env = self.known[label]
            by_place[env.device, env.host].append(env.release)
        # places measured in the same releases share one line, their hosts listed
        lines: dict[tuple[str, str], list[str]] = defaultdict(list)
        for (device, host), releases in by_place.items():
            spans = self._spans(releases, measured[device, host])
            lines[spans, device].append(host)
        text = "; ".join(
            f"torch {spans} · {device}"
            + (f" · {', '.join(h for h in hosts if h)}" if any(hosts) else "")
            for (spans, device), hosts in lines.items()
        )
        short = f"all {len(chosen)} environments" if set(chosen) == everywhere else None
        return EnvironmentSet(chosen, short or f"{len(chosen)} environments", text)

    def _releases_by_place(self, labels: Iterable[str]) -> dict[tuple[str, str], list[str]]:
        places: dict[tuple[str, str], list[str]] = defaultdict(list)
        for label in sorted(labels, key=self.sort_keys.__getitem__):
            env = self.known[label]
            places[env.device, env.host].append(env.release)
        return places

    @staticmethod
    def _spans(releases: Sequence[str], measured: Sequence[str]) -> str:
        """Consecutive runs of ``measured`` as ``first-last``, the rest one by one."""
        index = {release: i for i, release in enumerate(measured)}
        positions = sorted(index[r] for r in set(releases))
        runs: list[list[int]] = []
        for position in positions:
            if runs and position == runs[-1][-1] + 1:
                runs[-1].append(position)
            else:
                runs.append([position])
        return ", ".join(
            measured[run[0]] if len(run) == 1 else f"{measured[run[0]]}{DASH}{measured[run[-1]]}"
            for run in runs
        )


@dataclass(frozen=True)
class EnvironmentSet:
    """Environments as a report names them: ``summary`` short, ``text`` in full."""

    labels: list[str]
    summary: str
    text: str

    @property
    def folded(self) -> bool:
        """Too long to show inline: shown as its summary, unfolded on a click."""
        return len(self.text) > SHORT_TEXT

    @property
    def count(self) -> int:
        return len(self.labels)


Formatter = Callable[[Any], str]


def spread(median: Any, low: Any, high: Any, show: Formatter) -> str:
    """One value, or the median and the range of a value measured in several environments
    (``1.20e-03 (9.8e-04-2.1e-03)``), so the summary row keeps what was measured."""
    if pd.isna(median):
        return ""
    if low == high:
        return show(low)
    return f"{show(median)} ({show(low)}{DASH}{show(high)})"


def key_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in CELL_KEY if c in frame.columns]


def cell_key_order(key: tuple[Any, ...], rows: dict[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """Rows in the order ``rows`` gives them (the upstream path ``none`` first, a fix's
    stages together: :func:`row_sort_keys`), then dtypes and modes in axis order."""
    row, dtype, mode, *rest = key
    return (rows.get(row, (True, row)), rank(DTYPES, dtype), rank(MODE_NAMES, mode), *rest)


def row_sort_keys(frame: pd.DataFrame) -> dict[str, tuple[Any, ...]]:
    """Each row label's place: ``none`` first, then fixes by name, each fix's stages in axis
    order (forward, train, fit) after each other."""
    columns = [c for c in ("row", "fix", "base_row", "stage") if c in frame]
    found = frame[columns].drop_duplicates("row")
    return {
        str(r["row"]): (
            r["fix"] != CONTROL_FIX,
            r.get("base_row", r["row"]),
            rank(STAGES, r.get("stage", STAGES[0])),
        )
        for r in found.to_dict("records")
    }


def filled(frame: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """``frame`` with missing text in ``columns`` as ``""``: a group of its own when grouped."""
    return frame.assign(**{c: frame[c].fillna("") for c in columns if frame[c].dtype == object})


def grouped(
    frame: pd.DataFrame, by: Sequence[str]
) -> Iterable[tuple[tuple[Any, ...], pd.DataFrame]]:
    """``frame.groupby(by)`` with missing values as a group of their own, keys as tuples."""
    for key, group in filled(frame, by).groupby(list(by), sort=False, dropna=False):
        yield (key if isinstance(key, tuple) else (key,)), group
