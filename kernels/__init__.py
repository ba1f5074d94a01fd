"""Paged-attention kernels (shipped as `hf_paged_kv.kernels`).

`reference` holds the torch implementations: the CPU default and the ground truth every Triton
kernel is tested against. The pool layout is `[num_blocks, block_size, num_kv_heads, head_dim]`
per layer; block tables are int32 `[batch, max_blocks]` padded with -1.
"""
