"""Everything that touches transformers internals lives here, so one place changes when transformers does.

- `model_access`: what a model family looks like (decoder, rotary embedding, eager kernel, cache keyword).
- `rope`: re-rotating cached keys to new positions.
- `attention`: the attention intercept registered with `AttentionInterface` / `AttentionMaskInterface`.
- `install`: `PressInstallation`, the context that installs a press on a model and restores it.
"""
