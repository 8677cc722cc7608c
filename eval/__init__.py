"""The eval bridge: benchmarks, lm-eval model, offline tasks, sweeps (installed as kvpress.eval).

`kvpress.eval.KVPressLM` is imported on first use (it needs lm-eval: `pip install 'kvpress[eval]'`).
"""


def __getattr__(name: str):
    if name == "KVPressLM":
        from kvpress.eval.lm_eval_bridge import KVPressLM

        return KVPressLM
    raise AttributeError(f"module 'kvpress.eval' has no attribute {name!r}")
