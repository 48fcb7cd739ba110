"""Triton kernels, each beside a torch implementation and a `*_ref` reference.

- `kernels.bitmask`: apply_bitmask / apply_bitmask_torch / apply_bitmask_ref
- `kernels.kv_store`: store_kv / store_kv_ref
- `kernels.paged_attention`: paged_attention / paged_attention_ref

On CPU the Triton kernels run only in the interpreter (TRITON_INTERPRET=1);
see `kernels._jit`.
"""

from kernels import bitmask, kv_store, paged_attention

__all__ = ["bitmask", "kv_store", "paged_attention"]
