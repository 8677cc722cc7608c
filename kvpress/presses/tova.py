"""TOVA: keep the tokens the current query attends to most, decided afresh at every step.

Oren et al. 2024, "Transformers are Multi-State RNNs" (arXiv:2401.06104): a decoder with a bounded cache is
a multi-state RNN; Token Omission Via Attention evicts, whenever the cache is over its budget, the token with
the lowest attention from the newest query, averaged over the layer's heads, so every head keeps the same
tokens. Nothing accumulates (unlike H2O): a token the current query ignores can go even if it was once
popular. The paper: ahead of H2O and sink-plus-window policies, and nearly on par with the full cache with
in some cases 1/8 of it (language modelling and long-range tasks, LLaMA-2 and Mistral).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.presses.base import BasePress, Observation


@dataclass
class TOVAPress(BasePress):
    """Keep the tokens the last query attends to most, averaged over the layer's heads.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`); enforced at the prefill (scored by the
            prompt's last query) and at every decoding step (by that step's query).
        window_size: last tokens always kept (default 1: the newest token, whose own query decides).
        n_sink: leading tokens always kept (default 0, as in the paper).

    Heads share one decision while they hold the same tokens (the paper's policy, and what this press does
    from an uncompressed cache); heads of a layer another press left holding different tokens are scored by
    their own query heads only.
    """

    window_size: int = 1
    n_sink: int = 0

    def score(self, obs: Observation) -> torch.Tensor:
        scores = obs.attention_probs(obs.q_len - 1, obs.q_len)[..., 0, :].mean(dim=2)  # [B, Hkv, n]
        pos, valid = obs.layer.pos[..., : scores.shape[-1]], obs.layer.valid
        agree = pos == pos[:, :1]
        if valid is not None:  # (a hole keeps its slot's position: heads agree on what they hold, not on slots)
            valid = valid[..., : scores.shape[-1]]
            agree = (valid == valid[:, :1]) & (agree | ~valid)
        same = agree.all(dim=-1).all(dim=-1)[:, None, None]  # a row's heads hold the same tokens
        return torch.where(same, scores.mean(dim=1, keepdim=True), scores)
