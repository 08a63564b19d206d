"""The one-line reproduction run on the H200 (2026-12-04, by benchmarks/diag.sh): an
engine error message holding a number, raised by the engine and by torch, in a fresh interpreter.
`python3 benchmarks/diag_repro.py value|runtime|value_cuda|torch_value`."""

import faulthandler
import sys

faulthandler.enable()  # before torch: a segfault prints the Python stack

import torch  # noqa: E402

import offcache  # noqa: E402, F401  (loads the engine as users do)
from offcache import _C, _engine  # noqa: E402


def value():  # c10::ValueError thrown inline in the extension (TORCH_CHECK_VALUE), numbers in it
    _C.configure("host", 1 << 30, 2 << 30, 1 << 30, 0)


def runtime():  # c10::Error thrown inside libc10 (TORCH_CHECK), no number in it
    _engine.fetch_file("/nonexistent.bin", [(0, [1], torch.uint8)], torch.device("cpu"))


def value_cuda():  # the same after CUDA is up
    torch.zeros(1, device="cuda")
    value()


def torch_value():  # torch's own error path from a torch op, for comparison
    torch.empty(2).view(3)


case = sys.argv[1]
try:
    {"value": value, "runtime": runtime, "value_cuda": value_cuda, "torch_value": torch_value}[case]()
    print(case, "NO ERROR", flush=True)
except Exception as e:
    print(case, "->", type(e).__name__, str(e)[:120].replace("\n", " "), flush=True)
