# SPDX-License-Identifier: Apache-2.0
"""The offline planner: what fits where, and the compile-only proofs behind it.

`plan` builds a model's step program (the runner's `StepProgram`) for a compile-only TPU or GPU
(`targets`, with the GPU device facts in `device_facts/`) from abstract weights (`abstract_weights`)
and reads the compiled program's memory and collectives (`compiled`, `hlo`); `kv` sizes the KV
cache a chip's memory leaves; `depth` extrapolates a full-depth model from few-layer compiles.
Real models' configurations ship in `model_configs/`.
Nothing on the serving path imports this package (`tests/test_layering.py`).
"""
