"""Faster TVMScript parsing: three memos in TVM's parser, each giving exactly what it computed.

Parsing our kernels' TVMScript is most of an export (the affine GEMM in its three ISA forms for
each weight shape, the attention kernels) and all of building the self-test's kernels. Most of
that time went to three things the parser redoes on every call, with the same answer each time:

- `ScriptMacro._find_parser_def` looks for the parser on the call stack with
  `inspect.getouterframes`, which reads every frame's source context (and searches sys.modules
  for each frame's module) only to look at the frames' globals; walking `f_back` visits the same
  frames in the same order.
- `Source.__init__` locates a function's source (`inspect.getsourcelines`, `getmodule`, the whole
  module's text) each time a macro or prim_func is made, and the kernel builders make theirs per
  call (`kernels/affine.py` defines three macros per GEMM form): the same code object always
  gives the same text, so it is looked up once per code object.
- `Source.as_ast` re-parses that text into the parser's AST at every macro call; the parser only
  reads the tree, so one tree per text is shared.

Measured on the 0.5B Qwen (2-core EPYC): the CPU graph's export 8.3 -> 3.9 s, the self-test's
kernels 3.1-4.6 -> 1.4 s; the exported module serializes to the same JSON with and without.
`install` is idempotent; each kernel module that parses TVMScript calls it at import.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_lock = threading.Lock()
_installed = False


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from tvm.script.parser.core import diagnostics, parser

        _memo_parser_lookup(parser.ScriptMacro)
        _memo_source(diagnostics.Source)
        _installed = True


def _memo_parser_lookup(macro_cls: type) -> None:
    name = macro_cls.parser_object_name

    def _find_parser_def(self: Any) -> Any:
        frame = sys._getframe(0)
        while frame is not None:
            found = frame.f_globals.get(name)
            if found is not None:
                return found
            frame = frame.f_back
        raise RuntimeError(f"{name} not available")

    macro_cls._find_parser_def = _find_parser_def


def _memo_source(source_cls: type) -> None:
    init, as_ast = source_cls.__init__, source_cls.as_ast
    located: dict[Any, dict[str, Any]] = {}  # code object -> the Source's attributes
    trees: dict[str, Any] = {}  # source text -> its doc AST

    def __init__(self: Any, program: Any) -> None:
        code = getattr(program, "__code__", None)
        if code is None:  # text, or a class (an IRModule's): as before
            init(self, program)
            return
        known = located.get(code)
        if known is None:
            init(self, program)
            located[code] = dict(vars(self))
        else:
            vars(self).update(known)

    def _as_ast(self: Any) -> Any:
        tree = trees.get(self.source)
        if tree is None:
            tree = trees[self.source] = as_ast(self)
        return tree

    source_cls.__init__ = __init__
    source_cls.as_ast = _as_ast
