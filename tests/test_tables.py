"""The one result-table formatter (``minispec.lab.text_table``), used by bench, tune, profile and demo."""

from minispec.lab.text_table import Col, text_table


def test_columns_widen_to_fit_and_align():
    lines = text_table([Col("method", width=8, left=True), Col("tau", ".2f", 5), Col("note", left=True)],
                       [["eagle2@5/8/32", 2.5, "ok"], ["vanilla", None, ""]], indent="  ")
    assert lines == ["  method          tau note",
                     "  eagle2@5/8/32  2.50 ok",
                     "  vanilla           -"]  # None prints '-', trailing blanks are cut


def test_bench_table_goes_through_it():
    from minispec.lab.bench import format_table

    summ = dict(tokens_per_s=12.345, speedup=None, vs_vanilla=1.5, tau=None, acceptance_by_position=[0.5, 0.25],
                identical=3, n=4)
    text = format_table(dict(settings=dict(methods=["eagle"]), summary={"eagle": summ}, by_category={}))
    header, row = text.splitlines()
    assert header.split()[:3] == ["category", "method", "tok/s"]
    assert row.split() == ["ALL", "eagle", "12.3", "-", "1.50x", "-", "3/4", "0.50", "0.25"]
