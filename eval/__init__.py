"""The eval bridge: benchmarks, lm-eval model, offline tasks (installed as kvpress.eval)."""
