"""Structured outputs in the engine: grammars compiled off the compute thread, token masks applied
to each constrained row's logits inside the shared batch, and forced tokens jumping ahead.

- :mod:`~inference.engine.structured.compiler`: :class:`GrammarCompiler` compiles a request's
  :class:`~inference.protocol.structured.StructuredOutput` against the model's tokenizer with
  llguidance (``guidance-ai/llguidance``) under its fuel limits, on its own threads, with a
  bounded LRU cache of compiled grammars and a per-tenant cap on compiles in flight.
- :mod:`~inference.engine.structured.row_grammar`: :class:`RowGrammar`, one row's matcher: its
  token mask (computed on a mask thread, overlapping the forward pass, with the GIL released by
  llguidance), the tokens it consumes, the tokens its grammar forces next.

``docs/engine.md``, "Structured outputs", gives the design and the measured figures.
"""

from inference.engine.structured.compiler import GrammarCompiler
from inference.engine.structured.row_grammar import RowGrammar, prefetch_masks

__all__ = ["GrammarCompiler", "RowGrammar", "prefetch_masks"]
