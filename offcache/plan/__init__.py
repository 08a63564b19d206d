"""What will a calibration run need? ``python -m offcache.plan``, and ``estimate()`` for code.

core.py       estimate(): the plan of a run, its tiers, weights and advice
trace.py      what each subgraph stores, traced from the model on the meta device
sim.py        the cache's calls replayed the way the engine holds memory
ranks.py      a torchrun job: each rank's share of the samples and limits, the weights once per node
offload.py    offloaded weights under a memory limit: placement, disk reads and time, the expected peak
positions.py  the sequence length against the model's positions
cli.py        the command line and the plan as text
"""

from offcache.plan.cli import main, render
from offcache.plan.core import COLLATORS, Boundary, Plan, Shape, Tiers, Weights, estimate
from offcache.plan.offload import Offload
from offcache.plan.ranks import Node

__all__ = ["COLLATORS", "Boundary", "Node", "Offload", "Plan", "Shape", "Tiers", "Weights", "estimate", "main",
           "render"]  # fmt: skip
