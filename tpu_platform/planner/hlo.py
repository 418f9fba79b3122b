# SPDX-License-Identifier: Apache-2.0
"""Memory traffic of a compiled program, instruction by instruction, read from its HLO text.

XLA's cost model (`Compiled.cost_analysis()`) gives one total, and none at all for a program
compiled for a GPU without one. `hlo_traffic` reads the optimized HLO (`Compiled.as_text()`)
and counts, for every instruction outside fused computations, the bytes of its operands and
results: the traffic the instruction would cause if each operand is read once and each result
written once. A custom call (a Mosaic or Triton kernel) is charged its whole operands, which for
attention is the whole KV cache, though the kernel reads only the pages in use; so is an
in-place update (the KV write's scatter), though it touches only the rows it writes; a while loop's
body counts once. So the figure is an accounting of what XLA's program moves, per operation,
useful to find the operation a large total comes from; not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import re

# Bits an element takes: XLA packs the sub-byte types (TPU and GPU layouts say so, e.g.
# `s4[4096,14336]{1,0:E(4)}`), two 4-bit values a byte.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
    "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128,
}  # fmt: skip
# The float8 (`f8e4m3fn`, `f8e8m0fnu`, ...) and float4 (`f4e2m1fn`) families.
_FLOAT_BITS = {"f8": 8, "f4": 4}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_NAME = re.compile(r"%([\w.\-]+)")
_FUSION_KIND = re.compile(r"kind=(\w+)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
# Instructions that move no data of their own.
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
    "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "async-done",
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes moved by a program's instructions: in total, by kind and the largest instructions."""

    total_bytes: int
    by_kind: tuple[tuple[str, int, int], ...]  # (kind, bytes, instructions), largest first
    largest: tuple[tuple[str, str, int], ...]  # (kind, op_name, bytes), largest first

    def as_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "by_kind": [{"kind": k, "bytes": b, "count": n} for k, b, n in self.by_kind],
            "largest": [{"kind": k, "op_name": o, "bytes": b} for k, o, b in self.largest],
        }


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (e.g. `(bf16[64,4096]{1,0}, s32[])`), sub-byte
    types packed (an `s4` array of n values takes n / 2 bytes, rounded up)."""
    return sum(_array_bytes(dtype, dims) for dtype, dims in _arrays(text))


def hlo_traffic(hlo_text: str, top: int = 8) -> Traffic:
    """The bytes `hlo_text`'s instructions read and write (see the module docstring)."""
    parsed = []  # (counted, name, result text, opcode, rest of the line)
    result_bytes: dict[str, int] = {}
    fused, counted = set(_CALLED.findall(hlo_text)), False
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            header = _COMPUTATION.match(line)
            if header:
                counted = header.group(1) not in fused
            continue
        name, result, opcode, rest = match.groups()
        result_bytes[name] = shape_bytes(result)
        parsed.append((counted, name, opcode, rest))
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    instructions: list[tuple[int, str, str]] = []
    for counted, name, opcode, rest in parsed:
        if not counted or opcode in _FREE:
            continue
        read = sum(result_bytes.get(operand, 0) for operand in _NAME.findall(_operands(rest)))
        # copy-start's result holds the source and the destination: the copy reads and writes once.
        moved = 2 * read if opcode == "copy-start" else read + result_bytes[name]
        kind = opcode
        if opcode == "custom-call" and (target := _TARGET.search(rest)):
            kind = f"custom-call {target.group(1)}"
        elif opcode == "fusion" and (fusion_kind := _FUSION_KIND.search(rest)):
            kind = f"fusion {fusion_kind.group(1)}"
        op_name = _OP_NAME.search(rest)
        by_kind[kind][0] += moved
        by_kind[kind][1] += 1
        instructions.append((moved, kind, op_name.group(1) if op_name else name))
    instructions.sort(reverse=True)
    kinds = sorted(((k, b, n) for k, (b, n) in by_kind.items()), key=lambda x: -x[1])
    return Traffic(
        total_bytes=sum(b for _, b, _ in kinds),
        by_kind=tuple(kinds[:top]),
        largest=tuple((k, o, b) for b, k, o in instructions[:top]),
    )


def _operands(rest: str) -> str:
    """The text of an instruction's operand list: `rest` up to the parenthesis closing it."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i]
    return rest


# Cross-device operations: each of these moves data between the chips of a sharded program.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective of an optimized program: its kind (an async pair, `*-start` / `*-done`,
    counts once, as its plain kind), the arrays it takes and gives (`(dtype, dims)` each) and
    the source operation's name."""

    kind: str
    operands: tuple[tuple[str, tuple[int, ...]], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    op_name: str

    @property
    def result_bytes(self) -> int:
        return sum(_array_bytes(dtype, dims) for dtype, dims in self.results)

    @property
    def result_elements(self) -> tuple[int, ...]:
        """Elements of each result array (layouts and transposes aside, what identifies it)."""
        return tuple(_elements(dims) for _, dims in self.results)


def hlo_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in `hlo_text` (optimized HLO), in program order, with operand and result
    shapes. An async `*-start` gives the results of its `*-done` (its own result is a tuple that
    also holds the operands and scratch values)."""
    results: dict[str, str] = {}
    found = []  # (name, kind, operand names, op_name, is_start)
    done_of: dict[str, str] = {}  # a start's name -> its done's result text
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, opcode, rest = match.groups()
        results[name] = result
        kind = opcode.removesuffix("-start").removesuffix("-done")
        if kind not in COLLECTIVES:
            continue
        operands = _NAME.findall(_operands(rest))
        if opcode.endswith("-done"):
            done_of.update({operand: result for operand in operands})
            continue
        op_name = _OP_NAME.search(rest)
        found.append((name, kind, operands, op_name.group(1) if op_name else name, opcode.endswith("-start")))
    return [
        Collective(
            kind=kind,
            operands=tuple(a for operand in operands for a in _arrays(results.get(operand, ""))),
            results=_arrays(done_of.get(name, "") if started else results[name]),
            op_name=op_name,
        )
        for name, kind, operands, op_name, started in found
    ]


def summarize_collectives(collectives: list[Collective]) -> list[dict]:
    """The collectives grouped by kind and result shapes, with their count: a compact record."""
    counts = collections.Counter(
        (c.kind, ", ".join(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in c.results))
        for c in collectives
    )
    return [{"kind": kind, "results": shapes, "count": n} for (kind, shapes), n in counts.items()]


def _arrays(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(text))


def _elements(dims: tuple[int, ...]) -> int:
    size = 1
    for d in dims:
        size *= d
    return size


def _array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    """Bytes of one array; 0 for a type that is not an array's (`token`) or not known."""
    bits = _BITS.get(dtype) or _FLOAT_BITS.get(dtype[:2], 0)
    return -(-_elements(dims) * bits // 8)


@dataclasses.dataclass(frozen=True, slots=True)
class ExpectedCollectives:
    """What a tensor-parallel step's rules table implies it exchanges (`plan.expected_collectives`):
    `all_reduces` sums of `[tokens, hidden]` activations (each row-parallel o/down projection's,
    and the vocab-parallel embedding's), one all-gather of the `[rows, vocab]` logits (0: none,
    the head is not split), and nothing else; a collective of `weight_floor_bytes` or more (the
    smallest split weight's whole size) would be a weight gathered whole."""

    activation_elements: int
    all_reduces: int
    logits_elements: int
    weight_floor_bytes: int


def unexpected_collectives(collectives: list[Collective], expected: ExpectedCollectives) -> list[str]:
    """What in `collectives` the rules table does not imply (see `ExpectedCollectives`), one line
    each; empty when the program exchanges exactly what it should."""
    problems = []
    reduces = gathers = 0
    for c in collectives:
        if c.kind == "all-reduce" and set(c.result_elements) == {expected.activation_elements}:
            reduces += len(c.results)
        elif (
            c.kind == "all-gather"
            and expected.logits_elements
            and c.result_elements == (expected.logits_elements,)
        ):
            gathers += 1
        else:
            shapes = ", ".join(f"{dtype}{list(dims)}" for dtype, dims in c.results)
            weight = " (as large as a whole weight)" if c.result_bytes >= expected.weight_floor_bytes else ""
            problems.append(f"unexpected {c.kind} of {shapes}{weight} from {c.op_name}")
    if reduces != expected.all_reduces:
        problems.append(
            f"{reduces} all-reduces of [tokens, hidden] activations ({expected.activation_elements} "
            f"elements), expected {expected.all_reduces}"
        )
    wanted = 1 if expected.logits_elements else 0
    if gathers != wanted:
        problems.append(f"{gathers} all-gathers of the [rows, vocab] logits, expected {wanted}")
    return problems
