# SPDX-License-Identifier: Apache-2.0
"""The XLA runtime: request state, padded inputs, the jitted step and sampler (pure JAX, no vLLM).

`Runner(RunnerConfig(...))` drives a model step by step from plain `StepUpdate`s; see
`tpu_platform.runner`. Environment knobs are read only in `tpu_platform.envs`.
"""
