"""Every CausalLM family of the installed transformers, converted: never a wrong answer.

For each model type in transformers' CausalLM mapping, a small random-weight model (the config's
defaults with the sizes below) runs under attn_implementation="eager"; ff.convert converts it in
place and it runs again on the same ids. The converted logits must be within 1e-5 of the eager
ones' scale (fp32), and ff.convert must not raise where eager runs. Whatever ff.convert does not
take it leaves (named in its report): that is allowed, a different answer is not. This found
three wrong answers the per-family tests had no entry for (NanoChat's flipped rotate_half,
Inkling 2's per-query sinks, GIT's eager-only attention).

Families whose eager forward does not run at these sizes (configs whose other fields assume the
defaults we override) are counted and skipped, not failed. Each family runs in a forked child
with a memory limit and a time limit, so that one that builds a huge default (a vision tower)
cannot take the run down.
"""
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue as queue_module
import resource
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the sweep needs transformers")

import fastformer as ff  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=64,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             n_embd=64, n_layer=2, n_head=4, d_model=64, num_layers=2, num_heads=4, ffn_dim=96,
             tie_word_embeddings=False, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96)
MEMORY_BYTES = 4 << 30
SECONDS = 120
TOLERANCE = 1e-5  # of the eager logits' largest value, fp32


def child_setup(queue, package: str, memory: int = MEMORY_BYTES) -> bool:
    """In a child: whether it runs the package under test (else it says so on the queue), with
    its memory limit, one thread and no warnings."""
    if ff.__file__ != package:  # the package under test, not another copy on the child's path
        queue.put(("ours fails", f"the child imported fastformer from {ff.__file__}, not {package}"))
        return False
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return True


def running_their_original_code(model):
    """("ours fails", which) where converted modules fall back to their original code although
    nothing changed after ff.convert (integrations/hf_parts.py; transformers' output-capturing
    hooks, put in by the eager run before, do not count), else None."""
    from fastformer.integrations import hf_parts
    which = [f"{type(m).__name__}: {why}" for m in model.modules()
             if getattr(type(m), "_fastformer_original", None) is not None and (why := hf_parts.changed(m))]
    return ("ours fails", f"converted modules run their original code: {which[:3]}") if which else None


def small_model(name: str, auto_class, sizes: dict = SMALL):
    """`name`'s model from its config's defaults with `sizes` (where the config has the field and
    takes the value), random weights (seed 0), eager attention, eval mode."""
    config = transformers.AutoConfig.for_model(name)
    for key, value in sizes.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a config that validates the value: keep its own
                pass
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return auto_class.from_config(config).eval()


def _one(name: str, queue, package: str) -> None:
    """In the child: ("eager fails", why) / ("ours fails", why) / ("ok", relative error)."""
    if not child_setup(queue, package):
        return
    try:
        model = small_model(name, transformers.AutoModelForCausalLM)
        ids = torch.randint(2, 90, (2, 13), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(input_ids=ids).logits.double()
    except Exception as exc:  # noqa: BLE001 - anything eager cannot run is out of the sweep
        queue.put(("eager fails", f"{type(exc).__name__}: {str(exc)[:120]}"))
        return
    try:
        ff.convert(model)
        with torch.no_grad():
            out = model(input_ids=ids).logits.double()
        scale = ref.abs().max().item() or 1.0
        queue.put(running_their_original_code(model) or ("ok", (out - ref).abs().max().item() / scale))
    except Exception as exc:  # noqa: BLE001
        queue.put(("ours fails", f"{type(exc).__name__}: {str(exc)[:200]}"))


def _sweep(names: list, workers: int = 2, target=None) -> dict:
    """{name: result of target (default _one)}, `workers` children at a time (one thread each),
    target(name, queue, package) a module-level function of a test module. The children fork
    from a fresh server process (forkserver): forking this one, whose OpenMP thread pool earlier
    tests have started, could deadlock a child in libgomp. The server preloads torch and
    transformers, and transformers.modeling_utils, which every model's module imports: 2-3 s per
    child otherwise (the CausalLM sweep took 424 s without it, 147 s with it, on a 2-core Zen 3).
    And pytest and fastformer, which each child imports with this module (0.28 s of a child's
    0.6): the server starts in tests/, since its path begins with its working directory (Python
    3.11's forkserver does not take the parent's path), where a source checkout's fastformer
    (without the built extension) would shadow the installed one. child_setup() checks that a
    child runs the test process's fastformer."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.modeling_utils", "pytest", "fastformer",
                                "fastformer.integrations.hf_convert"])
    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    try:
        multiprocessing.forkserver.ensure_running()  # a no-op once a sweep has started it
    finally:
        os.chdir(here)
    results, running, pending = {}, [], list(names)
    while pending or running:
        while pending and len(running) < workers:
            name, queue = pending.pop(0), ctx.Queue()
            child = ctx.Process(target=target or _one, args=(name, queue, ff.__file__))
            child.start()
            running.append((name, child, queue, time.monotonic()))
        time.sleep(0.05)
        for entry in list(running):
            name, child, queue, start = entry
            if not queue.empty():
                results[name] = queue.get()
            elif child.is_alive() and time.monotonic() - start < SECONDS:
                continue
            elif child.is_alive():
                results[name] = ("eager fails", f"over {SECONDS} s")
            else:
                try:  # it may have put its result just before exiting
                    results[name] = queue.get(timeout=2)
                except queue_module.Empty:
                    results[name] = ("eager fails", f"the child died (exit code {child.exitcode}: memory limit?)")
            child.kill()
            child.join()
            running.remove(entry)
    return results


def test_every_causal_lm_family_converts_without_a_wrong_answer():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    results = _sweep(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    ran = {n: r[1] for n, r in results.items() if r[0] == "ok"}
    wrong = {n: f"{e:.2e}" for n, e in ran.items() if not e <= TOLERANCE}
    failed = {n: r[1] for n, r in results.items() if r[0] == "ours fails"}
    print(f"{len(ran)} families converted and compared, {len(results) - len(ran) - len(failed)} "
          f"not runnable by eager at these sizes")
    assert not wrong, f"converted logits off eager's by more than {TOLERANCE} of their scale: {wrong}"
    assert not failed, f"ff.convert or the converted forward raised: {failed}"
    assert len(ran) >= 100, f"only {len(ran)} families ran: the sweep's sizes no longer fit transformers"
