import sys
import faulthandler
faulthandler.enable()
import torch
import offcache
from offcache import _C, _engine
case = sys.argv[1]
if case == "value":        # c10::ValueError thrown inline in the extension (TORCH_CHECK_VALUE)
    fn = lambda: _C.configure("host", 1 << 30, 2 << 30, 1 << 30, 0)
elif case == "runtime":    # c10::Error thrown inside libc10 (TORCH_CHECK)
    fn = lambda: _engine.fetch_file("/nonexistent.bin", [(0, [1], torch.uint8)], torch.device("cpu"))
elif case == "value_cuda": # the same after CUDA is up
    torch.zeros(1, device="cuda")
    fn = lambda: _C.configure("host", 1 << 30, 2 << 30, 1 << 30, 0)
elif case == "torch_value": # torch's own ValueError path from a torch op, for comparison
    fn = lambda: torch.empty(2).view(3)
try:
    fn()
    print(case, "NO ERROR", flush=True)
except Exception as e:
    print(case, "->", type(e).__name__, str(e)[:120].replace("\n", " "), flush=True)
