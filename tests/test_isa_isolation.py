"""The CPU kernels are compiled three times (DEFAULT, AVX2, AVX-512) into one library. An inline
function that several levels instantiate is kept once by the linker; if the AVX-512 copy won, a
CPU without AVX-512 would crash in a shared helper. setup.py links the DEFAULT objects first;
this test checks the result: no function outside the AVX2 / AVX-512 namespaces (mangled
3cpu4AVX2 / 3cpu6AVX512, which also covers OpenMP-outlined and lambda instantiations) touches
a ymm or zmm register."""
import platform
import re
import shutil
import subprocess

import pytest

import fastformer as ff

pytestmark = pytest.mark.skipif(
    ff._ext.C is None or platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump"),
    reason="needs the compiled extension on x86-64 and binutils' objdump")

# A function of fastformer's level namespaces, or a template instantiated on one level's
# at::vec types (at::vec::AVX2::Vectorized exists only in AVX2 objects: no other level can emit
# a copy of the same symbol for the linker to pick).
_LEVEL_TAGS = ("3cpu4AVX2", "3cpu6AVX512", "cpu::AVX2::", "cpu::AVX512::", "3vec4AVX2",
               "3vec6AVX512")
# A wide register operand (not e.g. "symmetric" in a disassembler's symbol comment).
_WIDE_REGISTER = re.compile(r"%[yz]mm\d")


def test_no_wide_registers_outside_capability_namespaces():
    so = ff._ext.C.__file__
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True,
                          text=True, check=True).stdout
    offenders = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            current = m.group(1)
            continue
        if current and _WIDE_REGISTER.search(line.split("#", 1)[0]):
            if not any(tag in current for tag in _LEVEL_TAGS):
                offenders[current] = offenders.get(current, 0) + 1
    assert not offenders, f"AVX code outside the capability namespaces: {list(offenders)[:10]}"
