"""Constrained decoding: constraint checks, backends (xgrammar, outlines-core),
and the StructuredOutputManager that owns per-request matchers.

Import from the modules (`grammar.manager`, `grammar.selection`, ...): this
package file stays empty so that `grammar.outlines_worker` can run in a fresh
process without importing torch or xgrammar.
"""
