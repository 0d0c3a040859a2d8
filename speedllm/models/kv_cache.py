"""Static key/value cache for generation: preallocated, GQA layout, write position tracked here."""

import torch


class KVCache:
    """Keys and values of every layer, [num_layers, batch, num_kv_heads, max_seq_len, head_dim].

    The model writes a forward pass's keys/values at `pos` and advances `pos` after its last layer, so a
    prefill followed by one-token decode steps needs no bookkeeping by the caller. `key_mask` remembers which
    cached positions are real tokens (0 = left padding) so later steps keep ignoring the padding.
    """

    def __init__(self, num_layers, batch, max_seq_len, num_kv_heads, head_dim, dtype=torch.float32, device=None):
        shape = (num_layers, batch, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_mask = torch.ones(batch, max_seq_len, dtype=torch.bool, device=device)
        self.max_seq_len = max_seq_len
        self.pos = 0

    def update(self, layer_id: int, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor):
        """Store this step's keys/values at the write position; return all cached ones up to and including them."""
        end = self.pos + k_BKSD.shape[2]
        self.k[layer_id, :, :, self.pos : end] = k_BKSD
        self.v[layer_id, :, :, self.pos : end] = v_BKSD
        return self.k[layer_id, :, :, :end], self.v[layer_id, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.pos += num_tokens
