"""The one column formatter every CLI view prints with."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmserve.textfmt import columns


def test_columns_align_and_strip_trailing_spaces() -> None:
    text = columns([["NAME", "GPUS", "NOTE"], ["llama-7b", "0,1", ""], ["m", "2", "x"]])
    assert text.split("\n") == ["NAME      GPUS  NOTE", "llama-7b  0,1", "m         2     x"]


def test_no_rows_is_empty() -> None:
    assert columns([]) == ""


def test_a_ragged_row_is_refused_with_the_row() -> None:
    with pytest.raises(ValueError, match=r"2 cells, the header has 3: \['a', 'b'\]"):
        columns([["A", "B", "C"], ["a", "b"]])


cell = st.text(alphabet="abcxyz0123-,.", max_size=6)


@given(
    st.integers(1, 4).flatmap(
        lambda n: st.lists(st.lists(cell, min_size=n, max_size=n), min_size=1, max_size=5)
    )
)
def test_every_column_starts_at_the_same_offset(rows: list[list[str]]) -> None:
    lines = columns(rows).split("\n")
    assert len(lines) == len(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r, line in zip(rows, lines, strict=True):
        assert line == line.rstrip()
        start = 0
        for c, w in zip(r, widths, strict=True):
            assert line[start : start + len(c)] == c
            start += w + 2


def test_right_aligned_columns_end_at_the_same_offset() -> None:
    text = columns([["predictor", "avg", "n"], ["warm *", "1.50%", "12"], ["csp", "12.00%", "3"]],
                   right=range(1, 3))
    assert text.split("\n") == [
        "predictor     avg   n",
        "warm *      1.50%  12",
        "csp        12.00%   3",
    ]


@given(
    st.integers(1, 4).flatmap(
        lambda n: st.lists(st.lists(cell, min_size=n, max_size=n), min_size=1, max_size=5)
    ),
    st.sets(st.integers(0, 3)),
)
def test_right_aligned_cells_end_where_their_column_ends(
    rows: list[list[str]], right: set[int]
) -> None:
    lines = columns(rows, right=right).split("\n")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r, line in zip(rows, lines, strict=True):
        start = 0
        for i, (c, w) in enumerate(zip(r, widths, strict=True)):
            at = start + w - len(c) if i in right else start
            assert line[at : at + len(c)] == c
            start += w + 2
