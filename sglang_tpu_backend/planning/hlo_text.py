"""Parse compiled (post-optimisation) HLO text into computations and instructions.

Only what a cost walk needs: each instruction's name, result type, opcode, operand names,
the text of its attributes, and the computations it calls. Shapes are parsed from the type
text, e.g. ``bf16[64,4096]{1,0:T(16,128)(2,1)}`` or a tuple ``(s32[], f32[8]{0:S(1)})``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

# Bytes per element of the HLO primitive types (``token`` and tuples hold no data).
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "f4e2m1fn": 0.5,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](?:\{([^}]*)\})?")
_INSTR_START = re.compile(r"\n\s*(?=(?:ROOT )?%[\w.\-]+ = )")
_HEAD = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a type: element type, dimensions, memory space (0: HBM; 1: VMEM;
    others: on-chip scalar memories)."""

    dtype: str
    dims: tuple[int, ...]
    memory_space: int = 0

    @property
    def nbytes(self) -> float:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {self.dtype!r}")
        return DTYPE_BYTES[self.dtype] * math.prod(self.dims)


def parse_type(text: str) -> tuple[Array, ...]:
    """The arrays of an HLO type (one for an array type, its leaves for a tuple)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d),
                         int(space.group(1)) if space else 0))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``name = type opcode(operands), attrs``."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    is_root: bool = False
    args: str = ""  # the text between the opcode's parentheses (a constant's literal)

    @property
    def arrays(self) -> tuple[Array, ...]:
        return parse_type(self.type)

    def attr(self, key: str) -> str | None:
        """The raw value of ``key=...`` up to the next ``, `` at depth 0 (braces balanced)."""
        at = self.attrs.find(f"{key}=")
        if at < 0:
            return None
        i, depth, start = at + len(key) + 1, 0, at + len(key) + 1
        while i < len(self.attrs):
            c = self.attrs[i]
            if c in "{([":
                depth += 1
            elif c in "})]":
                depth -= 1
            elif c == "," and depth == 0:
                break
            i += 1
        return self.attrs[start:i]

    def backend_config(self) -> dict:
        at = self.attrs.find("backend_config=")
        if at < 0:
            return {}
        cfg, _ = json.JSONDecoder().raw_decode(self.attrs[at + len("backend_config="):])
        return cfg

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    def called(self) -> dict[str, str]:
        """Computations this instruction calls: {"calls" | "to_apply" | "body" |
        "condition" | "branch<i>": name}."""
        out = dict((k, v) for k, v in _CALLED.findall(self.attrs))
        m = _BRANCHES.search(self.attrs)
        if m:
            for i, b in enumerate(re.findall(r"%([\w.\-]+)", m.group(1))):
                out[f"branch{i}"] = b
        return out


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: dict[str, Instruction]  # in text order
    root: str

    def users(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions.values() if name in i.operands]


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start] == '('``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO: {text[start:start + 80]!r}")


def parse_instruction(text: str) -> Instruction:
    head = _HEAD.match(text)
    if not head:
        raise ValueError(f"not an HLO instruction: {text[:80]!r}")
    i = head.end()
    if text[i] == "(":
        j = _balanced(text, i)
    else:
        j = text.index(" ", i)
    type_text = text[i:j]
    m = re.compile(r"\s*([\w\-]+)\(").match(text, j)
    if not m:
        raise ValueError(f"no opcode in HLO instruction: {text[:120]!r}")
    k = _balanced(text, m.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", text[m.end():k - 1]))
    return Instruction(head.group(2), type_text, m.group(1), operands, text[k:].lstrip(", "),
                       bool(head.group(1)), text[m.end():k - 1])


def parse_module(hlo: str) -> tuple[dict[str, Computation], str]:
    """(computations by name, name of the ENTRY computation) of a module's HLO text."""
    comps: dict[str, Computation] = {}
    entry = None
    for block in re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo):
        head = re.match(r"(ENTRY )?%([\w.\-]+) \(", block)
        if not head:
            continue
        body = block[block.index("{\n") + 2:block.rstrip().rfind("}")] if "{\n" in block else ""
        instrs = [parse_instruction(t) for t in _INSTR_START.split("\n" + body) if t.strip()]
        roots = [i.name for i in instrs if i.is_root] or [instrs[-1].name]
        comps[head.group(2)] = Computation(head.group(2), {i.name: i for i in instrs}, roots[0])
        if head.group(1):
            entry = head.group(2)
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return comps, entry
