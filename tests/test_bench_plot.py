"""The bench figure and the docs tables from synthetic bench JSON (nothing is timed): the first
panel gives times faster / less memory than the naive path (higher is better) for both dtypes,
the floor panel the tables' own yardsticks, legends sit outside the data, the caption names every
method drawn, the repeats' spread is drawn, single-point sweeps are not, a run cut by its
deadline says so, and such a run leaves docs/benchmarks.md alone unless asked."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from astrai_kernels.bench.plot import build_figure, plot, summary_rows
from astrai_kernels.bench.report import add_ratios, deadline_note, format_table

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def logits_result(op, method, vocab, dtype="fp32", seconds=0.1, peak_over_s=1.0, rows=4096,
                  times=None, paired=None):
    s = rows * vocab * (4 if dtype == "fp32" else 2)
    result = {"op": op, "method": method, "rows": rows, "vocab": vocab, "dtype": dtype,
              "device": "cpu", "hidden": 0, "repeats": 3, "median_s": seconds,
              "times_s": times or [seconds] * 3, "logits_bytes": s, "floor_bytes": 2 * s,
              "copy_s": 0.02, "peak_extra_bytes": int(peak_over_s * s)}
    if paired:  # the copies timed right after each call
        result["paired_copy_s"] = paired
    return result


def linear_result(method, seconds, peak_bytes, vocab=8192):
    return {"op": "linear_cross_entropy", "method": method, "rows": 2048, "hidden": 1024,
            "vocab": vocab, "dtype": "fp32", "device": "cpu", "repeats": 1, "median_s": seconds,
            "logits_bytes": 2048 * vocab * 4, "floor_flops": 1e11, "grad_bytes": 64 * MIB,
            "peak_bound_bytes": 200 * MIB, "peak_extra_bytes": peak_bytes}


def payload(skipped=0):
    """token_logprobs swept over two V in fp32 (a curve, its calls spread), once in bf16 and
    cross_entropy once (no curve each), linear_cross_entropy once with torch's own op;
    ``skipped`` cases left by the deadline."""
    results = [logits_result("token_logprobs", "naive", v, seconds=0.8, peak_over_s=3.0,
                             times=[0.7, 0.8, 0.9]) for v in (8192, 32768)]
    results += [logits_result("token_logprobs", "cpp", v, seconds=0.04,
                              times=[0.035, 0.04, 0.05], paired=[0.02, 0.025, 0.02])
                for v in (8192, 32768)]
    results += [logits_result("token_logprobs", "cpp:inplace", 32768, seconds=0.03,
                              peak_over_s=0.0),
                logits_result("token_logprobs", "naive", 32768, "bf16", 0.9, 6.0),
                logits_result("token_logprobs", "cpp", 32768, "bf16", 0.05),
                logits_result("cross_entropy", "naive", 32768, seconds=0.9, peak_over_s=3.0),
                logits_result("cross_entropy", "compile", 32768, seconds=0.3, peak_over_s=1.0),
                logits_result("cross_entropy", "cpp", 32768, seconds=0.05),
                linear_result("gemm", 0.5, 0), linear_result("naive", 0.6, 256 * MIB),
                linear_result("torch_lce", 0.66, 256 * MIB),
                linear_result("cpp", 0.55, 96 * MIB)]
    add_ratios(results)
    return {"machine": {"cpu": "Test CPU 9000", "cores": 2, "torch": "2.x",
                        "loadavg_at_start": [0.5, 0.5, 0.5]},
            "results": results,
            "skipped": [{"op": "cross_entropy", "method": "cpp", "vocab": 8192}] * skipped,
            "planned_cases": len(results) + skipped, "cut_by_deadline": bool(skipped),
            "complete": True}


def test_summary_rows_say_how_many_times_faster_and_smaller_per_dtype():
    rows = summary_rows(payload()["results"])
    assert [(r["op"], r["dtype"]) for r in rows] == [
        ("token_logprobs", "fp32"), ("token_logprobs", "bf16"), ("cross_entropy", "fp32"),
        ("linear_cross_entropy", "fp32")]
    token, token_bf16, cross, linear = rows
    assert token["method"] == "cpp" and token["shape"] == "N=4096, V=32768"  # the largest V
    # the naive path's time over the kernel's, and its extremes from the calls' spread
    assert token["faster"]["naive"] == pytest.approx((0.8 / 0.04, 0.7 / 0.05, 0.9 / 0.035))
    assert token["less_memory"]["naive"] == pytest.approx((3.0, 3.0, 3.0))
    assert token_bf16["less_memory"]["naive"] == pytest.approx((6.0, 6.0, 6.0))
    assert set(cross["faster"]) == {"naive", "compile"}
    assert cross["faster"]["compile"][0] == pytest.approx(0.3 / 0.05)
    assert set(linear["faster"]) == {"naive", "torch_lce"}  # PyTorch's own fused op
    assert linear["faster"]["torch_lce"][0] == pytest.approx(0.66 / 0.55)
    assert linear["less_memory"]["naive"][0] == pytest.approx(256 / 96)
    # each call over the copies right after it: the median of 1.75, 1.6, 2.5 and its extremes
    assert token["time_over_floor"] == pytest.approx((0.035 / 0.02, 0.04 / 0.025, 0.05 / 0.02))
    assert linear["time_over_floor"][0] == pytest.approx(0.55 / 0.5)


def test_the_floor_panel_uses_the_tables_yardsticks():
    """peak memory over its bound is the printed table's peak/S (logits ops) and /bound (the
    fused head), not peak over the gradients (issue 44: linear_distill 4.20x against the
    table's /bound 1.00)."""
    results = payload()["results"]
    table = format_table(results)
    by_op = {row["op"]: row for row in summary_rows(results) if row["dtype"] == "fp32"}
    linear = by_op["linear_cross_entropy"]
    assert linear["bound"] == "bound" and linear["memory_over_bound"] == pytest.approx(96 / 200)
    line = next(x for x in table.splitlines()
                if re.match(r"linear_cross_entropy +cpp ", x))
    assert line.split()[-1] == f"{linear['memory_over_bound']:.2f}"  # the /bound column
    assert line.split()[-6] == f"{linear['time_over_floor'][0]:.2f}"  # the x gemm column
    token = by_op["token_logprobs"]
    line = next(x for x in table.splitlines()
                if re.match(r"token_logprobs +cpp +fp32 +4096 +32768 ", x))
    assert token["bound"] == "S" and line.split()[-1] == f"{token['memory_over_bound']:.2f}"
    assert line.split()[8] == f"{token['time_over_floor'][0]:.2f}"  # the x floor column


def _texts(artist):
    return [t.get_text() for t in artist.findobj(lambda a: hasattr(a, "get_text"))]


def test_figure_reads_at_a_glance():
    from matplotlib.collections import LineCollection, PolyCollection

    fig = build_figure(payload())
    try:
        versus, floor, detail, caption = fig.subfigs
        title = fig.get_suptitle()
        assert "\n" not in title and "Test CPU 9000" in title  # one line
        ax_time, ax_memory = versus.axes
        assert ax_time.get_title() == "times faster (higher is better)"
        assert ax_memory.get_title() == "times less peak memory (higher is better)"
        assert ax_time.get_xscale() == "log"
        labels = [t.get_text().split("\n")[0] for t in ax_time.get_yticklabels()]
        assert labels == ["token_logprobs fp32", "token_logprobs bf16", "cross_entropy fp32",
                          "linear_cross_entropy fp32"]
        assert "20.0x" in _texts(ax_time) and "2.67x" in _texts(ax_memory)
        # the spread of the repeats: whiskers on the bars, a band around each curve
        assert ax_time.findobj(LineCollection)
        ax_curve_time = detail.axes[0]
        assert ax_curve_time.findobj(PolyCollection)
        floor_time, floor_memory = floor.axes
        assert "0.48x" in _texts(floor_memory) and "1.00x" in _texts(floor_memory)
        # legends outside the data: none on an axes, none over one
        assert all(ax.get_legend() is None for ax in fig.axes)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [legend for sub in fig.subfigs for legend in sub.legends]
        assert len(legends) == 2
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
        assert [t.get_text() for t in legends[0].get_texts()] == [
            "vs the naive path", "vs torch.compile of the naive path",
            "vs PyTorch's F.linear_cross_entropy"]
        # every method drawn is named in the caption, and what it is
        text = caption.texts[0].get_text()
        methods = {r["method"] for r in payload()["results"]}
        for name in methods | {"copy floor", "logits size S", "bound"}:
            assert re.search(rf"^{re.escape(name)}: ", text, re.M), name
        # one curve (token_logprobs fp32 over two V); the single-V groups are counted
        assert [ax.get_title() for ax in detail.axes] == [
            "token_logprobs fp32, N=4096: time", "token_logprobs fp32, N=4096: memory"]
        assert "3 (op, dtype, shape) group(s) measured at one V only" in text
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_run_cut_by_its_deadline_says_so_in_red(tmp_path):
    cut = payload(skipped=4)
    assert deadline_note(cut) == f"cut by deadline: 4 of {len(cut['results']) + 4} cases skipped"
    fig = build_figure(cut)
    try:
        assert fig.get_suptitle().startswith(deadline_note(cut))
        assert "\n" not in fig.get_suptitle()
        assert fig._suptitle.get_color() == "red"
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    png = tmp_path / "bench.png"
    assert plot(cut, str(png)) == str(png) and png.stat().st_size > 10_000


def load_doc_tables():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "bench" / "doc_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_tables_write_a_cut_run_only_with_partial(tmp_path, capsys):
    doc_tables = load_doc_tables()
    doc, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    readme_original = (ROOT / "README.md").read_text()
    doc.write_text(original)
    readme.write_text(readme_original)
    bench_json = tmp_path / "bench.json"
    cut = payload(skipped=4)
    bench_json.write_text(json.dumps(cut))
    doc_tables.main([str(bench_json), "--write", str(doc), "--readme", str(readme)])
    assert doc.read_text() == original and readme.read_text() == readme_original
    assert "left as they were" in capsys.readouterr().err
    doc_tables.main([str(bench_json), "--write", str(doc), "--readme", str(readme),
                     "--partial", "--commit", "abc1234"])
    written = doc.read_text()
    assert written != original
    assert f"**Partial run: {deadline_note(cut)}; these tables miss those cases.**" in written
    assert "| cross_entropy | N=4096, V=32768 | fp32 | cpp | 50.0 |" in written
    readme_written = readme.read_text()
    assert f"**Partial run: {deadline_note(cut)}; these tables miss those cases.**" \
        in readme_written
    assert "| `cross_entropy` | N=4096, V=32768 | fp32 | 2.50x | 0.06x | 0.17x | 3.00, 1.00 |" \
        in readme_written
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {doc} and {readme} from {bench_json}: measured on Test CPU "
                           f"9000 (2 cores; SIMD flags not recorded), torch 2.x, commit abc1234")


def test_doc_tables_write_a_complete_run_without_a_note(tmp_path):
    doc_tables = load_doc_tables()
    doc = tmp_path / "benchmarks.md"
    doc.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps(payload()))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    written = doc.read_text()
    assert "| cross_entropy | N=4096, V=32768 | fp32 | cpp | 50.0 |" in written
    assert "Partial run" not in written


def test_doc_tables_refuse_a_run_stopped_before_its_end(tmp_path, capsys):
    doc_tables = load_doc_tables()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"{doc_tables.BEGIN}\nold\n{doc_tables.END}\n")
    before = doc.read_text()
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps({**payload(), "complete": False}))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    assert doc.read_text() == before
    assert "stopped before its end" in capsys.readouterr().err
