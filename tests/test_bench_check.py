"""``astrai-kernels bench --check``: the comparison logic, with a fake clock (nothing is timed),
the bounds file kept in the repository, and the same-run copy floor's rule (at a tiny shape)."""

import os
import pathlib
import statistics

import pytest

from astrai_kernels import cli
from astrai_kernels.bench import check, measure
from astrai_kernels.bench.cases import FLOOR_FACTOR, LOGITS_OPS, Case
from astrai_kernels.bench.report import add_ratios

S = 4096 * 32768 * 4  # the logits' bytes of the fp32 cases below


def fake_result(case, seconds, copy_s=None):
    """What ``measure`` returns for ``case`` when its call takes ``seconds`` on the fake clock."""
    result = {"op": case.op, "method": case.method, "rows": case.rows, "vocab": case.vocab,
              "dtype": case.dtype, "device": case.device, "hidden": case.hidden,
              "median_s": seconds, "peak_extra_bytes": 0}
    if case.op in LOGITS_OPS:
        factor = FLOOR_FACTOR[case.op]
        result.update(logits_bytes=S, floor_bytes=factor * S, copy_s=copy_s,
                      clone_s=copy_s * 1.5 if copy_s else None)
    else:
        result.update(logits_bytes=S, floor_flops=1.0, grad_bytes=1, peak_bound_bytes=1)
    return result


class FakeClock:
    """Seconds per (op, method, dtype); the copy of the logits ops takes ``copy_s``."""

    def __init__(self, seconds, copy_s=0.1, fail=()):
        self.seconds, self.copy_s, self.fail, self.ran = seconds, copy_s, set(fail), []

    def __call__(self, case):
        self.ran.append(case)
        if (case.op, case.method) in self.fail:
            return {"op": case.op, "method": case.method, "rows": case.rows,
                    "vocab": case.vocab, "dtype": case.dtype, "error": "boom"}
        return fake_result(case, self.seconds[(case.op, case.method, case.dtype)],
                           self.copy_s if case.op in LOGITS_OPS else None)


BOUNDS = """
[machine]
class = "test machine"

[[case]]
op = "token_logprobs"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "copy"
max_ratio = 2.5

[[case]]
op = "cross_entropy"
method = "cpp"
dtype = "bf16"
rows = 4096
vocab = 32768
against = "naive"
max_ratio = 0.5

[[case]]
op = "linear_cross_entropy"
method = "cpp"
dtype = "fp32"
rows = 2048
hidden = 1024
vocab = 32768
against = "gemm"
max_ratio = 1.0
"""


# Fake-clock seconds with every case of BOUNDS within its bound: token_logprobs 0.2 s over a 2 S
# floor of 0.1 s (the copy moves 2 S): 2.0x; cross_entropy 0.2 / 0.5 naive: 0.4x; linear 0.9x
WITHIN = {("token_logprobs", "cpp", "fp32"): 0.2, ("cross_entropy", "cpp", "bf16"): 0.2,
          ("cross_entropy", "naive", "bf16"): 0.5,
          ("linear_cross_entropy", "cpp", "fp32"): 9.0,
          ("linear_cross_entropy", "gemm", "fp32"): 10.0}


@pytest.fixture
def bounds_file(tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text(BOUNDS)
    return str(path)


def run(bounds_file, clock, capsys):
    code = check.run_check(bounds_file, clock)
    return code, capsys.readouterr().out


def test_all_within_bounds(bounds_file, capsys):
    clock = FakeClock(dict(WITHIN))
    code, out = run(bounds_file, clock, capsys)
    assert code == 0, out
    assert "3 ok, 0 over, 0 failed" in out
    assert "2.00x <= 2.50x" in out and "0.400x <= 0.500x" in out and "0.900x <= 1.00x" in out
    assert "bounds set on: test machine" in out
    # each case once, each with its same-run baseline
    assert [(c.op, c.method) for c in clock.ran] == [
        ("token_logprobs", "cpp"), ("cross_entropy", "cpp"), ("cross_entropy", "naive"),
        ("linear_cross_entropy", "cpp"), ("linear_cross_entropy", "gemm")]
    assert clock.ran[3].hidden == 1024


@pytest.mark.parametrize("slow", ["token_logprobs", "cross_entropy", "linear_cross_entropy"])
def test_one_case_over_fails(bounds_file, capsys, slow):
    seconds = dict(WITHIN)
    dtype = "bf16" if slow == "cross_entropy" else "fp32"
    seconds[(slow, "cpp", dtype)] *= 1.3
    code, out = run(bounds_file, FakeClock(seconds), capsys)
    assert code == 1
    assert "2 ok, 1 over, 0 failed" in out
    over = [line for line in out.splitlines() if line.lstrip().startswith("over")]
    assert len(over) == 1 and slow in over[0]


def test_exactly_at_bound_is_ok(bounds_file, capsys):
    seconds = dict(WITHIN)
    seconds[("token_logprobs", "cpp", "fp32")] = 0.25
    seconds[("cross_entropy", "cpp", "bf16")] = 0.25
    seconds[("linear_cross_entropy", "cpp", "fp32")] = 10.0
    clock = FakeClock(seconds)
    code, out = run(bounds_file, clock, capsys)
    assert code == 0, out


def test_failed_case_or_baseline_fails_the_check(bounds_file, capsys):
    clock = FakeClock(dict(WITHIN), fail={("cross_entropy", "naive"),
                                     ("token_logprobs", "cpp")})
    code, out = run(bounds_file, clock, capsys)
    assert code == 1
    assert "1 ok, 0 over, 2 failed" in out
    assert "failed: boom" in out and "baseline naive failed: boom" in out


@pytest.mark.parametrize("change, message", [
    ('op = "token_logprobs"', "op must be one of"),
    ('method = "cpp"', "method must be a backend"),
    ('against = "copy"', "is measured against one of"),
    ("max_ratio = 2.5", "max_ratio must be a positive number"),
    ("rows = 4096", "unknown keys ['row']"),
])
def test_bad_bounds_are_named(tmp_path, change, message):
    replacement = {'op = "token_logprobs"': 'op = "token_logprob"',
                   'method = "cpp"': 'method = "cuda"', 'against = "copy"': 'against = "gemm"',
                   "max_ratio = 2.5": "max_ratio = -1", "rows = 4096": "row = 4096"}[change]
    path = tmp_path / "bounds.toml"
    path.write_text(BOUNDS.replace(change, replacement, 1))
    with pytest.raises(check.BoundsError, match="case 1: .*" + message.replace("[", r"\[")
                       .replace("]", r"\]")):
        check.load_bounds(str(path))


def test_cli_reports_a_bad_bounds_file(tmp_path, capsys):
    path = tmp_path / "bounds.toml"
    path.write_text("[machine]\nclass = 'x'\n")
    assert cli.main(["bench", "--check", "--bounds", str(path)]) == 2
    assert "no [[case]] entries" in capsys.readouterr().err


def test_repository_bounds_file_parses():
    machine, bounds = check.load_bounds(check.default_bounds_path())
    assert machine != "unstated" and bounds
    labels = [b.label() for b in bounds]
    assert len(set(labels)) == len(labels), "a case is bounded twice"
    assert os.path.basename(check.default_bounds_path()) == "bounds.toml"


class RoundsClock(FakeClock):
    """A clock whose token_logprobs case is slow in its first round only (a busy machine)."""

    def __init__(self, seconds, first_round_s):
        super().__init__(seconds)
        self.first_round_s = first_round_s
        self.calls = 0

    def __call__(self, case):
        if case.op == "token_logprobs" and case.method == "cpp":
            self.calls += 1
            if self.calls == 1:
                return fake_result(case, self.first_round_s, self.copy_s)
        return super().__call__(case)


def test_rounds_keep_each_case_best(bounds_file, capsys):
    clock = RoundsClock(dict(WITHIN), first_round_s=0.5)  # 5.0x in round 1, 2.0x in round 2
    code = check.run_check(bounds_file, clock, rounds=2)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "best of 2: 2.00-5.00x" in out


def test_one_round_reports_the_slow_case(bounds_file, capsys):
    clock = RoundsClock(dict(WITHIN), first_round_s=0.5)
    code = check.run_check(bounds_file, clock, rounds=1)
    assert code == 1 and "over  token_logprobs" in capsys.readouterr().out


def test_a_regression_in_every_round_is_over(bounds_file, capsys):
    slow = dict(WITHIN)
    slow[("token_logprobs", "cpp", "fp32")] = 0.4
    code = check.run_check(bounds_file, FakeClock(slow), rounds=3)
    out = capsys.readouterr().out
    assert code == 1 and "best of 3: 4.00-4.00x" in out


def test_rounds_must_be_a_positive_int(bounds_file):
    with pytest.raises(check.BoundsError, match="rounds must be an int >= 1"):
        check.run_check(bounds_file, FakeClock(dict(WITHIN)), rounds=0)


WITHOUT_MACHINE = BOUNDS.replace('[machine]\nclass = "test machine"\n', "", 1)
# (bounds file, the key its one-line error must name): wrong types and values of every key
MALFORMED = {
    "rows string": (BOUNDS.replace("rows = 4096", 'rows = "abc"', 1), "rows"),
    "rows array": (BOUNDS.replace("rows = 4096", "rows = [8]", 1), "rows"),
    "rows negative": (BOUNDS.replace("rows = 4096", "rows = -8", 1), "rows"),
    "rows float": (BOUNDS.replace("rows = 4096", "rows = 8.5", 1), "rows"),
    "vocab bool": (BOUNDS.replace("vocab = 32768", "vocab = true", 1), "vocab"),
    "hidden zero": (BOUNDS.replace("hidden = 1024", "hidden = 0", 1), "hidden"),
    "method number": (BOUNDS.replace('method = "cpp"', "method = 5", 1), "method"),
    "dtype array": (BOUNDS.replace('dtype = "fp32"', 'dtype = ["fp32"]', 1), "dtype"),
    "against array": (BOUNDS.replace('against = "copy"', 'against = ["copy"]', 1), "against"),
    "max_ratio bool": (BOUNDS.replace("max_ratio = 2.5", "max_ratio = true", 1), "max_ratio"),
    "target bool": (BOUNDS.replace("max_ratio = 2.5", "max_ratio = 2.5\ntarget = true", 1),
                    "target"),
    "case number": ("case = 5\n" + BOUNDS.split("[[case]]")[0], "case"),
    "case array of numbers": ("case = [1, 2]\n" + BOUNDS.split("[[case]]")[0], "case"),
    "machine number": ("machine = 3\n" + WITHOUT_MACHINE, "machine"),
    "machine class number": (BOUNDS.replace('class = "test machine"', "class = 3", 1),
                             "machine"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_bounds_name_the_key(tmp_path, name):
    text, key = MALFORMED[name]
    path = tmp_path / "bounds.toml"
    path.write_text(text)
    with pytest.raises(check.BoundsError, match=rf"\b{key}\b"):
        check.load_bounds(str(path))


BF16_HEAD_BOUND = """
[[case]]
op = "linear_cross_entropy"
method = "cpp"
dtype = "bf16"
rows = 2048
hidden = 1024
vocab = 262144
against = "gemm"
max_ratio = 1.2
"""


@pytest.mark.parametrize("native", [True, False])
def test_bf16_head_bounds_are_skipped_without_bf16_matmul(tmp_path, monkeypatch, capsys,
                                                          native):
    """A bf16 fused-head bound runs where the CPU multiplies bf16 natively; elsewhere (its
    bf16 GEMMs take minutes) it is reported as skipped, runs nothing and fails nothing."""
    path = tmp_path / "bounds.toml"
    path.write_text(BOUNDS + BF16_HEAD_BOUND)
    monkeypatch.setattr(check, "native_bf16_matmul", lambda cpu_flags=None: native)
    seconds = {**WITHIN, ("linear_cross_entropy", "cpp", "bf16"): 11.0,
               ("linear_cross_entropy", "gemm", "bf16"): 10.0}
    clock = FakeClock(seconds)
    code = check.run_check(str(path), clock)
    out = capsys.readouterr().out
    ran_bf16_head = any(c.op == "linear_cross_entropy" and c.dtype == "bf16" for c in clock.ran)
    assert ran_bf16_head == native
    assert code == 0
    if native:
        assert "4 ok, 0 over, 0 failed" in out
    else:
        assert "3 ok, 0 over, 0 failed, 1 skipped" in out
        assert "no bf16 matmul instructions" in out


class NoBenchmarks:
    """``CaseRunner`` in the CLI tests: a bad bounds file must stop the check before any case."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, case):
        raise AssertionError(f"the check ran {case.label()} from a malformed bounds file")


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_cli_reports_a_malformed_bounds_file_in_one_line(tmp_path, capsys, monkeypatch, name):
    from astrai_kernels.bench import runner

    monkeypatch.setattr(runner, "CaseRunner", NoBenchmarks)
    text, key = MALFORMED[name]
    path = tmp_path / "bounds.toml"
    path.write_text(text)
    assert cli.main(["bench", "--check", "--bounds", str(path)]) == 2
    err = capsys.readouterr().err
    assert key in err and "Traceback" not in err


PLAIN_BOUNDS = """
[machine]
class = "test machine"

[[case]]
op = "token_logprobs_sampling"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "plain"
max_ratio = 1.5

[[case]]
op = "token_logprobs_sampling"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "naive"
max_ratio = 0.2

[[case]]
op = "token_logprobs"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "copy"
max_ratio = 2.5
"""
# sampled 0.28 s over the plain op's 0.2 s: 1.4x; over the naive 2.0 s: 0.14x
PLAIN_WITHIN = {("token_logprobs_sampling", "cpp", "fp32"): 0.28,
                ("token_logprobs_sampling", "naive", "fp32"): 2.0,
                ("token_logprobs", "cpp", "fp32"): 0.2}


def test_against_plain_divides_by_the_plain_op_of_the_same_method(tmp_path, capsys):
    path = tmp_path / "bounds.toml"
    path.write_text(PLAIN_BOUNDS)
    clock = FakeClock(dict(PLAIN_WITHIN))
    code, out = run(str(path), clock, capsys)
    assert code == 0, out
    assert "1.40x <= 1.50x" in out and "0.140x <= 0.200x" in out and "2.00x <= 2.50x" in out
    # the plain op's case runs once, shared with its own bound
    assert [(c.op, c.method) for c in clock.ran] == [
        ("token_logprobs_sampling", "cpp"), ("token_logprobs", "cpp"),
        ("token_logprobs_sampling", "naive")]
    slower = dict(PLAIN_WITHIN)
    slower[("token_logprobs_sampling", "cpp", "fp32")] = 0.32  # 1.6x the plain op, 0.16x naive
    code, out = run(str(path), FakeClock(slower), capsys)
    assert code == 1 and "2 ok, 1 over, 0 failed" in out
    assert "over  token_logprobs_sampling cpp fp32 N=4096 V=32768 vs plain" in out


def test_a_failed_plain_op_fails_the_plain_bound(tmp_path, capsys):
    path = tmp_path / "bounds.toml"
    path.write_text(PLAIN_BOUNDS)
    code, out = run(str(path), FakeClock(dict(PLAIN_WITHIN), fail={("token_logprobs", "cpp")}),
                    capsys)
    assert code == 1 and "1 ok, 0 over, 2 failed" in out
    assert "baseline token_logprobs cpp failed: boom" in out


def test_plain_needs_an_op_with_a_plain_form(tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text(BOUNDS.replace('against = "copy"', 'against = "plain"', 1))
    with pytest.raises(check.BoundsError, match="case 1: against 'plain' needs an op with a "
                                                "plain form"):
        check.load_bounds(str(path))


SAMPLING_BOUNDS = """
[machine]
class = "test machine"

[[case]]
op = "token_logprobs_sampling"
sampler = "top_p_flat"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "plain"
max_ratio = 2.0

[[case]]
op = "token_logprobs_sampling"
method = "cpp"
dtype = "fp32"
rows = 4096
vocab = 32768
against = "plain"
max_ratio = 1.5
"""


def test_a_sampler_is_its_own_case_against_the_plain_op(tmp_path, capsys):
    """A bound with a ``sampler`` (issue 42's tails) times that sampler's case beside the
    headline one, and divides each by the plain op, the one case they share."""
    path = tmp_path / "bounds.toml"
    path.write_text(SAMPLING_BOUNDS)
    seconds = {("token_logprobs_sampling", "top_p_flat"): 0.36,
               ("token_logprobs_sampling", ""): 0.28, ("token_logprobs", ""): 0.2}
    ran = []

    def clock(case):
        ran.append(case)
        # as measure's: the case's fields, then the workload's info (the sampler's settings)
        return {**fake_result(case, seconds[(case.op, case.sampler)], 0.1),
                "sampler": case.sampler, "sampling": {"temperature": 0.8, "top_p": 0.9}}

    code, out = run(str(path), clock, capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert any("token_logprobs_sampling top_p_flat cpp fp32 N=4096 V=32768 vs plain" in line
               and "1.80x <= 2.00x" in line for line in lines), out
    assert any("token_logprobs_sampling cpp fp32 N=4096 V=32768 vs plain" in line
               and "1.40x <= 1.50x" in line for line in lines), out
    assert [(c.op, c.sampler) for c in ran] == [
        ("token_logprobs_sampling", "top_p_flat"), ("token_logprobs", ""),
        ("token_logprobs_sampling", "")]
    seconds[("token_logprobs_sampling", "top_p_flat")] = 0.44  # 2.2x the plain op
    code, out = run(str(path), clock, capsys)
    assert code == 1 and "1 ok, 1 over, 0 failed" in out


@pytest.mark.parametrize("replace, message", [
    ({'op = "token_logprobs_sampling"': 'op = "token_logprobs"', '"plain"': '"copy"'},
     "sampler must be one of .* got 'top_p_flat' on token_logprobs"),
    ({'"top_p_flat"': '"top_p_sharp"'}, "sampler must be one of"),
    ({'"top_p_flat"': "5"}, "sampler must be a string"),
])
def test_bad_samplers_are_named(tmp_path, replace, message):
    text = SAMPLING_BOUNDS
    for old, new in replace.items():
        text = text.replace(old, new, 1)
    path = tmp_path / "bounds.toml"
    path.write_text(text)
    with pytest.raises(check.BoundsError, match="case 1: " + message):
        check.load_bounds(str(path))


def test_repository_bounds_hold_issue_42_tails():
    """The sampler's tails: top_p alone on flat rows and top_k = 5000, fp32 and bf16, against
    the plain op with the issue's 2x as target."""
    _, bounds = check.load_bounds(check.default_bounds_path())
    tails = {(b.sampler, b.dtype): b for b in bounds if b.sampler}
    assert set(tails) == {(s, d) for s in ("top_p_flat", "top_k_5000") for d in ("fp32", "bf16")}
    for bound in tails.values():
        assert (bound.op, bound.method, bound.rows, bound.vocab, bound.against) == (
            "token_logprobs_sampling", "cpp", 4096, 32768, "plain")
        assert bound.target == 2.0 and bound.max_ratio <= 2.4
    planned = check.planned_cases(bounds)
    assert Case("token_logprobs_sampling", "cpp", 4096, 32768, "bf16",
                sampler="top_k_5000") in planned


def test_repository_bounds_hold_issue_33_cases():
    """token_logprobs with the sampler (against the floor, the plain op and the naive code, fp32
    and bf16) and topk_distill (against the floor), each with the issue's target."""
    _, bounds = check.load_bounds(check.default_bounds_path())
    by_key = {(b.op, b.dtype, b.against): b for b in bounds}
    for dtype in ("fp32", "bf16"):
        for against, target in (("copy", None), ("plain", 1.5), ("naive", 0.2)):
            bound = by_key[("token_logprobs_sampling", dtype, against)]
            assert (bound.method, bound.rows, bound.vocab) == ("cpp", 4096, 32768)
            if target is not None:
                assert bound.target == target
    assert {("topk_distill", dtype, "copy") for dtype in ("fp32", "bf16")} <= set(by_key)
    planned = check.planned_cases(bounds)
    assert len(planned) == len(set(planned))
    assert Case("token_logprobs", "cpp", 4096, 32768, "bf16") in planned


class Recorder:
    """The events of one ``measure`` call: each timed op call and each copy of the floor."""

    def __init__(self, monkeypatch):
        self.events = []
        original_sample = measure.CopyFloor.sample
        original_build = measure.build_workload

        def sample(floor, count):
            self.events.extend(["copy"] * max(0, count))
            return original_sample(floor, count)

        def build(case):
            workload = original_build(case)
            run_op = workload.run

            def run():
                self.events.append("op")
                run_op()
            workload.run = run
            return workload

        monkeypatch.setattr(measure.CopyFloor, "sample", sample)
        monkeypatch.setattr(measure, "build_workload", build)


def test_floor_copies_run_between_the_timed_calls(monkeypatch):
    """The floor's copies are timed after each timed call (not in one burst after them), at
    least MIN_COPIES in all; copy_s is their median."""
    recorder = Recorder(monkeypatch)
    result = measure.measure(Case("token_logprobs", "cpp", 64, 4096, repeats=3, min_repeats=3))
    per_call = ["op"] + ["copy"] * measure.COPIES_PER_CALL
    top_up = measure.MIN_COPIES - 3 * measure.COPIES_PER_CALL
    assert recorder.events == ["op"] + per_call * 3 + ["copy"] * top_up
    assert len(result["copy_times_s"]) == measure.MIN_COPIES
    assert result["copy_s"] == statistics.median(result["copy_times_s"])
    assert result["repeats"] == 3 and result["clone_s"] > 0
    times = result["copy_times_s"]
    pairs = [statistics.median(times[i:i + measure.COPIES_PER_CALL])
             for i in range(0, 3 * measure.COPIES_PER_CALL, measure.COPIES_PER_CALL)]
    assert result["paired_copy_s"] == pairs


def test_ratio_to_the_floor_is_the_median_of_the_paired_ratios():
    """Each timed call over the copies right after it: a slow moment slows both, so the ratio
    holds where the op's median over the copies' median would swing (a bimodal floor)."""
    result = {"op": "token_logprobs", "method": "cpp", "rows": 4, "vocab": 8, "dtype": "fp32",
              "device": "cpu", "logits_bytes": 100, "floor_bytes": 200, "copy_bytes": 1000,
              "times_s": [2.0, 4.0, 2.2], "paired_copy_s": [1.0, 2.0, 1.0], "copy_s": 1.0,
              "median_s": 2.2, "peak_extra_bytes": 0}
    (out,) = add_ratios([result])
    per_copy = 200 / 2000  # the op's bytes over what one copy moves
    assert out["floor_s"] == pytest.approx(per_copy)
    assert out["ratio_vs_copy"] == pytest.approx(2.0 / per_copy)
    assert out["copy_bandwidth_GBps"] == pytest.approx(2000 / 1e9)


def test_floor_leaves_the_cache():
    """Logits between a quarter of the last-level cache and twice it: the floor copies a
    buffer of twice the cache (a copy partly from the cache is faster than memory on one CPU
    and not on another); well inside the cache, or past twice it, the logits themselves."""
    import torch

    src = torch.randn(16, 1024)  # 64 KiB
    for cache_bytes, copied in ((1 << 16, 2 << 16), (1 << 20, 1 << 16), (1 << 14, 1 << 16)):
        floor = measure.CopyFloor(src, cache_bytes=cache_bytes)
        floor.sample(2)
        result = floor.result()
        assert result["copy_bytes"] == copied, cache_bytes
        assert ("out of the cache" in result["copy_kind"]) == (copied != 1 << 16)
    assert measure.last_level_cache_bytes() >= 1 << 20


def test_floor_buffer_is_outside_the_peak():
    """The floor's buffer is allocated and first touched before the peak's baseline: an
    in-place op (no gradient buffer) adds well under one logits' size S."""
    result = measure.measure(Case("token_logprobs", "cpp:inplace", 256, 16384, repeats=2))
    if result["peak_method"].startswith("ru_maxrss"):
        pytest.skip("/proc/self/clear_refs is not writable: the peak cannot be reset here")
    assert result["peak_extra_bytes"] < 0.5 * result["logits_bytes"], result


def test_floor_buffer_is_like_the_gradient():
    import torch

    src = torch.randn(64, 1 << 15)
    floor = measure.CopyFloor(src, cache_bytes=0)  # the logits are large enough
    assert floor.dst.shape == src.shape and floor.dst.dtype == src.dtype
    assert floor.dst.is_contiguous()
    assert torch.equal(floor.dst, src), "not first touched with the logits"
    assert floor.dst.data_ptr() != src.data_ptr()
    with pytest.raises(RuntimeError, match="never sampled"):
        floor.result()


def _vocab_parallel_script():
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_vocab_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_vocab_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repository_vocab_parallel_bounds_parse(tmp_path):
    """``make bench-check``'s second half: every op of the 2-rank bench has a bound in the
    repository file, and an entry with a wrong key is refused by name."""
    script = _vocab_parallel_script()
    repository = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bounds.toml"
    entries = script.vocab_parallel_bounds(repository)
    assert sorted(entry["op"] for entry in entries) == sorted(script.OPS)
    assert all(entry["max_ratio"] <= 1.0 and entry["max_dtensor_ratio"] < 1.5
               for entry in entries)
    bad = tmp_path / "bounds.toml"
    bad.write_text('[[vocab_parallel]]\nop = "cross_entropy"\nbackend = "cpp"\nrows = 8\n'
                   'vocab = 16\nhidden = 4\nmax_ratio = 1.0\nmax_dtensor = 1.1\n')
    with pytest.raises(SystemExit, match="must have exactly the keys"):
        script.vocab_parallel_bounds(bad)
