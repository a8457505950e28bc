"""The searching bisect: which release changed each cell's outcome, measuring few releases."""

from __future__ import annotations

import pytest

from harness.results.search import ReleaseSearch, search_order
from harness.schema.axes import Cell

RELEASES = tuple(f"2.{minor}.0" for minor in range(1, 15))  # 14 releases, as in the noxfile
A = Cell("case", "none", "cpu", "float16", "half", "eager")
B = Cell("case", "fix", "cpu", "float16", "half", "eager")
C = Cell("case", "other", "cpu", "bfloat16", "half", "eager")


def truth(changes_at: dict[Cell, int]) -> dict[str, dict[Cell, str]]:
    """Every release's outcomes: a cell raises before its change index and passes from it."""
    return {
        release: {cell: "passes" if i >= at else "raises:repro" for cell, at in changes_at.items()}
        for i, release in enumerate(RELEASES)
    }


def run_search(outcomes: dict[str, dict[Cell, str]]) -> tuple[ReleaseSearch, list[str]]:
    search = ReleaseSearch(RELEASES)
    probed = []
    while (release := search.next_release()) is not None:
        assert release not in probed, "a release is never measured twice"
        probed.append(release)
        search.add(release, outcomes[release])
    return search, probed


@pytest.mark.parametrize("at", range(1, 14))
def test_one_change_is_found_in_a_logarithmic_number_of_releases(at: int) -> None:
    search, probed = run_search(truth({A: at}))
    (change,) = search.changes()
    assert (change.last_old, change.first_new) == (RELEASES[at - 1], RELEASES[at])
    assert (change.old, change.new) == ("raises:repro", "passes")
    assert len(probed) <= 2 + 4  # both ends, then at most ceil(log2(13)) middles


def test_cells_changing_at_different_releases_share_their_first_probes() -> None:
    search, probed = run_search(truth({A: 3, B: 3, C: 10}))
    found = {c.cell: (c.last_old, c.first_new) for c in search.changes()}
    assert found == {
        A: (RELEASES[2], RELEASES[3]),
        B: (RELEASES[2], RELEASES[3]),
        C: (RELEASES[9], RELEASES[10]),
    }
    assert len(probed) < len(RELEASES) - 4


def test_a_cell_changing_twice_is_found_at_both_changes() -> None:
    """As the Lightning cases: another error on 2.1-2.2 (no torch.backends.mha), the known
    error from 2.3, fixed in 2.6. Both change points are found, as the sweep shows them."""
    outcomes = truth({A: 5})
    for release in RELEASES[:2]:
        outcomes[release][A] = "raises:OTHER"
    search, probed = run_search(outcomes)
    found = [(c.old, c.new, c.last_old, c.first_new) for c in search.changes()]
    assert found == [
        ("raises:OTHER", "raises:repro", RELEASES[1], RELEASES[2]),
        ("raises:repro", "passes", RELEASES[4], RELEASES[5]),
    ]
    assert len(probed) < len(RELEASES)


def test_a_change_that_comes_back_between_measured_releases_is_invisible() -> None:
    outcomes = truth({A: 0})
    outcomes[RELEASES[4]][A] = "passes[drift]"  # only in one release in the middle
    search, probed = run_search(outcomes)
    assert search.changes() == [] and probed == [RELEASES[0], RELEASES[-1]]


def test_no_change_between_the_ends_measures_only_the_ends() -> None:
    search, probed = run_search(truth({A: 0}))
    assert probed == [RELEASES[0], RELEASES[-1]]
    assert search.changes() == [] and search.unchanged() == [A]
    assert "no outcome changes" in search.render()


@pytest.mark.parametrize("runs_from", [1, 3, 6])
def test_a_cell_that_cannot_run_on_old_releases_is_searched_from_where_it_runs(
    runs_from: int,
) -> None:
    """As Dia's case on torch < 2.4 (no nn.RMSNorm): skipped first, then the known error,
    then fixed. The search finds where it starts to run, then the outcome change after it."""
    outcomes = truth({A: 9, B: 0})
    for release in RELEASES[:runs_from]:
        outcomes[release][A] = "skipped"
        del outcomes[release][B]  # absent (not run) rather than skipped: the same
    search, probed = run_search(outcomes)
    found = {c.cell: (c.old, c.new, c.last_old, c.first_new) for c in search.changes()}
    assert found == {A: ("raises:repro", "passes", RELEASES[8], RELEASES[9])}
    assert search.unchanged() == [B]  # it passes wherever it runs
    starts = {(c.cell, c.first_new) for c in search.changes(running=True)}
    assert starts == {(A, RELEASES[runs_from]), (B, RELEASES[runs_from])}
    assert "2 cells run only from (or until) torch" in search.render()
    assert len(probed) <= 2 + 4 + 4


def test_bad_release_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="at least two"):
        ReleaseSearch(("2.4.1",))
    with pytest.raises(ValueError, match="twice"):
        ReleaseSearch(("2.4.1", "2.4.1"))
    with pytest.raises(ValueError, match="not among"):
        ReleaseSearch(RELEASES).add("1.13.1", {})


def test_releases_sort_by_number_not_text() -> None:
    assert search_order(["2.13.0", "2.4.1", "2.10.0", "2.1.2"]) == (
        "2.1.2",
        "2.4.1",
        "2.10.0",
        "2.13.0",
    )
