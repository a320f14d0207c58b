"""The bench figure and the docs tables from synthetic bench JSON (nothing is timed): the summary
panel leads, single-point sweeps are not drawn, a run cut by its deadline says so, and such a run
leaves docs/benchmarks.md alone unless asked."""

import importlib.util
import json
from pathlib import Path

import pytest

from astrai_kernels.bench.plot import build_figure, plot, summary_rows
from astrai_kernels.bench.report import add_ratios, deadline_note

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def logits_result(op, method, vocab, dtype="fp32", seconds=0.1, peak_over_s=1.0, rows=4096):
    s = rows * vocab * (4 if dtype == "fp32" else 2)
    return {"op": op, "method": method, "rows": rows, "vocab": vocab, "dtype": dtype,
            "device": "cpu", "hidden": 0, "repeats": 3, "median_s": seconds,
            "logits_bytes": s, "floor_bytes": 2 * s, "copy_s": 0.02,
            "peak_extra_bytes": int(peak_over_s * s)}


def linear_result(method, seconds, peak_bytes, vocab=8192):
    return {"op": "linear_cross_entropy", "method": method, "rows": 2048, "hidden": 1024,
            "vocab": vocab, "dtype": "fp32", "device": "cpu", "repeats": 1, "median_s": seconds,
            "logits_bytes": 2048 * vocab * 4, "floor_flops": 1e11, "grad_bytes": 64 * MIB,
            "peak_bound_bytes": 200 * MIB, "peak_extra_bytes": peak_bytes}


def payload(skipped=0):
    """token_logprobs swept over two V in fp32 (a curve), once in bf16 and cross_entropy once
    (no curve each), linear_cross_entropy once; ``skipped`` cases left by the deadline."""
    results = [logits_result("token_logprobs", "naive", v, seconds=0.8, peak_over_s=3.0)
               for v in (8192, 32768)]
    results += [logits_result("token_logprobs", "cpp", v, seconds=0.04) for v in (8192, 32768)]
    results += [logits_result("token_logprobs", "cpp:inplace", 32768, seconds=0.03,
                              peak_over_s=0.0),
                logits_result("token_logprobs", "naive", 32768, "bf16", 0.9, 6.0),
                logits_result("token_logprobs", "cpp", 32768, "bf16", 0.05),
                logits_result("cross_entropy", "naive", 32768, seconds=0.9, peak_over_s=3.0),
                logits_result("cross_entropy", "cpp", 32768, seconds=0.05),
                linear_result("gemm", 0.5, 0), linear_result("naive", 0.6, 256 * MIB),
                linear_result("cpp", 0.55, 96 * MIB)]
    add_ratios(results)
    return {"machine": {"cpu": "Test CPU 9000", "cores": 2, "torch": "2.x",
                        "loadavg_at_start": [0.5, 0.5, 0.5]},
            "results": results,
            "skipped": [{"op": "cross_entropy", "method": "cpp", "vocab": 8192}] * skipped,
            "planned_cases": len(results) + skipped, "cut_by_deadline": bool(skipped),
            "complete": True}


def test_summary_rows_hold_the_kernel_against_naive_and_floor():
    dtype, rows = summary_rows(payload()["results"])
    assert dtype == "fp32"  # every op ran fp32, only token_logprobs bf16
    assert [r["op"] for r in rows] == ["token_logprobs", "cross_entropy", "linear_cross_entropy"]
    token, _, linear = rows
    assert token["method"] == "cpp" and token["shape"] == "N=4096, V=32768"  # the largest V
    assert token["time / naive"] == pytest.approx(0.04 / 0.8)
    assert token["time / floor"] == pytest.approx(0.04 / 0.02)  # copy_s scaled by 2 S / 2 S
    assert token["peak memory / naive"] == pytest.approx(1 / 3, rel=1e-6)
    assert token["peak memory / floor"] == pytest.approx(1.0)
    assert linear["shape"] == "N=2048, H=1024, V=8192"
    assert linear["time / floor"] == pytest.approx(0.55 / 0.5)
    assert linear["peak memory / naive"] == pytest.approx(96 / 256)
    assert linear["peak memory / floor"] == pytest.approx(96 / 64)


def test_figure_leads_with_the_summary_and_draws_only_real_curves():
    fig = build_figure(payload())
    try:
        summary = fig.axes[0]
        title = summary.get_title()
        assert "fp32" in title and "Test CPU 9000" in title
        assert "N=4096, V=32768 (token_logprobs, cross_entropy)" in title
        assert "N=2048, H=1024, V=8192 (linear_cross_entropy)" in title
        assert summary.get_xscale() == "log" and "naive path" in summary.get_xlabel()
        labels = [t.get_text() for t in summary.get_yticklabels()]
        assert [label.split(" (")[0] for label in labels] == [
            "token_logprobs", "cross_entropy", "linear_cross_entropy"]
        legend = [t.get_text() for t in summary.get_legend().get_texts()]
        assert legend == ["time / naive", "time / floor", "peak memory / naive",
                          "peak memory / floor"]
        # one curve (token_logprobs fp32 over two V): two detail panels; the single-V groups
        # (token_logprobs bf16, cross_entropy, linear_cross_entropy) are counted, not drawn
        assert len(fig.axes) == 3
        assert [ax.get_title() for ax in fig.axes[1:]] == ["token_logprobs fp32, N=4096"] * 2
        assert fig.get_supxlabel().startswith("3 (op, dtype, shape) group(s)")
        assert fig.get_suptitle() == ""  # every case ran
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_run_cut_by_its_deadline_says_so_in_red(tmp_path):
    cut = payload(skipped=4)
    assert deadline_note(cut) == f"cut by deadline: 4 of {len(cut['results']) + 4} cases skipped"
    fig = build_figure(cut)
    try:
        assert fig.get_suptitle().startswith(deadline_note(cut))
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
    doc = tmp_path / "benchmarks.md"
    original = (ROOT / "docs" / "benchmarks.md").read_text()
    doc.write_text(original)
    bench_json = tmp_path / "bench.json"
    cut = payload(skipped=4)
    bench_json.write_text(json.dumps(cut))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    assert doc.read_text() == original
    assert "left as it was" in capsys.readouterr().err
    doc_tables.main([str(bench_json), "--write", str(doc), "--partial"])
    written = doc.read_text()
    assert written != original
    assert f"**Partial run: {deadline_note(cut)}; these tables miss those cases.**" in written
    assert "| cross_entropy | N=4096, V=32768 | fp32 | cpp | 50.0 |" in written


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
    doc.write_text("<!-- BEGIN tables written by bench/doc_tables.py from one `make bench` run -->"
                   "\nold\n<!-- END tables written by bench/doc_tables.py -->\n")
    before = doc.read_text()
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(json.dumps({**payload(), "complete": False}))
    doc_tables.main([str(bench_json), "--write", str(doc)])
    assert doc.read_text() == before
    assert "stopped before its end" in capsys.readouterr().err
