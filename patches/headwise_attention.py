"""Attention over a `HeadwiseLayer`: each (row, KV head) attends over its own variable-length slots.

A chunk (several new tokens) runs once per (row, KV head) over that head's slots, for the `g` query heads that
share it (GQA without repeating keys), as torch's `scaled_dot_product_attention` in blocks of queries: no padding,
no mask over evicted slots. The `q` newest slots of every head are this forward's tokens: causal among themselves.
On a sliding-window layer a query also sees only the slots less than `window` positions behind it. A decoding
step (one token) runs two matrix products per (row, KV head) over the head's segment of the packed storage.
Returns transformers' layout `[B, q, Hq, D]`.

For a press that reads the attention each slot receives (H2O, KVzap with a mass scorer) the chunk or step also
returns that mass, from the weights it computed the output with (`mass_block`), so the press does not compute
each head's weights again.

On a GPU (a device `blocked_attention.DEVICES` leaves out) a chunk over a layer without a window runs as one sdpa
call per (row, KV head) with torch's bottom-right causal bias (`causal_lower_right`: every held slot visible, the
new ones causal) and the KV head shared: torch's flash kernel then runs it with no mask, where a boolean mask with
a shared KV head leaves sdpa its math kernel alone, which holds every weight (H200, 8K tokens: AdaKV's peak 109 MB
against 62 with cuDNN's kernel).

On CUDA (`VARLEN_DEVICES`) a layer's whole attention, every (row, KV head) of a decoding step or of a chunk with no
window, is one call of torch's variable-length flash kernel (FlashAttention-2's varlen entry,
`aten._flash_attention_forward` with `seqused_k`): each pair is a sequence of its `q` queries for its `g` query
heads over its segment of the packed storage (`HeadwiseLayer.segments`: where each segment starts, how many slots
it holds; the spare room after them is not read), the new tokens causal, aligned bottom-right as above. Where that
kernel does not apply (fp32, a head size it does not take, soft-capping, the mass returned, quantized slots, a
chunk over a sliding window, autograd, a GPU older than sm80 or a torch without `seqused_k`) the loop above runs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kvpress.patches import blocked_attention as blocked
from kvpress.patches.cache import PressedLayer
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.user_warnings import warn

VARLEN_DEVICES = ("cuda",)  # the device types a head-wise layer's attention runs in one variable-length call on
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the dtypes torch's flash kernel takes


def headwise_attention(
    module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, mass_block: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of `query` `[B, Hq, q, D]` (post-RoPE) over `layer`, whose newest `q` slots per head
    are the query tokens; `[B, q, Hq, Dv]`, and with `mass_block` (queries a block) the attention mass: `[slots]`
    fp32 aligned with the layer's packed storage, the weight each held slot received from the queries of its KV
    head, summed (0 in spare room), computed from the weights of the output (`attention_with_mass`); else None.
    `softcap`: the tanh cap the model's attention call was given (its `softcap=`), None for none."""
    scale = float(module.scaling)
    if mass_block is None and not softcap and _one_call(query, layer):
        return _varlen(query, layer, scale), None
    return _pairs(query, layer, scale, softcap, mass_block)


def _pairs(
    query: torch.Tensor, layer: HeadwiseLayer, scale: float, softcap: float | None, mass_block: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`headwise_attention` pair by pair: a decoding step's two products or a chunk's call per (row, KV head)."""
    b, hq, q, d = query.shape
    g = hq // layer.heads
    mass = None if mass_block is None else torch.zeros(layer.bounds[-1], dtype=torch.float32, device=query.device)
    if q == 1 and layer.window is not None and max(layer.lengths) > layer.window:  # (a step applies no window mask)
        raise RuntimeError(f"a head-wise sliding-window layer holds {max(layer.lengths)} slots in a head, past its "
                           f"window of {layer.window}: it was not trimmed after its last forward")  # fmt: skip
    if q == 1:
        return _one_query(query, layer, scale, mass, softcap), mass
    out = query.new_empty(b, hq, q, layer.value_dim or d)
    # a GPU's bottom-right causal call (see above): a chunk with no window, no soft-capping and no mass to return
    fused = layer.window is None and not softcap and mass is None and query.device.type not in blocked.DEVICES
    for row in range(b):
        for head in range(layer.heads):
            keys, values = layer.pair(row, head)
            n = keys.shape[0]
            group = query[row, head * g : (head + 1) * g]  # [g, q, D]
            rows_mask = None  # a block of queries' rows of the mask, made when the block runs (None: no mask)
            if layer.window is not None:  # (q > 1 here: a step returned above)
                rows_mask = functools.partial(_window_rows, layer.slot("pos", row, head).long(), n - q, layer.window)
            elif mass is None and not softcap and not fused:  # (the mass, soft-capping and the fused
                # call need no causal mask: `attention_with_mass` aligns the new tokens causally itself)
                rows_mask = functools.partial(_causal_rows, n - q, query.device)
            if mass is not None or softcap:  # the weights summed for the press (from the same computation as the
                # output), or soft-capped logits, which sdpa does not take: in blocks of queries either way
                rows4 = None if rows_mask is None else functools.partial(_rows4, rows_mask)
                block = mass_block if mass is not None else blocked.QUERY_BLOCK
                res, received = blocked.attention_with_mass(group[None], keys[None, None], values[None, None],
                                                            rows4, block, scale, softcap)  # fmt: skip
                if mass is not None:
                    start = layer.bounds[row * layer.heads + head]
                    mass[start : start + n] = received[0, 0]
                res = res[0].transpose(0, 1)
            elif fused:
                res = blocked.bottom_right_attention(group[None], keys[None, None], values[None, None], scale)[0]
            else:  # a chunk: g heads sharing one KV head and one mask (folding would repeat the mask g times and, on
                # the CPU, leave the fused kernel for one that holds every g * q x n weight), in blocks of queries,
                # each over the slots it can see, its rows of the mask made for it alone (torch's CPU kernel copies
                # the mask as floats)
                res = blocked.blocked_attention(group[None], keys[None, None], values[None, None], rows_mask, scale)
                res = res.transpose(1, 2)
            out[row, head * g : (head + 1) * g] = res.reshape(g, q, -1)
    return out.transpose(1, 2).contiguous(), mass


def _one_call(query: torch.Tensor, layer: HeadwiseLayer) -> bool:
    """Whether torch's variable-length flash kernel runs this attention (no soft-capping nor mass asked: see the
    module docstring)."""
    q, d = query.shape[2], query.shape[3]
    return (query.device.type in VARLEN_DEVICES and layer.kv_bits is None and (q == 1 or layer.window is None)
            and query.dtype in FLASH_DTYPES and d % 8 == 0 and d <= 256 and layer.value_dim == d
            and not (torch.is_grad_enabled() and query.requires_grad) and _flash_runs_on(query.device))  # fmt: skip


@functools.cache
def _flash_runs_on(device: torch.device) -> bool:
    """Whether torch's variable-length flash kernel with `seqused_k` runs on `device` (CUDA: sm80 or newer) and gives
    the pairs' answer on a small head-wise layer (`_kernel_check`, once a device); a kernel that fails it is named in
    a warning."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or "seqused_k" not in str(op.default._schema):
        return False
    if device.type == "cuda" and not (
        torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device)[0] >= 8
    ):
        return False
    why = _kernel_check(device)
    if why is not None:
        warn(f"torch's variable-length flash kernel failed kvpress's check on {device} ({why}): head-wise "
             "layers attend pair by pair there")  # fmt: skip
    return why is None


def _kernel_check(device: torch.device) -> str | None:
    """What is wrong with the one call's answer against the pairs' on a small head-wise layer of `device` (two KV
    heads of two query heads, spare slots after each head's; a decoding step and a chunk of 3), or None."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    difference = 0.0
    for q in (1, 3):
        query, layer = _random_layer(device, dtype, 1, 2, 2, 12, q)
        try:
            one = _varlen(query, layer, 0.125)
        except RuntimeError as error:
            return f"{type(error).__name__}: {error}"
        pairs = _pairs(query, layer, 0.125, None, None)[0]
        difference = max(difference, float((one.float() - pairs.float()).abs().max()))
    return None if difference <= 0.02 else f"its output differs from the pairs' by {difference:.3g}"


def _random_layer(device: torch.device, dtype: torch.dtype, batch: int, heads: int, g: int, n: int,
                  q: int) -> tuple[torch.Tensor, HeadwiseLayer]:  # fmt: skip
    """`(query, layer)`: a random head-wise layer of `batch` rows and `heads` KV heads (heads keeping 10-90% of `n`
    slots) after `q` new tokens, each pair with room after its slots, and their queries (`g` a KV head); drawn from a
    generator of their own (the global one is left as it is)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    dense = PressedLayer()
    dense.update(rand(batch, heads, n, 64), rand(batch, heads, n, 64))
    keep = torch.rand(batch, heads, n, generator=gen) < torch.linspace(0.1, 0.9, heads)[:, None]
    layer = HeadwiseLayer.from_dense(dense, keep.to(device))
    layer.driven = True
    layer.update(rand(batch, heads, q, 64), rand(batch, heads, q, 64))
    layer.commit()
    return rand(batch, heads * g, q, 64), layer


def _varlen(query: torch.Tensor, layer: HeadwiseLayer, scale: float) -> torch.Tensor:
    """Every (row, KV head) of `layer` in one variable-length call: pair `i` is a sequence of its `q` queries
    (`g` heads over one KV head) over its held slots, the new ones causal (bottom-right); `[B, q, Hq, D]`."""
    b, hq, q, d = query.shape
    h = layer.heads
    g = hq // h
    queries = query.view(b, h, g, q, d).transpose(2, 3).reshape(b * h * q, g, d)  # pair by pair, token by token
    starts, held = layer.segments()
    per_pair = torch.arange(0, (b * h + 1) * q, q, dtype=torch.int32, device=query.device)
    keys, values = layer.store["keys"].unsqueeze(1), layer.store["values"].unsqueeze(1)  # [slots, 1, D]
    out = flash_varlen(queries, keys, values, per_pair, starts, q, max(layer.lengths), q > 1, scale, held)
    return out.view(b, h, q, g, d).permute(0, 2, 1, 3, 4).reshape(b, q, hq, d)


def flash_varlen(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float,
                 used_k: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """torch's variable-length flash kernel: sequence `i` is queries `cu_q[i]:cu_q[i + 1]` `[T_q, Hq, D]` over the
    first `used_k[i]` keys and values from `cu_k[i]` `[T_k, Hk, D]` (query head `j` on KV head `j // (Hq / Hk)`),
    `causal` aligned bottom-right; `[T_q, Hq, D]`."""
    return torch.ops.aten._flash_attention_forward(query, keys, values, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   scale=scale, seqused_k=used_k)[0]  # fmt: skip


def check_one_call(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The one variable-length call against the pair-by-pair path on `device`: random head-wise layers (2 rows, 4 KV
    heads of 7 query heads each, heads keeping 10-90% of 300 slots), a decoding step and a 7-token chunk; per query
    length, whether the call applies there and the largest difference of the outputs (and the largest value)."""
    out = {}
    for q in (1, 7):
        query, layer = _random_layer(device, dtype, 2, 4, 7, 300, q)
        with torch.inference_mode():
            one = _one_call(query, layer)
            pairs = _pairs(query, layer, 0.125, None, None)[0].float()
            varlen = _varlen(query, layer, 0.125).float() if one else pairs
        out[f"q={q}"] = {"one_call": one, "max_difference": (varlen - pairs).abs().max().item(),
                         "max_value": pairs.abs().max().item()}  # fmt: skip
    return out


def _one_query(query: torch.Tensor, layer: HeadwiseLayer, scale: float, mass: torch.Tensor | None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """A decoding step: per (row, KV head), its `g` queries over the head's segment of the packed storage as two
    matrix products written into the output (a sdpa call per head, or one product over every head's slots, costs
    more than this work); `[B, 1, Hq, Dv]`. The logits are in the model's dtype, the softmax in fp32 (as transformers'
    eager attention; sdpa keeps the logits in fp32 too inside its kernel): in bf16 its error is eager's, above sdpa's.
    Quantized layers read each head decoded (`pair`). `mass`: the packed attention mass to fill (see
    `headwise_attention`), or None; `softcap`: the logits capped as `softcap * tanh(logits / softcap)`."""
    b, hq, _, d = query.shape
    h = layer.heads
    scaled = (query[:, :, 0] * scale).view(b, h, hq // h, d)  # each KV head's g queries
    out = query.new_empty(b, h, hq // h, layer.value_dim or d)
    keys, values = layer.store["keys"], layer.store["values"]
    grad = torch.is_grad_enabled()  # (no_grad and inference mode, as in generate, keep the out= products)
    for row in range(b):
        for head in range(h):
            i = row * h + head
            if layer.kv_bits is None:
                start, end = layer.bounds[i], layer.bounds[i] + layer.lengths[i]
                k, v = keys[start:end], values[start:end]
            else:
                k, v = layer.pair(row, head)
            logits = torch.mm(scaled[row, head], k.T)
            if softcap:  # (Gemma-2 style: the scaled logits capped)
                logits = torch.tanh(logits / softcap) * softcap
            exact = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (as eager: fp32, then the model's dtype)
            weights = exact if v.dtype == torch.float32 else exact.to(v.dtype)
            if grad:  # autograd takes no out=: the product is copied in (training code, a probe)
                out[row, head] = torch.mm(weights, v)
            else:
                torch.mm(weights, v, out=out[row, head])
            if mass is not None:  # (from the fp32 weights: a bf16 model's mass is not rounded to its dtype)
                torch.sum(exact, dim=0, out=mass[layer.bounds[i] : layer.bounds[i] + layer.lengths[i]])
    return out.view(b, 1, hq, -1)


def _causal_rows(held: int, device, rows: tuple[int, int]) -> torch.Tensor:
    """Queries `rows` = (s, e) of a chunk after `held` slots: each sees the held slots and the new ones up to
    itself, `[e - s, held + e]` bool."""
    s, e = rows
    return torch.ones(e - s, held + e, dtype=torch.bool, device=device).tril(held + s)


def _window_rows(pos: torch.Tensor, held: int, window: int, rows: tuple[int, int]) -> torch.Tensor:
    """Queries `rows` = (s, e) of a chunk after `held` slots of positions `pos` on a sliding-window layer: each sees
    the slots at its position or before it, less than `window` positions back, `[e - s, held + e]` bool."""
    s, e = rows
    mine, seen = pos[held + s : held + e, None], pos[None, : held + e]
    return (seen <= mine) & (seen > mine - window)


def _rows4(rows_mask, rows: tuple[int, int]) -> torch.Tensor:
    """`rows_mask`'s rows shaped `[1, 1, rows, slots]`, as `attention_with_mass` takes a mask."""
    return rows_mask(rows=rows)[None, None]
