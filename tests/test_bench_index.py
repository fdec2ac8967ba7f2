"""data/bench/README.md indexes every stored result, and something outside data/bench/ cites each one."""
import functools
import re

from labkit.bench.index import BENCH, build, entries

built = functools.cache(lambda: build(with_git=False))


def indexed() -> dict[str, str]:
    """{entry name: its row} from the index's table."""
    rows = {}
    for line in (BENCH / "README.md").read_text().splitlines():
        m = re.match(r"\| `([^`/ ]+)", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_the_index_lists_every_entry_and_nothing_else():
    names, rows = set(entries()), indexed()
    assert names == set(rows), (f"not indexed: {sorted(names - set(rows))}; gone: {sorted(set(rows) - names)}: "
                                "run python -m labkit.bench.index")


def test_every_entry_is_cited_by_a_page_a_notebook_a_test_or_the_code():
    uncited = [e.name for e in built() if not e.cited_by]
    assert not uncited, (f"nothing cites {uncited}: cite them where they are read, or remove them (git keeps "
                         "them), then run python -m labkit.bench.index")


def test_the_citations_in_the_index_are_current():
    rows = indexed()
    stale = [e.name for e in built() if e.cited_by and f"`{e.cited_by[0]}`" not in rows[e.name]]
    assert not stale, f"the index's citations of {stale} are out of date: run python -m labkit.bench.index"
