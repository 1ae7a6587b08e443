"""fastformer-bench's CLI (fastformer/bench.py, benchmarks/report.py): the summary's verdict and
exit status, the geometric means, --compare on recorded JSON and --plot.

Nothing big is timed: the CLI tests run a stand-in suite whose candidates do nothing, with
common.time_rounds and common.measure_peaks replaced by fixed figures.
"""
import importlib.util
import json
import sys
import types

import pytest
import torch

from fastformer import bench
from fastformer.benchmarks import common, report
from fastformer.benchmarks.common import Row

# ---- a stand-in suite -------------------------------------------------------------------------
# Each case: (name, ours ms, eager ms, max err). TOLERANCE is 1e-3 in fp32.
FAKE_CASES = [("fast", 1.0, 2.0, 1e-4), ("faster", 1.0, 8.0, 5e-4)]


class _Candidate:
    """A candidate that does nothing and says how long it 'takes'."""

    def __init__(self, ms):
        self.ms = ms

    def __call__(self):
        return None


def _fake_suite(cases):
    mod = types.ModuleType("fastformer.benchmarks.fake")
    mod.TOLERANCE = {"float32": 1e-3}

    def cases_fn(device, dtypes, quick=False):
        for name, ours, eager, err in cases:
            yield dict(name=name, ours=ours, eager=eager, err=err, dtype=dtypes[0], mode="fwd")

    def build(c):
        fns = {"ours": _Candidate(c["ours"]), "eager": _Candidate(c["eager"])}
        row = Row("fake", c["name"], common.dtype_name(c["dtype"]), c["mode"], {}, {"flops": 1e9})
        return fns, row, lambda: c["err"]
    mod.cases, mod.case_name, mod.build = cases_fn, lambda c: c["name"], build
    return mod


@pytest.fixture
def fake_bench(monkeypatch):
    """install(cases): bench.main then knows the stand-in suite only, and times nothing (each
    candidate's rounds are its ms x 0.95, 1, 1.05; the peaks are fixed)."""
    def fixed_rounds(fns, device="cpu", rounds=common.ROUNDS):
        return {name: [fn.ms * f for f in (0.95, 1.0, 1.05)] for name, fn in fns.items()}
    monkeypatch.setattr(common, "time_rounds", fixed_rounds)
    monkeypatch.setattr(common, "measure_peaks",
                        lambda device, dtypes: {"matmul_gflops": {"float32": 100.0}, "copy_gbps": 10.0})
    monkeypatch.setattr(bench, "SUITES", ["fake"])

    def install(cases):
        monkeypatch.setitem(sys.modules, "fastformer.benchmarks.fake", _fake_suite(cases))
    return install


def test_summary_passes_and_exits_0_when_every_error_is_within_tolerance(fake_bench, capsys):
    fake_bench(FAKE_CASES)
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory"]) == 0
    out = capsys.readouterr().out
    # geometric mean of the speedups 2x and 8x is 4x
    assert "4.00x eager" in out
    assert "2/2 pass" in out and "verdict: PASS" in out
    assert "fake: fp32 0.001" in out  # the tolerance is stated


def test_a_case_over_its_tolerance_fails_the_run(fake_bench, capsys):
    fake_bench(FAKE_CASES + [("wrong", 1.0, 1.0, 2e-3)])
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory"]) == 1
    out = capsys.readouterr().out
    assert "FAIL fake: wrong float32 fwd: max err 0.002 > tolerance 0.001" in out
    assert "2/3 pass" in out and "verdict: FAIL" in out


def test_match_runs_only_the_cases_whose_name_contains_it(fake_bench, capsys):
    fake_bench(FAKE_CASES + [("wrong", 1.0, 1.0, 2e-3)])
    # "faster" alone: the failing case and "fast" are not run, so the run passes
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory", "--match", "faster"]) == 0
    out = capsys.readouterr().out
    assert "1/1 pass" in out and "8.00x eager" in out
    with pytest.raises(SystemExit, match="no case of fake has 'nothing' in its name"):
        bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory", "--match", "nothing"])
    # several texts: the cases with any of them (the failing one among them: exit status 1)
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory", "--match", "faster", "wrong"]) == 1
    out = capsys.readouterr().out
    assert "1/2 pass" in out and "verdict: FAIL" in out
    with pytest.raises(SystemExit, match="no case of fake has 'nothing' or 'none' in its name"):
        bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory", "--match", "nothing", "none"])


def test_summary_logic_on_rows():
    def row(case, err, tol, ours=1.0, eager=2.0, suite="s"):
        return Row(suite, case, "float32", "fwd", {"ours": ours, "eager": eager, "ours_plain": 5.0},
                   max_err=err, tolerance=tol)
    rows = [row("a", 1e-6, 1e-5, eager=3.0), row("b", 1e-5, 1e-5, eager=12.0),  # on the bound: pass
            row("c", None, 1e-5), row("d", 1e-6, None)]                          # unchecked
    text, ok = report.summary(rows)
    assert ok
    assert f"{(3 * 12 * 2 * 2) ** 0.25:.2f}x eager" in text       # geometric mean of 3, 12, 2, 2
    assert "ours_plain" not in text.split("tolerances")[0]        # ours_* are not baselines
    assert "2/2 pass, 2 unchecked" in text
    nan = row("e", float("nan"), 1e-5)
    assert nan.passed is False and report.summary(rows + [nan])[1] is False
    assert report.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert report.geomean([]) is None


def test_policy_tolerance_follows_the_numerical_policy():
    tol = common.policy_tolerance(magnitude=10, eager_err={"bfloat16": 0.02})
    assert tol["float32"] == pytest.approx(1e-5 + 1e-5 * 10)
    # 2 x eager's error + one bf16 rounding of the largest value + atol
    assert tol["bfloat16"] == pytest.approx(float(f"{2 * 0.02 + 2 ** -7 * 10 + 1e-4:.2g}"))


def test_every_suite_has_default_cases_and_tolerances():
    for suite in bench._available_suites():
        mod = importlib.import_module(f"fastformer.benchmarks.{suite}")
        quick = list(mod.cases("cpu", [torch.float32, torch.bfloat16], quick=True))
        full = list(mod.cases("cpu", [torch.float32, torch.bfloat16]))
        assert 0 < len(quick) <= 8 and len(quick) <= len(full), suite
        for dtype in ("float32", "bfloat16"):
            probe = Row(suite, "x", dtype, "fwd", {})
            assert common.tolerance(mod, probe) is not None, (suite, dtype)


# ---- --compare ----------------------------------------------------------------------------------
def _write_run(path, times: dict):
    """A JSON file as --json writes it: {case: (ours rounds, eager rounds)}."""
    rows = []
    for case, (ours, eager) in times.items():
        rows.append(Row("s", case, "float32", "fwd", {"ours": sorted(ours)[len(ours) // 2],
                                                      "eager": sorted(eager)[len(eager) // 2]},
                        rounds_ms={"ours": ours, "eager": eager}, max_err=0.0, tolerance=1.0))
    report.write_json(str(path), rows, {"cpu": "test cpu", "threads": 2, "torch": torch.__version__})


def test_compare_flags_only_cases_beyond_the_recorded_noise(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _write_run(a, {"same": ([10.0, 10.5, 11.0], [20.0, 20.0, 20.0]),
                   "slower": ([10.0, 10.1, 10.2], [20.0, 20.0, 20.0]),
                   "gone": ([1.0], [1.0])})
    _write_run(b, {"same": ([10.2, 10.6, 11.1], [20.0, 20.0, 20.0]),   # within ±5% noise
                   "slower": ([15.0, 15.1, 15.2], [20.0, 20.0, 20.0]),  # 1.5x, noise ±2%
                   "new": ([1.0], [1.0])})
    assert bench.main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("s ")}
    assert "1.01" in lines["same"] and "slower" not in lines["same"] and "faster" not in lines["same"]
    assert "1.50" in lines["slower"] and "slower" in lines["slower"]
    assert "only in A: s gone" in out and "only in B: s new" in out
    assert "ours moved beyond the recorded noise in 1" in out


def test_compare_rejects_a_file_that_is_not_a_run(tmp_path, capsys):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    _write_run(good, {"x": ([1.0], [1.0])})
    bad.write_text(json.dumps({"something": "else"}))
    for args in ([str(good), str(bad)], [str(good), str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--compare"] + args)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not a fastformer-bench --json file" in err and "cannot read" in err


def test_json_records_the_rounds_and_the_machine(fake_bench, tmp_path):
    fake_bench(FAKE_CASES)
    path = tmp_path / "run.json"
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["torch"] == torch.__version__ and "cpu" in data["meta"]
    assert data["meta"]["peaks"]["matmul_gflops"] == {"float32": 100.0}
    row = data["rows"][0]
    assert row["rounds_ms"]["ours"] == pytest.approx([0.95, 1.0, 1.05])
    assert row["passed"] is True and row["tolerance"] == 1e-3
    assert set(row["peak_mb"]) == {"ours", "eager"}  # measured in the same pass (here: nothing)


# ---- --plot ---------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (pip install '.[bench]')")
def test_plot_writes_a_file(fake_bench, tmp_path):
    fake_bench(FAKE_CASES)
    path = tmp_path / "speedup.png"
    assert bench.main(["--op", "fake", "--dtype", "fp32", "--no-memory", "--plot", str(path)]) == 0
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_bad_output_paths_are_refused_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--json", str(tmp_path / "no" / "such" / "dir.json")])
    assert "does not exist" in capsys.readouterr().err


# ---- the memory measurement ----------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_case_memory_sees_a_64_mib_allocation():
    n = 16 * 2 ** 20  # 64 MiB of fp32
    mem = common.case_memory({"big": lambda: torch.ones(n), "none": lambda: None})
    if mem["big"] is None:
        pytest.skip("glibc's mallopt or /proc/self/clear_refs is not available")
    assert 60 <= mem["big"] <= 70 and mem["none"] < 2


def test_decode_generate_candidates_are_what_their_names_say(monkeypatch):
    """The decode suite's generate case (a small stand-in config): sdpa is Hugging Face's sdpa
    model unconverted, ours_attn only the fastformer attention backend, ours (and ours_prepack)
    the converted model."""
    pytest.importorskip("transformers", reason="needs transformers")
    from fastformer.benchmarks import decode
    monkeypatch.setattr(decode, "GENERATE", dict(layers=1, hidden=64, heads=4, kv_heads=2))
    c = dict(kind="generate", dtype=torch.bfloat16, device="cpu", mode="inference", batch=2, prompt=5,
             new_tokens=2)
    fns, _, _ = decode.build(c)
    models = {name: fn.__defaults__[0] for name, fn in fns.items()}
    converted = {name: any(hasattr(type(m), "_ff_what") for m in model.modules())
                 for name, model in models.items()}
    assert models["sdpa"].config._attn_implementation == "sdpa" and not converted["sdpa"]
    assert models["ours_attn"].config._attn_implementation == "fastformer" and not converted["ours_attn"]
    assert converted["ours"] and models["ours"].config._attn_implementation == "fastformer"
    assert converted.get("ours_prepack", True)
    assert fns["ours"]().shape == (2, 7)


def test_decode_encoder_decoder_generate_candidates_are_what_their_names_say(monkeypatch):
    """The encoder-decoder generate cases (small stand-ins of the models suite's BLIP, TrOCR and
    FSMT configs): sdpa is the model unconverted (TrOCR's ViT encoder on sdpa), ours converted,
    and both caption / translate alike."""
    t = pytest.importorskip("transformers", reason="needs transformers")
    from fastformer.benchmarks import decode, models
    vit = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=48)
    small = {"blip": (t.BlipConfig, t.BlipForConditionalGeneration,
                      dict(vision_config=vit, text_config=dict(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                                               num_attention_heads=2, intermediate_size=48,
                                                               encoder_hidden_size=32, pad_token_id=0,
                                                               bos_token_id=1, sep_token_id=2)), 1, 1),
             "trocr": (t.VisionEncoderDecoderConfig, t.VisionEncoderDecoderModel,
                       dict(encoder=t.ViTConfig(**vit).to_dict(),
                            decoder=t.TrOCRConfig(vocab_size=97, d_model=32, decoder_layers=1,
                                                  decoder_attention_heads=2, decoder_ffn_dim=48,
                                                  cross_attention_hidden_size=32,
                                                  decoder_start_token_id=2, pad_token_id=1).to_dict()), 1, 1),
             "fsmt": (t.FSMTConfig, t.FSMTForConditionalGeneration,
                      dict(langs=["en", "de"], src_vocab_size=97, tgt_vocab_size=97, d_model=32, encoder_layers=1,
                           decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=48, decoder_ffn_dim=48), 1, 1)}
    monkeypatch.setattr(models, "_configs", lambda: small)
    for name, attention, source in (("blip", "BlipTextSelfAttention", {}), ("trocr", "TrOCRAttention", {}),
                                    ("fsmt", "Attention", dict(source=7))):
        c = dict(kind="encoder_decoder_generate", model=name, dtype=torch.float32, device="cpu", mode="inference",
                 batch=2, new_tokens=3, **source)
        fns, row, error = decode.build(c)
        models_by_name = {n: fn.__defaults__[0] for n, fn in fns.items()}
        kinds = {n: {type(m).__name__ for m in model.modules() if hasattr(type(m), "_ff_what")}
                 for n, model in models_by_name.items()}
        assert not kinds["sdpa"] and attention in kinds["ours"], kinds
        assert row.case.startswith("HF generate") and error() == 0
        assert fns["ours"]().shape[0] == 2


def test_models_lora_case_gives_every_candidate_the_same_adapters(monkeypatch):
    """The models suite's LoRA case (a small stand-in): every candidate a PeftModel with the same
    adapters, ours converted around them (the MLPs over LoRA layers left), one training step's
    loss alike."""
    t = pytest.importorskip("transformers", reason="needs transformers")
    pytest.importorskip("peft", reason="the LoRA case needs peft")
    from fastformer.benchmarks import models
    name = next(iter(models._LORA))
    small = {name: (t.LlamaConfig, t.LlamaForCausalLM,
                    dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2), 1, 16)}
    monkeypatch.setattr(models, "_configs", lambda: small)
    monkeypatch.setattr(models, "COMPILE", False)
    fns, row, error = models.build(dict(model=name, dtype=torch.float32, device="cpu", mode="train"))
    peft_models = {n: next(c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
                   for n, fn in fns.items()}
    adapters = {n: {k: v for k, v in m.state_dict().items() if "lora_" in k} for n, m in peft_models.items()}
    assert adapters["ours"] and all(a.keys() == adapters["sdpa"].keys() for a in adapters.values())
    assert all(torch.equal(adapters["ours"][k], adapters["sdpa"][k]) for k in adapters["sdpa"])
    converted = {type(m).__name__ for m in peft_models["ours"].modules() if hasattr(type(m), "_ff_what")}
    assert "LlamaRMSNorm" in converted and "LlamaMLP" not in converted, converted
    assert error() <= 1e-5
