# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding: draft tokens proposed on the host, verified inside the one ragged step.

A request with k drafts is scheduled for 1 + k tokens (its last known token, then the drafts);
the forward writes their K/V like any other tokens, the step's logits are taken at every one of
those rows, and `rejection.verify_drafts` keeps the drafts the target model agrees with (greedy:
while equal to its argmax; random: vLLM's rejection rule with the drafts as a one-hot proposal),
then adds one token of its own. vLLM's scheduler rolls back the rejected positions.

Modules: `config` (the engine's choice), `ngram` (the prompt-lookup proposer, vectorized NumPy
with vLLM's min/max n semantics), `draft_model` (a smaller model's k-step draft loop),
`eagle3` (an EAGLE-3 head fed with the target's hidden states), `eagle` (an EAGLE-1 head fed
with its final ones), `mtp` (the target's own multi-token-prediction layer), `rejection` (the
jitted verification), `verdict` (a verify step's rows and their verdict), `verifier` (the program
around it, its warm-up and the host bookkeeping the runner calls).

No vLLM and no torch here.
"""

from tpu_platform.speculation.config import MAX_SPECULATIVE_TOKENS, SpeculationConfig
from tpu_platform.speculation.ngram import propose_ngram

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpeculationConfig", "propose_ngram"]
