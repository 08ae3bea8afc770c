"""Read XLA GPU thunk dumps (``--xla_dump_to``) to prove CUDA-graph capture and count direct launches.

XLA writes one ``*thunk_sequence_after_thunk_passes.txt`` per executable (module). A top-level
``kCommandBuffer`` thunk is replayed as one CUDA graph; every other top-level thunk that launches
device work (kernels, GEMMs, custom calls, copies, memsets) is a direct launch from the host.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

_LAUNCHING = ("kKernel", "kCustomKernel", "kGemm", "kCublasLt", "kCustomCall", "kCopy", "kMemset", "kMemzero",
              "kConvolution", "kTriangular", "kFft", "kCuDnn", "kDynamicSlice", "kSequential", "kWhile",
              "kConditional", "kNcclAll", "kDeviceToDevice", "kCommandBuffer")


@dataclass
class ModuleThunks:
    name: str
    top_level: list[str] = field(default_factory=list)  # kinds of top-level thunks
    in_graphs: list[str] = field(default_factory=list)  # kinds nested inside kCommandBuffer thunks

    @property
    def command_buffers(self) -> int:
        return sum(1 for k in self.top_level if k == "kCommandBuffer")

    @property
    def direct_launches(self) -> int:
        """Host-issued launches: graph launches count one each, plus every launching thunk outside graphs."""
        return sum(1 for k in self.top_level if k.startswith(_LAUNCHING))


_KIND = re.compile(r"\b(k[A-Z][A-Za-z0-9]+)\b")


def parse_thunk_file(path: str) -> ModuleThunks:
    """Indentation-based parse: depth-0 thunks are top level; deeper lines under a kCommandBuffer are nested."""
    name = os.path.basename(path).split(".thunk_sequence")[0]
    mod = ModuleThunks(name)
    in_cb_indent: int | None = None
    with open(path) as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    base = min((len(ln) - len(ln.lstrip()) for ln in lines if _KIND.search(ln)), default=0)
    for ln in lines:
        m = _KIND.search(ln)
        if not m or m.group(1) in ("kNone",):
            continue
        indent = len(ln) - len(ln.lstrip())
        kind = m.group(1)
        if in_cb_indent is not None and indent > in_cb_indent:
            mod.in_graphs.append(kind)
            continue
        in_cb_indent = None
        if indent == base:
            mod.top_level.append(kind)
            if kind == "kCommandBuffer":
                in_cb_indent = indent
    return mod


def read_dump(dump_dir: str) -> dict[str, ModuleThunks]:
    """Module name -> thunks, per executable from its final sequence.

    A module compiled with command buffers has a ``*thunk_sequence_after_thunk_passes.txt`` (the
    sequence after the command-buffer conversion); one compiled with them disabled (the eager regions)
    may have only ``*thunk_sequence.txt``, so each module takes the former when it exists, else the latter.
    """
    chosen: dict[str, str] = {}
    for pattern in ("*thunk_sequence.txt", "*thunk_sequence_after_thunk_passes.txt"):  # later wins
        for p in sorted(glob.glob(os.path.join(dump_dir, pattern))):
            chosen[os.path.basename(p).split(".thunk_sequence")[0]] = p
    return {name: parse_thunk_file(p) for name, p in sorted(chosen.items())}
