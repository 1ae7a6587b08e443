"""The single-call benchmark script (benchmarks/single_call.py) runs a suite case end to end."""
import re

import pytest

from fastformer.benchmarks import ffn, single_call


def test_single_call_times_ours_and_the_skipped_baseline(capsys, monkeypatch):
    # The smallest ffn case, forward only: a few seconds. The script lifts the suite's budget,
    # so eager runs here whatever its estimate. Only the matching case is built (building one
    # allocates its tensors; the gated fwd+bwd ones run ours once for the saved bytes).
    built = []
    build = ffn.build

    def recording_build(case):
        fns, row, error = build(case)
        built.append((ffn.case_name(case), row.case))
        return fns, row, error
    monkeypatch.setattr(ffn, "build", recording_build)
    single_call.main(["--op", "ffn", "--match", "relu (4096", "--dtype", "fp32", "--mode", "fwd"])
    assert built == [("ffn relu (4096, 768, 3072)", "ffn relu (4096, 768, 3072)")]
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if l.startswith("ffn relu (4096, 768, 3072) float32 fwd")]
    assert len(line) == 1, out
    m = re.search(r"ours ([0-9.]+) s .* eager ([0-9.]+) s \(1 call\) = ([0-9.]+)x.*max err ([0-9.e+-]+)", line[0])
    assert m, line[0]
    ours, eager, ratio, err = (float(g) for g in m.groups())
    assert ours > 0 and eager > 0 and ratio == pytest.approx(eager / ours, rel=0.02)
    # The reported error column is live (the kernel's tolerance tests are in test_ffn.py).
    assert 0 < err < 1e-3


def test_single_call_rejects_a_case_that_matches_nothing():
    with pytest.raises(SystemExit):
        single_call.main(["--op", "ffn", "--match", "no such case", "--dtype", "fp32"])
