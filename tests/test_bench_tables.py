"""bench.tables: a run updates the rows (or sections) of its kind's table, the rest stay."""
from bench.tables import Run, by_check, read_sections, read_table, update_sections, update_table

H200 = "NVIDIA H200, torch 2.11.0"
FIRST = Run("2026-12-01", H200, "python -m bench.check_step")
LATER = Run("2026-12-03", H200, "python -m bench.check_step --checks lr")
COLUMNS = ("check", "result", "detail")


def test_a_run_replaces_the_rows_of_its_keys_and_keeps_the_others_with_their_run(tmp_path):
    path = tmp_path / "checks.md"
    first = [{"check": "lr", "result": "PASS", "detail": "0 differ"},
             {"check": "dropout", "result": "PASS", "detail": "a | b"}]
    update_table(path, title="t", intro="i", columns=COLUMNS, key=("check",), rows=first,
                 run=FIRST, order=by_check)
    update_table(path, title="t", intro="i", columns=COLUMNS, key=("check",), run=LATER,
                 rows=[{"check": "lr", "result": "FAIL", "detail": None}], order=by_check)
    columns, rows = read_table(path)
    assert columns == list(COLUMNS)
    assert rows == [({"check": "dropout", "result": "PASS", "detail": "a | b"}, FIRST),
                    ({"check": "lr", "result": "FAIL", "detail": "-"}, LATER)]
    text = path.read_text()
    assert "| dropout | PASS | a \\| b | 2026-12-01 | 1 |" in text
    assert "| lr | FAIL | - | 2026-12-03 | 2 |" in text
    assert text.rstrip().endswith("2. 2026-12-03, NVIDIA H200, torch 2.11.0: "
                                  "`python -m bench.check_step --checks lr`")
    # a run no row comes from any more is not listed
    update_table(path, title="t", intro="i", columns=COLUMNS, key=("check",), run=LATER,
                 rows=[{"check": "dropout", "result": "PASS", "detail": "again"}])
    assert "2026-12-01" not in path.read_text()


def test_a_column_a_later_run_adds_shows_a_dash_in_older_rows(tmp_path):
    path = tmp_path / "held.md"
    update_table(path, title="t", intro="i", columns=("config", "MiB"), key=("config",),
                 rows=[{"config": "a", "MiB": "1.0"}], run=FIRST)
    update_table(path, title="t", intro="i", columns=("config", "MiB", "peaks"), key=("config",),
                 rows=[{"config": "b", "MiB": "2.0", "peaks": "3, 4"}], run=LATER)
    columns, rows = read_table(path)
    assert columns == ["config", "MiB", "peaks"]
    assert [row for row, _ in rows] == [{"config": "a", "MiB": "1.0", "peaks": "-"},
                                        {"config": "b", "MiB": "2.0", "peaks": "3, 4"}]


def test_sections_are_replaced_by_key_each_with_its_date_and_run(tmp_path):
    path = tmp_path / "memory.md"
    update_sections(path, title="t", intro="i", run=FIRST,
                    sections=[("gpt erase+step", "pools 1262 MiB\n\n| a |"), ("ctr x", "one")])
    update_sections(path, title="t", intro="i", run=LATER,
                    sections=[("gpt erase+step", "pools 974 MiB"), ("vit y", "two")])
    assert read_sections(path) == [("gpt erase+step", "pools 974 MiB", LATER),
                                   ("ctr x", "one", FIRST), ("vit y", "two", LATER)]
    assert "## ctr x\n\n_2026-12-01, run 1_\n\none" in path.read_text()
