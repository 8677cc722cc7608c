"""Everything that touches transformers internals lives here, so one place changes when transformers does.
It imports nothing from the rest of kvpress (`tests/test_layout.py`).

- `intercept`: `Intercept`, which installs the attention intercept on a model for the caller that entered a
  press (attention and mask registries, implementation switch, forward hooks) and restores it; the
  masks of compressed layers.
- `cache`, `head_cache`: the cache layer classes (`PressedLayer`, `HeadwiseLayer`) and `cache_bytes`.
- `headwise_attention`: attention over per-head storage.
- `model_access`: what a model family looks like (decoder, rotary embedding, eager kernel, cache keyword).
- `rope`: re-rotating cached keys to new positions.
- `user_warnings`: `warn`, which says a warning at the user's line, in the category `KVPressWarning`.
"""
